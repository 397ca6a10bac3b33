"""The engine directory format: `engine.json`, its schema, a validating reader and the writer.

The runtime owns what it loads (DESIGN.md), so the format lives here and the builder writes through it.
An engine directory holds engine.json, one ONNX graph per part (`target`, and `draft` when mtp > 0), the
weight files those graphs reference (`weights/`: links to the checkpoint's own files, plus one file of
converted tensors when some had to be converted) and the tokenizer files, if the checkpoint had them.

engine.json is read as untrusted input: every field is type-checked, every size bounded, every path must stay
inside the folder (engine_folder.py), and what the model config implies (the cache groups, each graph's inputs
and outputs) must be exactly what engine.json says, so nothing downstream sizes a buffer from an unchecked number.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import CSA, ROW_GROUPS, SLIDING, CacheGroup, V4Config
from .engine_folder import MANIFEST, EngineFolder, EngineFormatError, WeightFile
from .errors import ConfigError
from .untrusted import JsonFields, parse_json, shown

FORMAT = "v4engine"
FORMAT_VERSION = 2          # 2: linked checkpoint files carry their safetensors header's SHA-256
# Serving limits a build records in engine.json (build.*), and what they are when an engine does not say.
BUILT_LIMIT_DEFAULTS = {"max_batch": 8, "max_seq_len": 4096, "max_prefill_chunk": 512}
MAX_BATCH = 4096            # the largest --max-batch a build accepts and engine.json may record
MAX_MTP = 16                # the most draft tokens per step a build accepts
BACKENDS = ("onnxruntime", "tensorrt", "migraphx")
ACTIVATION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}   # --dtype -> graph element type
VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def check_limits(limits: dict[str, Any], cfg: V4Config, source: str, error: type[Exception] = EngineFormatError
                 ) -> None:
    """The serving limits of a build (its options, or engine.json's record of them): integers within bounds."""
    bounds = {"max_batch": (1, MAX_BATCH), "max_seq_len": (2, cfg.max_position_embeddings),
              "max_prefill_chunk": (1, cfg.max_position_embeddings)}
    for name, (low, high) in bounds.items():
        value = limits.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise error(f"{source}: {name} must be an integer from {low} to {high} (got {value!r})")


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: name, element type and shape (ints, or names of dynamic dimensions)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]



@dataclass(frozen=True)
class GraphEntry:
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


def cache_group_dict(group: CacheGroup, kind: str) -> dict[str, Any]:
    """One cache group as engine.json lists it: the layer's kind, the row shape, and its bytes."""
    return {**asdict(group), "kind": kind, "fixed_bytes": group.fixed_bytes, "bytes_per_token": group.bytes_per_token}


def cache_groups(cfg: V4Config, part: str, mtp: int, dtype: str) -> list[dict[str, Any]]:
    """engine.json's `caches` entry of `part` ('target' or 'draft') for this model, k = mtp and --dtype."""
    draft = part == "draft"
    return [cache_group_dict(g, "mtp" if draft else cfg.layer_types[g.layer])
            for g in cfg.cache_groups(draft, mtp, VALUE_BYTES[dtype])]


# ---------------------------------------------------------------------- the graphs' inputs and outputs
def _kind(cfg: V4Config, group: CacheGroup) -> str:
    return SLIDING if group.layer >= cfg.num_hidden_layers else cfg.layer_types[group.layer]


def cache_inputs(cfg: V4Config, groups: list[CacheGroup], dtype: str) -> list[TensorSpec]:
    """`past.{layer}.{cache}`: windows and partial windows of fixed length, compressed rows of dynamic length."""
    out = []
    for g in groups:
        kind = _kind(cfg, g)
        if g.name in ROW_GROUPS:
            rows: int | str = "rows_csa" if kind == CSA else "rows_hca"
        elif g.name == "window_kv":
            rows = cfg.sliding_window - 1
        else:
            rows = cfg.state_tokens(kind)
        out.append(TensorSpec(f"past.{g.layer}.{g.name}", dtype, ("batch", rows, g.width)))
    return out


