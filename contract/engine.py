"""The engine directory format: `engine.json`, its schema, a validating reader and the writer.

The runtime owns what it loads (docs/architecture.md §3), so the format lives here and the builder writes through it.
An engine directory holds engine.json, one ONNX graph per part (`target`, or one per pipeline stage, and `draft`
when the engine's drafter has a graph: contract/drafting.py), the
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

from .backends import BACKENDS, CompileRecord
from .config import V4Config
from .engine_folder import MANIFEST, EngineFolder, EngineFormatError, WeightFile
from .errors import ConfigError
from .drafting import DRAFT_SPECS, DraftSpec
from .layout import CacheGroup, CacheLayout, TensorSpec, target_specs
from .profiles import MAX_DIM
from .stages import TARGET, Stage
from .untrusted import JsonFields, parse_json, shown

FORMAT = "v4engine"
# The releases whose chat encoders differ (in their reasoning efforts): chat/encoding.py EFFORT_PROFILES renders
# each. engine.json's optional `chat_profile` names the one the checkpoint's encoding/encoding_dsv4.py is.
CHAT_PROFILES = ("preview", "0731")
FORMAT_VERSION = 7          # 2: linked checkpoint files carry their header's SHA-256; 3: cache groups list view_rows;
                            # 4: the draft graph runs a whole draft cycle (k drafts per call); 5: the graphs read the
                            # runtime's cache pools through slots and a block table (rings without spare rows);
                            # 6: the target may be split into pipeline stages (`pipeline`); 7: `drafter` names the
                            # draft graph's method (contract/drafting.py)
# Serving limits a build records in engine.json (build.*), and what they are when an engine does not say.
BUILT_LIMIT_DEFAULTS = {"max_batch": 8, "max_seq_len": 4096, "max_prefill_chunk": 512}
MAX_BATCH = 4096            # the largest --max-batch a build accepts and engine.json may record
MAX_MTP = 16                # the most draft tokens per step a build accepts
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
class GraphEntry:
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class StageEntry:
    """One pipeline stage as engine.json lists it: which layers, and the resident bytes of its weights (its graph's,
    and for the last stage of an engine with a draft graph, the draft graph's too: they run on the same device)."""

    stage: Stage
    bytes: int

    def layout(self, cfg: V4Config, value_bytes: int) -> CacheLayout:
        """The cache groups its graph reads and writes: its layers'."""
        return CacheLayout.target(cfg, value_bytes, layers=self.stage.layers)

    def to_json(self, cfg: V4Config, value_bytes: int, draft: DraftSpec | None) -> dict[str, Any]:
        return {"graph": self.stage.graph, "layers": list(self.stage.layers), "bytes": self.bytes,
                "cache_groups": [g.pool for g in self.layout(cfg, value_bytes).groups],
                "draft": draft.graph if draft is not None and self.stage.last else None}


@dataclass
class EngineManifest:
    """Everything engine.json says. `mtp` is k, the draft tokens per step the engine's draft graph makes (0: none),
    `drafter` the method of that graph (None without one); `caches` holds the cache layout of the target (all
    layers) and of the draft graph; `stages` the target's pipeline stages (one, `target`, unless the build split
    it)."""

    model: V4Config
    backend: str
    mtp: int
    drafter: str | None
    dtype: str
    graphs: dict[str, GraphEntry]
    caches: dict[str, CacheLayout]
    weights: list[WeightFile]
    experts: str
    stages: list[StageEntry]
    tokenizer: list[str] = field(default_factory=list)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, str] = field(default_factory=dict)
    build: dict[str, Any] = field(default_factory=dict)
    compiled: CompileRecord | None = None     # build.compile: what the backend's compile step recorded (None: not yet)
    chat_profile: str | None = None           # the checkpoint's chat encoder's release (CHAT_PROFILES); None: unknown

    @property
    def limits(self) -> dict[str, int]:
        """The serving limits the engine was built for (engine.json build; an engine without them, the defaults)."""
        return {name: int(self.build.get(name, default)) for name, default in BUILT_LIMIT_DEFAULTS.items()}

    @property
    def draft_spec(self) -> DraftSpec | None:
        """The draft graph's part of the contract (None: the engine has no draft graph)."""
        return DRAFT_SPECS[self.drafter] if self.drafter is not None else None

    @property
    def stage_graphs(self) -> list[str]:
        """The target's graphs, in pipeline order."""
        return [entry.stage.graph for entry in self.stages]

    def stage_of(self, graph: str) -> Stage | None:
        """The pipeline stage `graph` runs (None: the draft)."""
        return next((entry.stage for entry in self.stages if entry.stage.graph == graph), None)

    def layout_of(self, graph: str) -> CacheLayout:
        """The cache groups `graph` reads and writes: the draft's, or its stage's layers'."""
        entry = next((entry for entry in self.stages if entry.stage.graph == graph), None)
        return self.caches[graph] if entry is None else entry.layout(self.model, VALUE_BYTES[self.dtype])

    # ------------------------------------------------------------------ cache accounting
    def cache_groups(self, part: str) -> list[CacheGroup]:
        return self.caches[part].groups

    # ------------------------------------------------------------------ writing
    def to_dict(self) -> dict[str, Any]:
        totals = {part: {"bytes_per_token": sum(g.bytes_per_token for g in layout.groups),
                         "fixed_bytes_per_sequence": sum(g.fixed_bytes for g in layout.groups)}
                  for part, layout in self.caches.items()}
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "model": self.model.to_dict(), "backend": self.backend, "mtp": self.mtp, "drafter": self.drafter,
            "dtype": self.dtype,
            "graphs": {name: {"file": g.file, "inputs": [asdict(s) for s in g.inputs],
                              "outputs": [asdict(s) for s in g.outputs]} for name, g in self.graphs.items()},
            "caches": {"groups": {part: layout.to_json() for part, layout in self.caches.items()}, "totals": totals},
            "pipeline": {"stages": [entry.to_json(self.model, VALUE_BYTES[self.dtype], self.draft_spec)
                                    for entry in self.stages]},
            "weights": {"files": [asdict(w) for w in self.weights], "experts": self.experts},
            "tokenizer": self.tokenizer, "checkpoint": self.checkpoint, "tools": self.tools,
            "chat_profile": self.chat_profile,
            "build": self.build | ({"compile": self.compiled.to_dict()} if self.compiled is not None else {}),
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
        backend, dtype = field.choice("backend", tuple(BACKENDS)), field.choice("dtype", tuple(ACTIVATION_DTYPES))
        mtp = field.integer("mtp", 0, MAX_MTP)
        drafter = field.choice("drafter", tuple(DRAFT_SPECS) if mtp else (None,))
        spec = DRAFT_SPECS[drafter] if drafter is not None else None
        stages = _stages(field.nested("pipeline"), model, VALUE_BYTES[dtype], spec)
        specs = {entry.stage.graph: target_specs(model, ACTIVATION_DTYPES[dtype], entry.stage,
                                                 *(spec.stage_io(model, ACTIVATION_DTYPES[dtype], entry.stage)
                                                   if spec else ()))
                 for entry in stages}
        if spec is not None:
            specs[spec.graph] = spec.graph_specs(model, ACTIVATION_DTYPES[dtype], mtp)
        graphs, caches = field.get("graphs", dict), field.get("caches", dict)
        if sorted(graphs) != sorted(specs):
            raise EngineFormatError(f"{path}: field 'graphs' must hold {list(specs)} for mtp {mtp} "
                                    f"(got {shown(sorted(graphs))})")
        entries = {}
        for part, (inputs, outputs) in specs.items():   # what the model config implies, which engine.json must say
            entries[part] = GraphEntry(field.nested("graphs").nested(part).get("file", str),
                                       tuple(inputs), tuple(outputs))
            if graphs[part] != {"file": entries[part].file, **_spec_dicts(entries[part])}:
                raise EngineFormatError(f"{path}: field 'graphs.{part}' does not describe the {part} graph of this "
                                        "model config (inputs and outputs differ); refused")
        layouts = cache_layouts(model, VALUE_BYTES[dtype], spec)
        if caches.get("groups") != {part: layout.to_json() for part, layout in layouts.items()}:
            raise EngineFormatError(f"{path}: field 'caches.groups' is not what the model config implies for mtp "
                                    f"{mtp}, drafter {drafter} and dtype {dtype}; refused")
        weights = field.nested("weights")
        build = dict(field.get("build", dict, {}))
        compiled = BACKENDS[backend].compiled.from_dict(build.pop("compile", None), str(path), entries)
        manifest = cls(
            model=model, backend=backend, mtp=mtp, drafter=drafter, dtype=dtype, graphs=entries, caches=layouts,
            weights=[_weight_file(w, path, i) for i, w in enumerate(weights.get("files", list))],
            experts=weights.get("experts", str), stages=stages, tokenizer=field.items("tokenizer", str, []),
            checkpoint=field.get("checkpoint", dict, {}),
            tools=field.get("tools", dict, {}), build=build, compiled=compiled,
            chat_profile=field.choice("chat_profile", (*CHAT_PROFILES, None), None))
        check_limits({name: manifest.build.get(name, default) for name, default in BUILT_LIMIT_DEFAULTS.items()},
                     model, f"{path}: field 'build'")
        manifest._check_profiles(path)
        manifest._check_files(folder)
        return manifest

    def dim_bounds(self) -> dict[str, int]:
        """The largest value each dynamic dimension of a call takes within the engine's build limits (what
        builder/backends/profiles.py records at most)."""
        limits = self.limits
        blocks = self.caches[TARGET].table_blocks(limits["max_seq_len"])
        return {"batch": limits["max_batch"], "seq": max(limits["max_prefill_chunk"], self.mtp + 1), "blocks": blocks,
                "pool_slots": limits["max_batch"], "pool_blocks": limits["max_batch"] * blocks}

    def _check_profiles(self, path: Path) -> None:
        """Every recorded profile within the engine's own limits: static buffers (CUDA graphs, MIGraphX's pools)
        are sized from them, so a hostile engine.json cannot size one beyond what its limits allow."""
        profiles = getattr(self.compiled, "profiles", None) or {}
        in_plans = getattr(self.compiled, "plan_profiles", None) or {}
        bounds = self.dim_bounds()
        for graph, graph_profiles in [*profiles.items(), *in_plans.items()]:
            for profile in graph_profiles:
                for spec in self.graphs[graph].inputs:
                    if spec.name not in profile.shapes:
                        continue
                    for axis, dim in enumerate(spec.shape):
                        low, high = (dim, dim) if isinstance(dim, int) else (0, bounds.get(dim, MAX_DIM))
                        if not all(low <= shape[axis] <= high for shape in profile.shapes[spec.name]):
                            raise EngineFormatError(
                                f"{path}: field 'build.compile.profiles.{graph}' profile {profile.name}: input "
                                f"{spec.name} axis {axis} ({dim}) must be from {low} to {high}, within the engine's "
                                f"limits (got {[shape[axis] for shape in profile.shapes[spec.name]]})")

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


