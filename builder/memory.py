"""What an engine will hold on each device, read from its folder without a GPU (`v4build memory ENGINE_DIR`).

Per device, in pipeline-stage order (one device for an engine of one stage; the draft graph runs beside the last):
- weights: the bytes of the device's graphs' weights as its backend holds them once loaded (engine.json
  `build.weight_groups`, whose resident forms builder/weights.py derives from each weight's treatment: FP8 kept as
  stored with float32 scale rows, experts prepacked or as their stored bytes, what is widened widened). A weight
  two graphs read (the draft's embedding and head) counts in each, as each session loads its own;
- caches: the pools at the engine's limits, max_batch sequences of max_seq_len tokens of the device's cache groups
  (contract/layout.py, rows exactly), the draft's on the last device;
- workspace: an estimate of what the largest call needs beside them: its outputs (a prefill chunk's logits at every
  position, max_batch rows) and twice the largest intermediate value the graph declares (value_info, evaluated at
  the largest dims the build allows: a producer and its consumer live at once). Values computed inside the v4 ops'
  kernels or functions are not declared and not counted, nor is the runtime's own scratch (CUDA graphs' buffers,
  the allocator's slack): read it as a floor.
"""
from __future__ import annotations

import ast
import json
import math
import operator
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

from v4engine.contract.engine import VALUE_BYTES, EngineManifest
from v4engine.contract.engine_folder import EngineFolder
from v4engine.contract.errors import V4EngineError

_ELEMENT_BYTES = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2,
                  onnx.TensorProto.INT64: 8, onnx.TensorProto.INT32: 4, onnx.TensorProto.BOOL: 1,
                  onnx.TensorProto.INT8: 1, onnx.TensorProto.UINT8: 1, onnx.TensorProto.DOUBLE: 8}


@dataclass(frozen=True)
class DeviceMemory:
    """One device's share of an engine: its graphs and the bytes of each kind."""

    device: int
    graphs: tuple[str, ...]
    weights_bytes: int
    cache_bytes: int
    workspace_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.cache_bytes + self.workspace_bytes


def memory_plan(engine_dir: str | Path) -> tuple[EngineManifest, list[DeviceMemory]]:
    """The engine's manifest and what each of its devices holds (the module doc says how)."""
    manifest = EngineManifest.read(engine_dir)
    folder = EngineFolder(engine_dir)
    groups = manifest.build.get("weight_groups", {})
    limits = manifest.limits
    dims = manifest.dim_bounds()
    value_bytes = VALUE_BYTES[manifest.dtype]
    draft = manifest.draft_spec
    plan = []
    for entry in manifest.stages:
        graphs = (entry.stage.graph,) + ((draft.graph,) if draft is not None and entry.stage.last else ())
        missing = [g for g in graphs if g not in groups]
        if missing:
            raise V4EngineError(f"{folder.manifest_path}: field 'build.weight_groups' has no entry for graph "
                                f"{missing[0]!r}; rebuild the engine with this v4build")
        weights = sum(n for graph in graphs for group in groups[graph].values() for n in group["resident"].values())
        caches = limits["max_batch"] * entry.layout(manifest.model, value_bytes).bytes_for(limits["max_seq_len"])
        if draft is not None and entry.stage.last:
            caches += limits["max_batch"] * manifest.caches[draft.graph].bytes_for(limits["max_seq_len"])
        workspace = max(_workspace(folder, manifest.graphs[graph].file, dims) for graph in graphs)
        plan.append(DeviceMemory(entry.stage.index, graphs, weights, caches, workspace))
    return manifest, plan


def _workspace(folder: EngineFolder, file: str, dims: dict[str, int]) -> int:
    """A graph's outputs and twice its largest declared intermediate at the largest dims, in bytes."""
    graph = onnx.ModelProto.FromString(folder.read_bytes(file, "graph", "graph")).graph
    outputs = sum(_bytes(v, dims) for v in graph.output)
    largest = max((_bytes(v, dims) for v in graph.value_info), default=0)
    return outputs + 2 * largest


def _bytes(value: onnx.ValueInfoProto, dims: dict[str, int]) -> int:
    tensor = value.type.tensor_type
    width = _ELEMENT_BYTES.get(tensor.elem_type, 0)
    sizes = [d.dim_value if d.HasField("dim_value") else dimension(d.dim_param, dims) for d in tensor.shape.dim]
    return width * math.prod(sizes) if None not in sizes else 0


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Mod: operator.mod}
_FUNCTIONS = {"Min": min, "Max": max}


def dimension(expression: str, dims: dict[str, int]) -> int | None:
    """A symbolic dimension as the exporter writes it ("batch*seq", "((seq + 3)//4)", "Min(16, 4*blocks)") at
    `dims`; None for anything else. Read from an untrusted graph file: only names of `dims`, integers, + - * // %,
    and Min / Max are evaluated, nothing is executed."""
    try:
        tree = ast.parse(expression, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None

    def value(node: ast.AST) -> int | None:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            return dims.get(node.id)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if left is None or right is None or (right == 0 and type(node.op) in (ast.FloorDiv, ast.Mod)):
                return None
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
                and node.args and not node.keywords:
            args = [value(a) for a in node.args]
            return None if None in args else _FUNCTIONS[node.func.id](args)
        return None

    try:
        return value(tree)
    except RecursionError:
        return None


def describe(engine_dir: Path, manifest: EngineManifest, plan: list[DeviceMemory]) -> str:
    """The plan as a table, a device a line, and how the weights compare with the checkpoint's bytes."""
    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    limits = manifest.limits
    lines = [f"engine {engine_dir} ({manifest.backend}{_device_note(manifest)}, {manifest.dtype}, {len(plan)} "
             f"device(s); limits: {limits['max_batch']} sequences of {limits['max_seq_len']} tokens, prefill chunks "
             f"of {limits['max_prefill_chunk']})",
             f"{'device':<7} {'graphs':<22} {'weights':>12} {'caches':>12} {'workspace':>12} {'total':>12}"]
    for device in plan:
        lines.append(f"{device.device:<7} {' + '.join(device.graphs):<22} {gib(device.weights_bytes):>12} "
                     f"{gib(device.cache_bytes):>12} {gib(device.workspace_bytes):>12} {gib(device.total_bytes):>12}")
    stored = checkpoint_bytes(manifest)
    weights = sum(d.weights_bytes for d in plan)
    lines.append(f"weights on the devices: {gib(weights)} for the checkpoint's {gib(stored)} "
                 f"({weights / max(stored, 1):.2f}x); workspace is a floor (builder/memory.py)")
    return "\n".join(lines)


def checkpoint_bytes(manifest: EngineManifest) -> int:
    """The bytes of the checkpoint's tensors with their scales (engine.json `checkpoint.bytes`; an engine built
    before it was recorded: the sizes of the checkpoint files it links)."""
    recorded = manifest.checkpoint.get("bytes")
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 0:
        return recorded
    return sum(w.bytes for w in manifest.weights if w.link != "converted")


def _device_note(manifest: EngineManifest) -> str:
    device = getattr(manifest.compiled, "device", None)
    return f" --device {device}" if device and device != "cpu" else ""


def as_json(plan: list[DeviceMemory]) -> str:
    return json.dumps({"devices": [{**asdict(d), "total_bytes": d.total_bytes} for d in plan]}, indent=2)


__all__ = ["DeviceMemory", "memory_plan", "describe", "as_json", "dimension", "checkpoint_bytes"]
