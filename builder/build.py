"""v4build's main job: checkpoint folder -> engine directory (docs/architecture.md §1).

The build runs in a temporary folder next to OUT and is renamed to OUT only at the very end, so an
interrupted or failed build leaves no OUT and no partial files. Steps: read and check the checkpoint
against config.json; export `target` (or its pipeline stages) and the draft graph of the checkpoint's drafter
(when mtp > 0) on the meta device; attach the weights
(references into the checkpoint, builder/weights.py); add the v4 op functions; check every graph with
onnx.checker (full) and strict shape inference; write engine.json; let the backend compile and check.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import onnx
import torch
from tqdm import tqdm

from v4engine.chat.encoding import ENCODER_FILE, profile_of_encoder
from v4engine.contract.backend_options import BackendOptions
from v4engine.contract.backends import BACKENDS, INT8_CODES, PREPACKED, STORED_BYTES, Backend
from v4engine.contract.config import V4Config
from v4engine.contract.drafting import DRAFT_SPECS, DraftSpec
from v4engine.contract.engine import (ACTIVATION_DTYPES, BUILT_LIMIT_DEFAULTS, FORMAT, MANIFEST, MAX_MTP, VALUE_BYTES,
                                     EngineManifest, GraphEntry, StageEntry, cache_layouts, check_limits)
from v4engine.contract.errors import V4EngineError
from v4engine.contract.layout import target_specs
from v4engine.contract.stages import Stage, single_stage
from v4engine.contract.staging import Ours, check_destination, staged_folder
from v4engine.contract.untrusted import read_json
from v4engine.plugins import DOMAIN, OPSET, onnx_functions
from v4engine.plugins.sinkhorn import NAME as SINKHORN

from .backends import compile_engine, preflight, prepare_graph
from .backends.migraphx import all_nodes
from .checkpoint import checkpoint_file
from .export import export_draft, export_target, split_sequences
from .export_cache import cached_export
from .load import open_checkpoint
from .stages import StageError, model_bytes, plan_stages
from .weights import WeightGroup, WeightWriter, attach_weights, expert_form, group_bytes, serialize_without_data

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_ENCODER_BYTES = 1 << 20       # a checkpoint's encoding_dsv4.py is about 29 KB


def chat_profile_of(checkpoint: Path) -> str | None:
    """The release whose chat encoding the checkpoint ships (chat/encoding.py profile_of_encoder), read from its
    encoding/encoding_dsv4.py as text; None without one. The file must lie inside the checkpoint folder."""
    if not (checkpoint / ENCODER_FILE).is_file():
        return None
    path = checkpoint_file(checkpoint, ENCODER_FILE, str(checkpoint))
    if path.stat().st_size > MAX_ENCODER_BYTES:
        raise BuildError(f"{path}: {path.stat().st_size} bytes, more than a chat encoder holds "
                         f"({MAX_ENCODER_BYTES}); refused")
    return profile_of_encoder(path.read_bytes().decode("utf-8", "replace"))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
TOOLS = ("torch", "onnx", "onnxscript", "onnxruntime", "safetensors", "v4engine")


class BuildError(V4EngineError):
    """The build cannot start or finish (output folder, options)."""


@dataclass
class BuildOptions:
    checkpoint: Path
    output: Path
    mtp: int | None = 1                        # draft tokens per step; None: the checkpoint's drafter's default
    backend: str = "onnxruntime"
    dtype: str | None = None                   # None: the backend's for its device (BackendOptions.default_dtype)
    max_batch: int = BUILT_LIMIT_DEFAULTS["max_batch"]
    max_seq_len: int = BUILT_LIMIT_DEFAULTS["max_seq_len"]
    max_prefill_chunk: int = BUILT_LIMIT_DEFAULTS["max_prefill_chunk"]
    force: bool = False
    progress: bool = True
    pipeline_stages: int = 1                   # the target split into this many graphs, one per device
    backend_options: dict[str, Any] = field(default_factory=dict)    # the backend's (contract/backend_options.py)


def _is_engine_manifest(path: Path) -> bool:
    try:
        return read_json(path, BuildError, "", limit=64 << 20).get("format") == FORMAT
    except (BuildError, OSError, AttributeError):
        return False


def _engine_entry(entry: PurePosixPath) -> bool:
    """What a build writes: engine.json, graphs, weights/ (linked shards, converted.bin), tokenizer files, compiled
    plans or programs."""
    if len(entry.parts) == 2:
        return entry.parts[0] == "weights" and entry.suffix in (".safetensors", ".bin")
    return (entry.name in {MANIFEST, "weights", *TOKENIZER_FILES} or entry.suffix == ".onnx"
            or any(backend.writes(entry.name) for backend in BACKENDS.values()))


# The only kind of folder `--force` replaces
ENGINE_FOLDER = Ours("an engine folder built by v4build", MANIFEST, _engine_entry, _is_engine_manifest)


def _check_output(options: BuildOptions) -> BackendOptions:
    """Refuse, in one line, what cannot be built as asked; the backend's own options, read."""
    out = options.output
    check_destination(out, options.force, ENGINE_FOLDER)
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
    if options.mtp is not None and not 0 <= options.mtp <= MAX_MTP:
        raise BuildError(f"--mtp must be from 0 to {MAX_MTP} (got {options.mtp})")
    if options.backend not in BACKENDS:
        raise BuildError(f"--backend must be one of {', '.join(BACKENDS)} (got {options.backend!r})")
    if not isinstance(options.pipeline_stages, int) or options.pipeline_stages < 1:
        raise BuildError(f"--pipeline-stages must be 1 or more (got {options.pipeline_stages})")
    if options.dtype is not None and options.dtype not in DTYPES:
        raise BuildError(f"--dtype must be one of {', '.join(DTYPES)} (got {options.dtype!r})")
    return BACKENDS[options.backend].build_options.read(options.backend_options, options.backend, BuildError)