def cache_outputs(cfg: V4Config, groups: list[CacheGroup], dtype: str) -> list[TensorSpec]:
    """`new.{layer}.{cache}`: per-position deltas, or per-window rows for the compressed caches."""
    def rows(g: CacheGroup) -> str:
        if g.name not in ROW_GROUPS:
            return "seq"
        return "emitted_csa" if _kind(cfg, g) == CSA else "emitted_hca"

    return [TensorSpec(f"new.{g.layer}.{g.name}", dtype, ("batch", rows(g), g.width)) for g in groups]


def graph_specs(cfg: V4Config, draft: bool, dtype: str = "float32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the target or draft graph: the engine contract."""
    groups = cfg.cache_groups(draft=draft, mtp=0)
    tokens = [TensorSpec("input_ids", "int64", ("batch", "seq")), TensorSpec("positions", "int64", ("batch", "seq"))]
    hidden = TensorSpec("hidden", dtype, ("batch", "seq", cfg.hc_mult, cfg.hidden_size))
    inputs = ([hidden] if draft else []) + tokens + cache_inputs(cfg, groups, dtype)
    out_hidden = TensorSpec("next_hidden", dtype, hidden.shape) if draft else hidden   # the draft's own streams
    outputs = [TensorSpec("logits", "float32", ("batch", "seq", cfg.vocab_size)), out_hidden]
    return inputs, outputs + cache_outputs(cfg, groups, dtype)


@dataclass
class EngineManifest:
    """Everything engine.json says. `caches` holds, for target and draft, every cache group with its bytes."""

    model: V4Config
    backend: str
    mtp: int
    dtype: str
    graphs: dict[str, GraphEntry]
    caches: dict[str, list[dict[str, Any]]]
    weights: list[WeightFile]
    experts: str
    tokenizer: list[str] = field(default_factory=list)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, str] = field(default_factory=dict)
    build: dict[str, Any] = field(default_factory=dict)

    @property
    def limits(self) -> dict[str, int]:
        """The serving limits the engine was built for (engine.json build; an engine without them, the defaults)."""
        return {name: int(self.build.get(name, default)) for name, default in BUILT_LIMIT_DEFAULTS.items()}

    # ------------------------------------------------------------------ cache accounting
    def cache_groups(self, part: str) -> list[CacheGroup]:
        keys = ("layer", "name", "width", "value_bytes", "rows_fixed", "ratio")     # the rest is derived
        return [CacheGroup(**{k: g[k] for k in keys}) for g in self.caches[part]]

    # ------------------------------------------------------------------ writing
    def to_dict(self) -> dict[str, Any]:
        totals = {part: {"bytes_per_token": sum(g["bytes_per_token"] for g in groups),
                         "fixed_bytes_per_sequence": sum(g["fixed_bytes"] for g in groups)}
                  for part, groups in self.caches.items()}
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "model": self.model.to_dict(), "backend": self.backend, "mtp": self.mtp, "dtype": self.dtype,
            "graphs": {name: {"file": g.file, "inputs": [asdict(s) for s in g.inputs],
                              "outputs": [asdict(s) for s in g.outputs]} for name, g in self.graphs.items()},
            "caches": {"groups": self.caches, "totals": totals},
            "weights": {"files": [asdict(w) for w in self.weights], "experts": self.experts},
            "tokenizer": self.tokenizer, "checkpoint": self.checkpoint, "tools": self.tools, "build": self.build,
        }

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    # ------------------------------------------------------------------ reading
    @classmethod
    def read(cls, directory: str | Path) -> "EngineManifest":
        """Read and validate DIR/engine.json; every failure names the file and the field at fault."""
        folder = EngineFolder(directory)
        path = folder.manifest_path
        if not folder.exists(MANIFEST):
            raise EngineFormatError(f"{path}: not found (is {folder.directory} an engine directory built by v4build?)")
        raw = parse_json(folder.read_bytes(MANIFEST, MANIFEST, "manifest"), path, EngineFormatError)
        field = JsonFields(raw, str(path), EngineFormatError)
        if raw.get("format") != FORMAT:
            raise EngineFormatError(f"{path}: not a v4engine manifest (field 'format' must be '{FORMAT}')")
        if raw.get("format_version") != FORMAT_VERSION:
            raise EngineFormatError(f"{path}: format_version {shown(raw.get('format_version'))} is not supported by "
                                    f"this runtime (it reads version {FORMAT_VERSION}); rebuild the engine with v4build")
        try:
            model = V4Config.from_dict(field.get("model", dict), source=f"{path} (model)")
        except ConfigError as e:
            raise EngineFormatError(str(e)) from None
        backend, dtype = field.choice("backend", BACKENDS), field.choice("dtype", tuple(ACTIVATION_DTYPES))
        mtp = field.integer("mtp", 0, MAX_MTP)
        parts = ["target"] + (["draft"] if mtp else [])
        graphs, caches = field.get("graphs", dict), field.get("caches", dict)
        if sorted(graphs) != sorted(parts):
            raise EngineFormatError(f"{path}: field 'graphs' must hold {parts} for mtp {mtp} (got {shown(sorted(graphs))})")
        entries = {}
        for part in parts:        # what the model config implies, which engine.json must say exactly
            inputs, outputs = graph_specs(model, part == "draft", ACTIVATION_DTYPES[dtype])
            entries[part] = GraphEntry(field.nested("graphs").nested(part).get("file", str),
                                       tuple(inputs), tuple(outputs))
            if graphs[part] != {"file": entries[part].file, **_spec_dicts(entries[part])}:
                raise EngineFormatError(f"{path}: field 'graphs.{part}' does not describe the {part} graph of this "
                                        "model config (inputs and outputs differ); refused")
        groups = {part: cache_groups(model, part, mtp, dtype) for part in parts}
        if not isinstance(caches.get("groups"), dict) or caches["groups"] != groups:
            raise EngineFormatError(f"{path}: field 'caches.groups' is not what the model config implies for mtp "
                                    f"{mtp} and dtype {dtype}; refused")
        weights = field.nested("weights")
        manifest = cls(
            model=model, backend=backend, mtp=mtp, dtype=dtype, graphs=entries, caches=groups,
            weights=[_weight_file(w, path, i) for i, w in enumerate(weights.get("files", list))],
            experts=weights.get("experts", str), tokenizer=field.items("tokenizer", str, []),
            checkpoint=field.get("checkpoint", dict, {}),
            tools=field.get("tools", dict, {}), build=field.get("build", dict, {}))
        check_limits({name: manifest.build.get(name, default) for name, default in BUILT_LIMIT_DEFAULTS.items()},
                     model, f"{path}: field 'build'")
        manifest._check_files(folder)
        return manifest

    def _check_files(self, folder: EngineFolder) -> None:
        """Every file engine.json names is a file in the folder (or the checkpoint file a weights link recorded)."""
        named = [(entry.file, folder.path(entry.file, f"graphs.{name}.file")) for name, entry in self.graphs.items()]
        named += [(w.file, folder.weight_path(w, f"weights.files[{i}]")) for i, w in enumerate(self.weights)]
        named += [(name, folder.path(name, f"tokenizer[{i}]")) for i, name in enumerate(self.tokenizer)]
        for file, path in named:
            if not path.exists():
                raise EngineFormatError(f"{folder.manifest_path}: {file} is missing from {folder.directory}")
            if not path.is_file():
                raise EngineFormatError(f"{folder.directory / file}: not a regular file; refused")
        files = [w.file for w in self.weights]
        if len(set(files)) != len(files):
            raise EngineFormatError(f"{folder.manifest_path}: field 'weights.files' lists a file twice")


def _spec_dicts(entry: GraphEntry) -> dict[str, list[dict[str, Any]]]:
    """A graph entry's inputs and outputs as engine.json writes them (shapes as lists)."""
    return {kind: [{**asdict(s), "shape": list(s.shape)} for s in specs]
            for kind, specs in (("inputs", entry.inputs), ("outputs", entry.outputs))}


def _weight_file(raw: Any, path: Path, index: int) -> WeightFile:
    field = JsonFields(raw, str(path), EngineFormatError, f"weights.files[{index}].")
    link = field.choice("link", ("hardlink", "symlink", "converted"))
    linked = link != "converted"
    return WeightFile(field.get("file", str), field.integer("bytes", 1, 1 << 50), link,
                      field.get("source", str) if linked else None, field.get("header_sha256", str) if linked else None)