def cache_layouts(cfg: V4Config, value_bytes: int, draft: DraftSpec | None) -> dict[str, CacheLayout]:
    """The cache layout of each part: the target's (all layers), and the draft graph's when there is one."""
    return {TARGET: CacheLayout.target(cfg, value_bytes)} | (
        {draft.graph: draft.layout(cfg, value_bytes)} if draft is not None else {})


def _stages(pipeline: JsonFields, model: V4Config, value_bytes: int, draft: DraftSpec | None) -> list[StageEntry]:
    """`pipeline.stages`: consecutive, non-empty runs of the target's layers from the first to the last, each entry
    exactly as a build writes it (graph name, cache groups, where the draft runs)."""
    layers = model.num_hidden_layers
    listed = pipeline.get("stages", list)
    if not 1 <= len(listed) <= layers:
        pipeline.fail("stages", f"must list 1 to {layers} stages (one per {layers} layers at most)", len(listed))
    out, start = [], 0
    for i, raw in enumerate(listed):
        fields = JsonFields(raw, pipeline.source, EngineFormatError, f"pipeline.stages[{i}].")
        count = len(fields.items("layers", int, most=layers))
        stage = Stage(i, len(listed), range(start, start + count))
        if count == 0 or stage.layers.stop > layers or fields.raw["layers"] != list(stage.layers):
            fields.fail("layers", f"must be the layers from {start} on, consecutive, at least one, and no more than "
                                  f"the model's {layers}", fields.raw["layers"])
        entry = StageEntry(stage, fields.integer("bytes", 0, 1 << 50))
        if raw != entry.to_json(model, value_bytes, draft):
            raise EngineFormatError(f"{pipeline.source}: field 'pipeline.stages[{i}]' is not the stage of layers "
                                    f"{start} to {stage.layers.stop - 1} this model config implies (graph, cache "
                                    "groups or draft differ); refused")
        out.append(entry)
        start = stage.layers.stop
    if start != layers:
        raise EngineFormatError(f"{pipeline.source}: field 'pipeline.stages' covers layers 0 to {start - 1} of the "
                                f"model's {layers}; refused")
    return out


def _weight_file(raw: Any, path: Path, index: int) -> WeightFile:
    field = JsonFields(raw, str(path), EngineFormatError, f"weights.files[{index}].")
    link = field.choice("link", ("hardlink", "symlink", "converted"))
    linked = link != "converted"
    return WeightFile(field.get("file", str), field.integer("bytes", 1, 1 << 50), link,
                      field.get("source", str) if linked else None, field.get("header_sha256", str) if linked else None)
