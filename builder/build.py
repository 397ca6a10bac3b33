"""v4build's main job: checkpoint folder -> engine directory (DESIGN.md, "The three parts and the one flow").

The build runs in a temporary folder next to OUT and is renamed to OUT only at the very end, so an
interrupted or failed build leaves no OUT and no partial files. Steps: read and check the checkpoint
against config.json; export `target` (and `draft` when mtp > 0) on the meta device; attach the weights
(references into the checkpoint, builder/weights.py); add the v4 op functions; check every graph with
onnx.checker (full) and strict shape inference; write engine.json; let the backend compile and check.
"""
from __future__ import annotations

import importlib.metadata
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from tqdm import tqdm

from v4engine.plugins import DOMAIN, OPSET, onnx_functions
from v4engine.runtime.engine import EngineManifest, GraphEntry, cache_group_dict
from v4engine.runtime.errors import V4EngineError
from v4engine.runtime.staging import staged_folder

from .backends import compile_engine
from .export import export_graph, graph_specs
from .load import open_checkpoint
from .weights import WeightWriter, attach_weights, serialize_without_data

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
TOOLS = ("torch", "onnx", "onnxscript", "onnxruntime", "safetensors", "v4engine")


class BuildError(V4EngineError):
    """The build cannot start or finish (output folder, options)."""


@dataclass
class BuildOptions:
    checkpoint: Path
    output: Path
    mtp: int = 1
    backend: str = "onnxruntime"
    dtype: str = "fp32"
    max_batch: int = 8
    max_seq_len: int = 4096
    force: bool = False
    progress: bool = True


def _check_output(options: BuildOptions) -> None:
    out = options.output
    if out.exists() and not options.force:
        raise BuildError(f"{out}: already exists (pass --force to replace it)")
    if out.exists() and not out.is_dir():
        raise BuildError(f"{out}: exists and is not a folder; --force only replaces an engine folder")
    if out.exists() and options.checkpoint.resolve().is_relative_to(out.resolve()):
        raise BuildError(f"{out}: holds the checkpoint itself; choose another --output")
    parent = out.parent
    if not parent.is_dir():
        raise BuildError(f"{parent}: the folder for the engine does not exist")
    try:
        probe = tempfile.TemporaryFile(dir=parent)
        probe.close()
    except OSError as e:
        raise BuildError(f"{parent}: cannot write the engine here ({e.strerror})") from None
    if options.mtp < 0:
        raise BuildError(f"--mtp must be >= 0 (got {options.mtp})")


def _versions() -> dict[str, str]:
    out = {}
    for tool in TOOLS:
        try:
            out[tool] = importlib.metadata.version(tool)
        except importlib.metadata.PackageNotFoundError:
            out[tool] = "not installed"
    return out


def _write_graph(tmp: Path, name: str, options: BuildOptions, cfg, ckpt, writer: WeightWriter) -> dict[str, int]:
    draft = name == "draft"
    model = export_graph(cfg, draft=draft, dtype=DTYPES[options.dtype], max_batch=options.max_batch,
                         max_seq_len=options.max_seq_len)
    proto = serialize_without_data(model)
    counts = attach_weights(proto, ckpt, cfg, writer)
    proto.functions.extend(onnx_functions())
    del proto.opset_import[:]
    proto.opset_import.extend([onnx.helper.make_opsetid("", OPSET), onnx.helper.make_opsetid(DOMAIN, 1)])
    check_graph(proto, {w.file: w.bytes for w in writer.files()})
    onnx.save(proto, tmp / f"{name}.onnx")
    return counts


def check_graph(proto: onnx.ModelProto, weight_files: dict[str, int]) -> None:
    """onnx.checker (full check) and strict shape inference.

    The checker insists that external data lives in regular, singly linked files inside the model folder,
    which our zero-copy links into the checkpoint are not; it runs beside sparse stand-ins of the same sizes.
    """
    with tempfile.TemporaryDirectory() as scratch:
        for location, size in weight_files.items():
            stand_in = Path(scratch) / location
            stand_in.parent.mkdir(parents=True, exist_ok=True)
            with open(stand_in, "wb") as f:
                f.truncate(size)
        onnx.save(proto, Path(scratch) / "graph.onnx")
        onnx.checker.check_model(str(Path(scratch) / "graph.onnx"), full_check=True)
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)


def build(options: BuildOptions) -> EngineManifest:
    """Build the engine directory options.output; returns its manifest."""
    started = time.perf_counter()
    _check_output(options)
    cfg, ckpt = open_checkpoint(options.checkpoint, mtp=options.mtp > 0)
    with staged_folder(options.output, "building") as tmp:
        writer = WeightWriter(tmp)
        try:
            parts = ["target"] + (["draft"] if options.mtp > 0 else [])
            treatment: dict[str, int] = {}
            for name in tqdm(parts, desc="export", unit="graph", disable=not options.progress):
                for k, v in _write_graph(tmp, name, options, cfg, ckpt, writer).items():
                    treatment[k] = treatment.get(k, 0) + v
            weights = writer.close()
            tokenizer = [f for f in TOKENIZER_FILES if (options.checkpoint / f).is_file()]
            for f in tokenizer:
                shutil.copy2(options.checkpoint / f, tmp / f)
            value_bytes = DTYPES[options.dtype].itemsize
            graphs, caches = {}, {}
            for name in parts:
                inputs, outputs = graph_specs(cfg, draft=name == "draft", dtype=str(DTYPES[options.dtype])[6:])
                graphs[name] = GraphEntry(f"{name}.onnx", tuple(inputs), tuple(outputs))
                groups = cfg.cache_groups(name == "draft", options.mtp, value_bytes)
                caches[name] = [cache_group_dict(g, "mtp" if name == "draft" else cfg.layer_types[g.layer])
                                for g in groups]
            experts = {"mxfp4": "MXFP4 routed experts dequantized to the activation dtype into weights/converted.bin "
                                "(ONNX Runtime has no FP4 DequantizeLinear)",
                       "fp8": "FP8 routed experts kept FP8 in place, blocked DequantizeLinear"}.get(
                cfg.expert_dtype or "", "as stored, in place")
            manifest = EngineManifest(
                model=cfg, backend=options.backend, mtp=options.mtp, dtype=options.dtype, graphs=graphs,
                caches=caches, weights=weights, experts=experts, tokenizer=tokenizer,
                checkpoint={"path": str(options.checkpoint.resolve()), "fingerprint": ckpt.fingerprint(),
                            "tensors": len(ckpt.names()), "scheme": ckpt.scheme},
                tools=_versions(),
                build={"max_batch": options.max_batch, "max_seq_len": options.max_seq_len, "opset": OPSET,
                       "weights": treatment})
            manifest.write(tmp)
            manifest.build["compile"] = compile_engine(tmp, manifest)
            manifest.build["seconds"] = round(time.perf_counter() - started, 2)
            manifest.write(tmp)
        finally:
            writer.close()
    return manifest