def _versions() -> dict[str, str]:
    out = {}
    for tool in TOOLS:
        try:
            out[tool] = importlib.metadata.version(tool)
        except importlib.metadata.PackageNotFoundError:
            out[tool] = "not installed"
    return out


class StageClock:
    """Wall seconds per build stage, summed over graphs (recorded in engine.json as build.stages)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = round(self.seconds.get(stage, 0.0) + now - self._last, 2)
        self._last = now


def _write_graph(tmp: Path, name: str, options: BuildOptions, backend: BackendOptions, cfg, ckpt,
                 writer: WeightWriter, clock: StageClock, stage: Stage | None, draft: DraftSpec | None
                 ) -> tuple[dict[str, int], dict[str, WeightGroup], Any]:
    """Export, attach weights, prepare for the backend (`backend`: its build options), check and save one graph
    (the draft, or a stage of the target): (weight counts, bytes by weight group, what the backend's preparation
    recorded)."""
    static = backend.cuda_graph_ready           # without control flow, for CUDA graphs
    proto = exported_graph(cfg, stage, options, draft, static)
    clock.lap("export")
    counts, groups = attach_weights(proto, ckpt, cfg, writer, BACKENDS[options.backend].on(backend.device))
    add_functions(proto, cfg.hc_sinkhorn_iters - 1 if static else None)
    clock.lap("weights")
    proto, prepared = prepare_graph(options.backend, proto, name, backend)
    if static and (found := control_flow(proto)):
        raise BuildError(f"--cuda-graphs: graph '{name}' still has {', '.join(sorted(found))} nodes, which a CUDA "
                         "graph cannot hold")
    clock.lap("prepare")
    check_graph(proto, {w.file: w.bytes for w in writer.files()})
    clock.lap("check")
    onnx.save(proto, tmp / f"{name}.onnx")
    clock.lap("save")
    return counts, groups, prepared


def exported_graph(cfg: V4Config, stage: Stage | None, options: BuildOptions, draft: DraftSpec | None,
                   static: bool = False) -> onnx.ModelProto:
    """The exported draft graph of `draft` (stage None) or target stage graph (returning what `draft` reads),
    serialized without data, its sequence splits made Splits: a fresh copy of what builder/export_cache.py kept of
    the same export, or exported now."""
    is_draft = stage is None
    cfg = exported_config(cfg, reads_drafter=is_draft or bool(draft and draft.captured_layers(cfg)))
    key = (json.dumps(cfg.to_dict(), sort_keys=True), stage, draft.method if draft else None, options.dtype,
           options.mtp if is_draft else 0, static and is_draft)

    def export() -> bytes:
        dtype = DTYPES[options.dtype]
        model = export_draft(cfg, draft, options.mtp, dtype, conditional=not static) if is_draft \
            else export_target(cfg, dtype, stage=stage, draft=draft)
        proto = serialize_without_data(model)
        split_sequences(proto.graph)
        return proto.SerializeToString()

    return onnx.ModelProto.FromString(cached_export(key, export))


def exported_config(cfg: V4Config, reads_drafter: bool = True) -> V4Config:
    """The config a graph is exported from: the checkpoint's, less how it stores its weights (dtype, FP8 blocks,
    MXFP4 experts), which only attach_weights and the backend's preparation read, after the export, and less the
    DSpark drafter's fields where the graph reads none (`reads_drafter` False: a target graph that captures no
    layer for a drafter). So checkpoints that differ only in storage, or only in a drafter the graph does not
    serve, share one export (the key is what the export reads)."""
    return dataclasses.replace(cfg, torch_dtype="bfloat16", expert_dtype=None, quantization=None,
                               dspark=cfg.dspark if reads_drafter else None)


def add_functions(proto: onnx.ModelProto, sinkhorn_rounds: int | None = None) -> None:
    """The v4 ops' functions and the opsets the graph imports (`sinkhorn_rounds`: the Sinkhorn's rounds written
    out, for CUDA graphs; every Sinkhorn node of the graph then has that many)."""
    if sinkhorn_rounds is not None:         # the unrolled function holds one count: every node must ask for it
        counts = {a.i for body in (proto.graph, *proto.functions) for n in all_nodes(body) if n.op_type == SINKHORN
                  for a in n.attribute if a.name == "rounds"}
        if counts - {sinkhorn_rounds}:
            raise BuildError(f"--cuda-graphs: Sinkhorn nodes of {sorted(counts)} rounds, the config says "
                             f"{sinkhorn_rounds}")
    proto.functions.extend(onnx_functions(sinkhorn_rounds))
    del proto.opset_import[:]
    proto.opset_import.extend([onnx.helper.make_opsetid("", OPSET), onnx.helper.make_opsetid(DOMAIN, 1)])


CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def control_flow(proto: onnx.ModelProto) -> set[str]:
    """The control-flow ops anywhere in the graph, its subgraphs or its functions (none may be in a CUDA graph)."""
    return {node.op_type for body in (proto.graph, *proto.functions) for node in all_nodes(body)
            if node.op_type in CONTROL_FLOW}


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


def _experts(expert_dtype: str | None, backend: Backend) -> str:
    """What engine.json says of the routed experts' weights (`backend`: the record for the engine's device)."""
    fmt = {"fp4": "mxfp4", "mxfp4": "mxfp4", "fp8": "fp8_block"}.get(expert_dtype or "")
    if backend.expert_weights == PREPACKED:
        return ("routed experts prepacked at build into weights/converted.bin, stacked per layer in the layout ONNX "
                "Runtime's CUDA MoE takes (MXFP4: QMoE's fp4 form; FP8: their bytes, widened on the device per call; "
                "float: the activation dtype)")
    if fmt is None:
        return "as stored, in place"
    name = "MXFP4" if fmt == "mxfp4" else "FP8"
    form = expert_form(backend, fmt)
    if form == INT8_CODES:
        return ("MXFP4 routed experts kept in place; the graph widens them at load to the exact int8 codes (128 + 2c) "
                "and 2^(e-128) scales of ONNX Runtime's QMoE")
    if form == STORED_BYTES:
        return (f"{name} routed experts kept in place as their bytes with float32 scales; the MoE dequantizes only "
                "the chosen experts")
    if fmt in backend.quantized_in_place:
        return f"{name} routed experts kept {name} in place: blocked DequantizeLinear, scales in place or as float rows"
    return f"{name} routed experts dequantized to the activation dtype into weights/converted.bin"


def _stages(options: BuildOptions, backend: Backend, cfg: V4Config, ckpt) -> list[Stage]:
    """The target's pipeline stages: one, or --pipeline-stages of about equal resident bytes (builder/stages.py;
    `backend`: the record for the engine's device)."""
    if options.pipeline_stages == 1:
        return single_stage(cfg.num_hidden_layers)
    try:
        sizes = model_bytes(cfg, ckpt, backend, DTYPES[options.dtype], options.mtp > 0)
        return plan_stages(sizes, options.pipeline_stages, options.mtp > 0)
    except StageError as e:
        raise BuildError(str(e)) from None


