"""The backends an engine is built for and runs on: one record each, and the only list of them.

A `Backend` says what the builder and the runtime need to know of one backend:
- `session`: its EngineSession class in runtime/sessions/<name>.py, imported only when an engine of it opens (so
  that a backend's libraries load only where they are used);
- `shape_specialized`: its compiled engines take shapes up to engine.json's limits only, so the runtime refuses
  larger limits when it opens one rather than in the middle of a generation;
- `quantized_in_place`: the quantized weight formats the build keeps quantized, in the checkpoint's own files;
  weights of the other formats are dequantized into weights/converted.bin;
- `dequantizes_at_load`: its runtime folds the DequantizeLinear of constant weights once at load (ONNX Runtime,
  told so by session.disable_quant_qdq), so FP8 weights are resident in the activation dtype, not as FP8;
- `expert_weights`: the form in which the graph hands quantized routed experts (of a format it keeps in place) to the
  MoE: `STACKED` (dequantized, stacked [E, out, in]: the op's ONNX function), `INT8_CODES` (MXFP4 experts widened
  in the graph from the stored bytes to the codes and scales of an exact int8 MoE, ONNX Runtime's QMoE),
  `STORED_BYTES` (the stored bytes stacked as int8, with fp32 scales, for a kernel that dequantizes inside: the
  TensorRT plugin) or `PREPACKED` (every layer's experts stacked once at build, in the layout ONNX Runtime's CUDA
  MoE kernels take: builder/weights.py);
- `devices`: what its engines can be built for; a record per device other than the first (`variant`), since ONNX
  Runtime's CUDA engines keep other formats and take their experts in another form than its CPU ones;
- `compiled`: the typed record of what its compile step wrote in engine.json (`build.compile`);
- `build_options`, `session_options`: the options it takes at build time and when an engine opens
  (contract/backend_options.py), each refusing in one line what it does not take;
- `artifacts`: the files its compile step writes into an engine folder (what `--force` may replace);
- `builder`: the builder module providing preflight, prepare_graph and compile_engine. The contract only names it
  (and the session class): the builder and the runtime import the contract, never the reverse.
`BACKENDS` maps each name to its record. `v4build --backend`, engine.json's `backend` field and every choice the
builder and the runtime make by backend come from it; tests/test_backends.py checks that each entry is complete.

Compile records are read from engine.json, which is untrusted: `from_dict` type-checks every field (one at fault is
one line naming it, EngineFormatError) and what the sessions index by (one entry per graph, profiles of the graph's
own inputs, programs in the order of the profiles' buckets). The files they name are opened only through
EngineFolder, by the session that needs them.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any, TypeVar

from .backend_options import (ORT_DEVICES, BackendOptions, MIGraphXBuild, MIGraphXSessionOptions, OnnxRuntimeBuild,
                              OnnxRuntimeSessionOptions, TensorRTBuild, TensorRTSessionOptions)
from .buckets import Bucket, graph_buckets
from .calls import captured_calls
from .engine_folder import EngineFormatError
from .profiles import Profile
from .untrusted import JsonFields

if TYPE_CHECKING:
    from .engine import GraphEntry
    from .layout import TensorSpec

T = TypeVar("T")
MAX_COUNT = 1 << 50          # the largest count or size a compile record may give (nodes, bytes)


class CompileRecord(ABC):
    """What a backend's compile step recorded: engine.json's `build.compile`, as a frozen dataclass."""

    def to_dict(self) -> dict[str, Any]:
        """As engine.json holds it: every field, nested records as JSON objects; an optional field (default None)
        only when it is set."""
        whole = dataclasses.asdict(self)
        return {f.name: whole[f.name] for f in dataclasses.fields(self)
                if whole[f.name] is not None or f.default is not None}

    @classmethod
    @abstractmethod
    def from_dict(cls, raw: Any, source: str, graphs: Mapping[str, GraphEntry]) -> CompileRecord:
        """The record engine.json (`source`) holds for an engine of these graphs; EngineFormatError naming the
        field at fault."""


# ---------------------------------------------------------------------- reading untrusted records
def _record(raw: Any, source: str) -> JsonFields:
    return JsonFields(raw, source, EngineFormatError, "build.compile.")


def _per_graph(fields: JsonFields, key: str, graphs: Mapping[str, GraphEntry],
               read: Callable[[JsonFields, str], T]) -> dict[str, T]:
    """The JSON object at `key`: one entry per graph of the engine, each read by read(the object's fields, graph)."""
    if sorted(fields.get(key, dict)) != sorted(graphs):
        fields.fail(key, f"must have one entry per graph, {sorted(graphs)}", sorted(fields.raw[key]))
    entries = fields.nested(key)
    return {graph: read(entries, graph) for graph in graphs}


def _objects(fields: JsonFields, key: str) -> list[JsonFields]:
    """The JSON objects listed at `key` (at least one), each named by its place (key[i]) in messages."""
    listed = fields.items(key, dict)
    if not listed:
        fields.fail(key, "must list at least one entry", listed)
    return [JsonFields(raw, fields.source, fields.error, f"{fields.prefix}{key}[{i}].") for i, raw in enumerate(listed)]


def _profiles(fields: JsonFields, graphs: Mapping[str, GraphEntry]) -> dict[str, tuple[Profile, ...]]:
    """`profiles`: every graph's optimization profiles, in the engine's order, each of the graph's own inputs."""
    def read(entries: JsonFields, graph: str) -> tuple[Profile, ...]:
        inputs = {spec.name for spec in graphs[graph].inputs}
        profiles = tuple(Profile.read(profile, inputs) for profile in _objects(entries, graph))
        if len({profile.name for profile in profiles}) != len(profiles):      # they name buckets and programs
            entries.fail(graph, "must name each profile once", [profile.name for profile in profiles])
        return profiles

    return _per_graph(fields, "profiles", graphs, read)


def _cuda_graphs(fields: JsonFields, profiles: Mapping[str, tuple[Profile, ...]] | None) -> tuple[str, ...]:
    """`cuda_graphs`: the names of the profiles whose calls run as CUDA graphs (contract/calls.py), each one
    of the per-token calls the engine's graphs have; () when absent (an engine built without --cuda-graphs)."""
    names = tuple(fields.items("cuda_graphs", str, []))
    allowed = captured_calls(profiles or {})
    if any(name not in allowed for name in names) or len(set(names)) != len(names):
        fields.fail("cuda_graphs", f"must name profiles among {list(allowed)}, once each", list(names))
    return names


def _check_buckets(fields: JsonFields, profiles: Mapping[str, tuple[Profile, ...]],
                   graphs: Mapping[str, GraphEntry]) -> dict[str, list[Bucket]]:
    """Every graph's buckets of static shapes (contract/buckets.py), once its profiles give each dynamic input with
    one range per dimension: what programs and CUDA graphs are made for."""
    buckets = {}
    for graph, entry in graphs.items():
        try:
            buckets[graph] = graph_buckets(profiles[graph], entry.inputs)
        except ValueError as e:
            fields.fail("profiles", f"{graph}'s must give every dynamic input, each dimension one range ({e})", graph)
    return buckets


# ---------------------------------------------------------------------- ONNX Runtime
MOE_ACTIVATIONS = ("fp32", "int8")          # what ONNX Runtime's QMoE computes its routed experts' products on


@dataclass(frozen=True)
class OnnxRuntimeCompiled(CompileRecord):
    """ONNX Runtime compiles nothing ahead: the build only loads every graph. Its version, the execution providers
    that loaded them, and, when none could, why (`not_loaded`: a bf16 engine with only the CPU provider here).
    An engine built for CUDA graphs (--cuda-graphs) also has its graphs' calls as profiles, and `cuda_graphs`
    names those whose calls the CUDA provider records (their buckets: contract/calls.py). `moe_activations`
    says whether the routed experts run exactly (fp32) or, built --int8-moe-activations, on int8 inputs.
    `device`: what the graphs were prepared for (v4build --device): the CPU, or the CUDA provider (the CUDA
    variant, which the CPU provider cannot run: builder/backends/onnxruntime_cuda.py); absent in engines built
    before it existed, which are CPU engines."""

    onnxruntime: str
    providers_checked: tuple[str, ...]
    not_loaded: str | None = None
    profiles: dict[str, tuple[Profile, ...]] | None = None
    cuda_graphs: tuple[str, ...] = ()
    moe_activations: str = "fp32"     # QMoE's inputs: fp32 (exact), or int8 (--int8-moe-activations: lossy)
    device: str = "cpu"               # cpu, or cuda (v4build --device cuda)

    @classmethod
    def from_dict(cls, raw: Any, source: str, graphs: Mapping[str, GraphEntry]) -> OnnxRuntimeCompiled:
        record = _record(raw, source)
        profiles = _profiles(record, graphs) if record.get("profiles", (dict, type(None)), None) is not None else None
        cuda_graphs = _cuda_graphs(record, profiles)
        if cuda_graphs:
            _check_buckets(record, profiles, graphs)
        return cls(record.get("onnxruntime", str), tuple(record.items("providers_checked", str)),
                   record.get("not_loaded", str, None), profiles, cuda_graphs,
                   record.choice("moe_activations", MOE_ACTIVATIONS, "fp32"),
                   record.choice("device", ORT_DEVICES, "cpu"))


# ---------------------------------------------------------------------- TensorRT
@dataclass(frozen=True)
class BuiltPlan:
    """One graph's serialized TensorRT engine: its file in the engine folder, its size and its build seconds, and
    whether it was built without its weights (`stripped`: TensorRT's STRIP_PLAN; the session refits it from the
    graph's weights, the checkpoint's own files, when it loads it). Plans of engines built before stripping hold
    their weights."""

    plan: str
    bytes: int
    seconds: float
    stripped: bool = False

    @classmethod
    def read(cls, fields: JsonFields) -> BuiltPlan:
        return cls(fields.get("plan", str), fields.integer("bytes", 0, MAX_COUNT), fields.number("seconds", 0),
                   fields.get("stripped", bool, False))


@dataclass(frozen=True)
class TensorRTCompiled(CompileRecord):
    """Every graph's optimization profiles (in the engine's order), the builder optimization level, the v4 plugin
    nodes the preparation marked, and each graph's plan: `plans` None when the build stopped before TensorRT
    (--onnx-only). `tensorrt`: the version that built the plans, or why none was built; `timing_cache`: the cache
    the build read and wrote. `plan_profiles`: the profiles the plans themselves hold, where they differ from
    `profiles` (a stripped plan, refittable, holds one covering every call: `merged_profile`); the calls' own
    profiles still give the CUDA graphs' buckets."""

    profiles: dict[str, tuple[Profile, ...]]
    optimization_level: int
    plugin_nodes: dict[str, int]
    plans: dict[str, BuiltPlan] | None
    tensorrt: str
    timing_cache: str | None = None
    cuda_graphs: tuple[str, ...] = ()      # the profiles whose calls run as CUDA graphs (contract/calls.py)
    plan_profiles: dict[str, tuple[Profile, ...]] | None = None

    def in_plan(self, graph: str) -> tuple[Profile, ...]:
        """The optimization profiles `graph`'s plan holds, in its order."""
        return (self.plan_profiles or self.profiles)[graph]

    @classmethod
    def from_dict(cls, raw: Any, source: str, graphs: Mapping[str, GraphEntry]) -> TensorRTCompiled:
        record = _record(raw, source)
        plans = record.get("plans", (dict, type(None)))
        profiles = _profiles(record, graphs)
        cuda_graphs = _cuda_graphs(record, profiles)
        if cuda_graphs:
            _check_buckets(record, profiles, graphs)
        in_plans = None
        if record.get("plan_profiles", (dict, type(None)), None) is not None:
            in_plans = _profiles(JsonFields({"profiles": record.raw["plan_profiles"]}, source, EngineFormatError,
                                            "build.compile.plan_"), graphs)
        return cls(profiles, record.integer("optimization_level", 0, 5),
                   _per_graph(record, "plugin_nodes", graphs, lambda nodes, graph: nodes.integer(graph, 0, MAX_COUNT)),
                   None if plans is None else _per_graph(record, "plans", graphs,
                                                         lambda built, graph: BuiltPlan.read(built.nested(graph))),
                   record.get("tensorrt", str), record.get("timing_cache", str, None), cuda_graphs, in_plans)


# ---------------------------------------------------------------------- MIGraphX
@dataclass(frozen=True)
class Variant:
    """One graph as rewritten for MIGraphX's parser: its nodes and its opset."""

    nodes: int
    opset: int

    @classmethod
    def read(cls, fields: JsonFields) -> Variant:
        return cls(fields.integer("nodes", 0, MAX_COUNT), fields.integer("opset", 1, 1000))


@dataclass(frozen=True)
class Program:
    """One compiled MIGraphX program: the static shape (bucket, contract/buckets.py) it was compiled for and its file
    in the engine folder."""

    bucket: str
    file: str

    @classmethod
    def read(cls, fields: JsonFields, bucket: str) -> Program:
        """The program engine.json lists in `bucket`'s place: it must say it was compiled for that bucket."""
        program = cls(fields.get("bucket", str), fields.get("file", str))
        if program.bucket != bucket:
            fields.fail("bucket", f"must be {bucket!r}: one program per bucket of the profiles, in their order",
                        program.bucket)
        return program


@dataclass(frozen=True)
class MIGraphXCompiled(CompileRecord):
    """The allowlist the variants were checked against (MIGraphX's release and the sources it was read from), each
    graph's variant and optimization profiles and, once compiled, one program per bucket of the profiles, in their
    order (`buckets`): `programs` None while compile_migraphx.sh, left in the engine folder, has yet to compile them
    on the ROCm machine. `migraphx`: the version that compiled them, or why none did."""

    allowlist: dict[str, Any]
    variant: dict[str, Variant]
    profiles: dict[str, tuple[Profile, ...]]
    migraphx: str
    programs: dict[str, tuple[Program, ...]] | None

    @classmethod
    def from_dict(cls, raw: Any, source: str, graphs: Mapping[str, GraphEntry]) -> MIGraphXCompiled:
        record = _record(raw, source)
        profiles = _profiles(record, graphs)
        buckets = _check_buckets(record, profiles, graphs)

        def programs(entries: JsonFields, graph: str) -> tuple[Program, ...]:
            listed, names = _objects(entries, graph), [bucket.name for bucket in buckets[graph]]
            if len(listed) != len(names):
                entries.fail(graph, f"must list one program per bucket of the profiles ({len(names)}: {names[0]} .. "
                             f"{names[-1]})", len(listed))
            return tuple(Program.read(program, name) for program, name in zip(listed, names))

        compiled = record.get("programs", (dict, type(None)))
        return cls(record.get("allowlist", dict),
                   _per_graph(record, "variant", graphs, lambda variants, graph: Variant.read(variants.nested(graph))),
                   profiles, record.get("migraphx", str),
                   None if compiled is None else _per_graph(record, "programs", graphs, programs))

    def buckets(self, graph: str, inputs: Sequence[TensorSpec]) -> list[Bucket]:
        """`graph`'s buckets: what its programs were compiled for, in their order."""
        return graph_buckets(self.profiles[graph], inputs)


# ---------------------------------------------------------------------- the registry
STACKED, INT8_CODES, STORED_BYTES, PREPACKED = "stacked", "int8 codes", "stored bytes", "prepacked"
                                                                                    # Backend.expert_weights


@dataclass(frozen=True)
class Backend:
    """One backend: what the builder and the runtime need to know of it (the module doc says why each field)."""

    name: str
    session: str                          # its EngineSession class, in runtime/sessions/<name>.py
    shape_specialized: bool
    quantized_in_place: frozenset[str]    # "fp8_block", "mxfp4"
    compiled: type[CompileRecord]
    build_options: type[BackendOptions]   # what v4build takes for it (contract/backend_options.py)
    session_options: type[BackendOptions]  # what its sessions take when an engine opens
    artifacts: frozenset[str] = frozenset()     # the files its compile step writes: names, or `*.suffix`
    dequantizes_at_load: bool = False
    expert_weights: str = STACKED
    devices: tuple[str, ...] = ("cpu",)
    variants: tuple[tuple[str, Backend], ...] = ()     # (device, its record) for each device but the first

    def on(self, device: str) -> Backend:
        """This backend's record for engines built for `device` (one of `devices`)."""
        return dict(self.variants).get(device, self)

    def writes(self, name: str) -> bool:
        """Whether its compile step writes a file of this name into an engine folder."""
        return name in self.artifacts or any(a.startswith("*") and name.endswith(a[1:]) for a in self.artifacts)

    @property
    def builder(self) -> str:
        """The builder module providing preflight, prepare_graph and compile_engine."""
        return f"v4engine.builder.backends.{self.name}"

    def session_class(self) -> type:
        """Its session class, imported now (by the runtime: the contract only names it)."""
        return getattr(import_module(f"v4engine.runtime.sessions.{self.name}"), self.session)


TIMING_CACHE = "timing.cache"                  # a TensorRT engine's timing cache, unless --timing-cache names one
MIGRAPHX_SCRIPT = "compile_migraphx.sh"        # what compiles a MIGraphX engine's programs on the ROCm machine

BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (
    # ONNX Runtime's CPU provider has no FP4 kernel, but an int8 MoE that is exact for MXFP4's values
    Backend("onnxruntime", "OnnxRuntimeSession", shape_specialized=False,
            quantized_in_place=frozenset({"fp8_block", "mxfp4"}), compiled=OnnxRuntimeCompiled,
            build_options=OnnxRuntimeBuild, session_options=OnnxRuntimeSessionOptions,
            dequantizes_at_load=True, expert_weights=INT8_CODES, devices=ORT_DEVICES,
            # the CUDA variant: FP8 projections read as stored by the CUDA provider's block-scaled FP8 MatMul, the
            # experts prepacked for its MoE (builder/backends/onnxruntime_cuda.py); nothing folded on the host
            variants=(("cuda", Backend("onnxruntime", "OnnxRuntimeSession", shape_specialized=False,
                                       quantized_in_place=frozenset({"fp8_block", "mxfp4"}),
                                       compiled=OnnxRuntimeCompiled, build_options=OnnxRuntimeBuild,
                                       session_options=OnnxRuntimeSessionOptions, expert_weights=PREPACKED,
                                       devices=("cuda",))),)),
    Backend("tensorrt", "TensorRTSession", shape_specialized=True,
            quantized_in_place=frozenset({"fp8_block", "mxfp4"}), compiled=TensorRTCompiled,
            build_options=TensorRTBuild, session_options=TensorRTSessionOptions,
            artifacts=frozenset({"*.plan", TIMING_CACHE}), expert_weights=STORED_BYTES, devices=("cuda",)),
    # MIGraphX reads neither FLOAT8E4M3FN nor blocked DequantizeLinear at its opset 19; int8 bytes it reads
    Backend("migraphx", "MIGraphXSession", shape_specialized=True,
            quantized_in_place=frozenset(), compiled=MIGraphXCompiled,
            build_options=MIGraphXBuild, session_options=MIGraphXSessionOptions,
            artifacts=frozenset({"*.mxr", MIGRAPHX_SCRIPT}), expert_weights=STORED_BYTES, devices=("rocm",)),
)}

__all__ = ["Backend", "BACKENDS", "MIGRAPHX_SCRIPT", "TIMING_CACHE", "STACKED", "INT8_CODES", "STORED_BYTES",
           "PREPACKED",
           "CompileRecord", "OnnxRuntimeCompiled", "TensorRTCompiled", "BuiltPlan",
           "MIGraphXCompiled", "Variant", "Program"]