def build(options: BuildOptions) -> EngineManifest:
    """Build the engine directory options.output; returns its manifest."""
    started = time.perf_counter()
    clock = StageClock()
    backend = _check_output(options)
    options = dataclasses.replace(options, dtype=options.dtype or backend.default_dtype)
    preflight(options.backend, backend)
    cfg, ckpt = open_checkpoint(options.checkpoint, mtp=options.mtp != 0)
    draft = DRAFT_SPECS[ckpt.draft_module] if options.mtp != 0 else None        # whatever drafter it ships
    if options.mtp is None:
        options = dataclasses.replace(options, mtp=draft.default_tokens(cfg))
    if options.mtp > MAX_MTP:
        raise BuildError(f"--mtp must be from 0 to {MAX_MTP} (the {draft.method} drafter's default is {options.mtp})")
    check_limits(dataclasses.asdict(options), cfg, "v4build", BuildError)
    record = BACKENDS[options.backend].on(backend.device)
    stages = _stages(options, record, cfg, ckpt)
    clock.lap("checkpoint")
    with staged_folder(options.output, "building", options.force, ENGINE_FOLDER) as tmp:
        writer = WeightWriter(tmp)
        try:
            parts: dict[str, Stage | None] = {s.graph: s for s in stages} | ({draft.graph: None} if draft else {})
            treatment: dict[str, int] = {}
            prepared: dict[str, Any] = {}
            weight_groups: dict[str, dict[str, Any]] = {}
            resident: dict[str, int] = {}           # bytes of each graph's weights, as its backend holds them
            for name, stage in tqdm(parts.items(), desc="export", unit="graph", disable=not options.progress):
                counts, groups, prepared[name] = _write_graph(tmp, name, options, backend, cfg, ckpt, writer, clock,
                                                              stage, draft)
                weight_groups[name] = {group: dataclasses.asdict(g) for group, g in sorted(groups.items())}
                resident[name] = sum(sum(g.resident.values()) for g in groups.values())
                for k, v in counts.items():
                    treatment[k] = treatment.get(k, 0) + v
            weights = writer.close()
            tokenizer = [f for f in TOKENIZER_FILES if (options.checkpoint / f).is_file()]
            for f in tokenizer:                      # only files inside the checkpoint folder are copied
                shutil.copyfile(checkpoint_file(options.checkpoint, f, str(options.checkpoint)), tmp / f)
            chat_profile = chat_profile_of(options.checkpoint)
            graphs = {}
            activations = ACTIVATION_DTYPES[options.dtype]
            for name, stage in parts.items():
                inputs, outputs = draft.graph_specs(cfg, activations, options.mtp) if stage is None else \
                    target_specs(cfg, activations, stage, *(draft.stage_io(cfg, activations, stage) if draft else ()))
                graphs[name] = GraphEntry(f"{name}.onnx", tuple(inputs), tuple(outputs))
            caches = cache_layouts(cfg, VALUE_BYTES[options.dtype], draft)
            pipeline = [StageEntry(s, resident[s.graph] + (resident[draft.graph] if draft and s.last else 0))
                        for s in stages]
            experts = _experts(cfg.expert_dtype, record)
            manifest = EngineManifest(
                model=cfg, backend=options.backend, mtp=options.mtp, drafter=draft.method if draft else None,
                dtype=options.dtype, graphs=graphs,
                caches=caches, weights=weights, experts=experts, stages=pipeline, tokenizer=tokenizer,
                chat_profile=chat_profile,
                checkpoint={"path": str(options.checkpoint.resolve()), "fingerprint": ckpt.fingerprint(),
                            "bytes": sum(group_bytes(ckpt.info(name)) for name in ckpt.names()),
                            "tensors": len(ckpt.names()), "scheme": ckpt.scheme},
                tools=_versions(),
                build={"max_batch": options.max_batch, "max_seq_len": options.max_seq_len,
                       "max_prefill_chunk": options.max_prefill_chunk, "opset": OPSET, "weights": treatment,
                       "weight_groups": weight_groups})
            manifest.write(tmp)
            clock.lap("manifest")
            manifest.compiled = compile_engine(tmp, manifest, options, backend, prepared)
            clock.lap("compile")
            manifest.build["stages"] = clock.seconds
            manifest.build["seconds"] = round(time.perf_counter() - started, 2)
            manifest.write(tmp)
        finally:
            writer.close()
    return manifest
