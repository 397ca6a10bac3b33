"""Weights widened by the runtime at load, a few at a time, instead of by ONNX Runtime's constant folding.

An engine's graph reads its weights as the checkpoint stores them (FP8, MXFP4, bf16) and widens them in the graph
(DequantizeLinear, Cast, MXFP4 to int8 codes): subgraphs whose every input is a constant. ONNX Runtime folds those
when a session is made, all of them at once, and keeps every intermediate until it is done: 3.6 times the resident
size at peak on the slice (2,251 MiB for 630). Here the runtime evaluates them itself before the session is made,
a group of weights at a time (a small session with no optimization runs the group's nodes, the same kernels
folding would run, so the same bits), each result written into a buffer of its own that the engine's session then
takes in place as an initializer (an in-memory weight file, as the engine's own files are); the nodes that made it
leave the graph. The peak is the resident size plus one group's intermediates.

Only what reads the engine's weight files is widened here, and of that only what is not read by MatMul or Gemm
alone: those weights ONNX Runtime folds, owns, prepacks for its GEMMs and frees after packing, where a buffer lent
to it would stay beside its packed copy (+116 MiB on the slice), and without packing a verify of k + 1 tokens ran
slower (MTP 3 at 1.30x MTP 0 on tiny-v4 against 1.39x). They are the dense FP8 and bf16 projections, one
DequantizeLinear or Cast each, whose folding keeps little besides its results; the routed experts' widening, the
peak's cause, is done here. Small constants (shapes, tables of a few bytes) are left to ONNX Runtime too.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort
from onnx import ModelProto, NodeProto, TensorProto, helper

from v4engine.contract.engine_folder import EngineFormatError, MappedWeights

LOCATION = "v4engine-widened/"          # the in-memory file of a widened weight: LOCATION + its index
GROUP_BYTES = 64 << 20                  # weights read per group (one weight alone may read more)
WIDEST = 8                              # the most a stored format widens (MXFP4 to float32); a graph asking more of
                                        # its weights is refused before anything is allocated
PACKED = {"MatMul", "Gemm"}              # ops whose constant weights ONNX Runtime packs (their folding stays its own)
_RANDOM = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}
_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
          "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(int16)": np.int16, "tensor(uint16)": np.uint16,
          "tensor(int32)": np.int32, "tensor(int64)": np.int64, "tensor(bool)": np.bool_}


@dataclass
class WidenedGraph:
    """A graph whose weights the runtime widened: its bytes, and the buffers its widened initializers live in
    (location -> bytes), which must live as long as the session."""

    model: bytes
    buffers: dict[str, np.ndarray] = field(default_factory=dict)


def widen_weights(model_bytes: bytes, weights: MappedWeights, session_options: Callable[[dict], ort.SessionOptions],
                  graph_path: object = "graph") -> WidenedGraph:
    """`model_bytes` with every constant subgraph that reads a weight file, but those only MatMul or Gemm read,
    evaluated here (the module doc).
    `session_options(files)`: the options of a session reading the in-memory weight files `files`. A graph whose
    widened weights would take more than WIDEST times what they read is refused (EngineFormatError naming the
    tensor)."""
    model = ModelProto.FromString(model_bytes)
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    reads_file = {name for name, t in initializers.items() if t.data_location == TensorProto.EXTERNAL}
    constant, producer = set(initializers), {}
    for node in graph.node:
        if _constant(node, constant):
            constant.update(node.output)
            producer.update(dict.fromkeys(node.output, node))
    readers: dict[str, set[str]] = {}            # tensor -> the op types of the nodes (not constant) that read it
    for node in graph.node:
        if node.output[0] not in producer:
            for name in node.input:
                readers.setdefault(name, set()).add(node.op_type)
    wanted = [name for name in _frontier(graph, producer) if _cone_reads(name, producer, reads_file)
              and not readers.get(name, {""}) <= PACKED]
    if not wanted:
        return WidenedGraph(model_bytes)
    files, widened = dict(weights.maps), WidenedGraph(b"")
    for group, reads in _groups(wanted, producer, initializers):
        values = _evaluate(model, group, producer, initializers, session_options(files), WIDEST * reads, graph_path)
        for name, value in zip(group, values):
            location = f"{LOCATION}{len(widened.buffers)}"
            files[location] = widened.buffers[location] = value.reshape(-1).view(np.uint8)
            initializers[name] = _external(name, value, location)
        weights.release_pages()             # the stored bytes just read: clean file pages, read again if needed
    _replace(graph, producer, initializers)
    widened.model = model.SerializeToString()
    return widened


def _constant(node: NodeProto, constant: set[str]) -> bool:
    """Whether `node` computes a constant from constants alone (standard ops, no subgraph, nothing random)."""
    if node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM:
        return False
    if any(a.type in (a.GRAPH, a.GRAPHS) for a in node.attribute):
        return False
    return all(name in constant for name in node.input if name)


def _frontier(graph, producer: dict[str, NodeProto]) -> list[str]:
    """Constants made by nodes and read by a node that is not constant (or by the graph's caller), in graph
    order: what folding would leave behind."""
    outputs = {o.name for o in graph.output}
    read = {name for node in graph.node if node.output[0] not in producer for name in node.input} | outputs
    return [name for node in graph.node if node.output[0] in producer for name in node.output if name in read]


def _cone(name: str, producer: dict[str, NodeProto], stop: set[str] = frozenset()) -> list[NodeProto]:
    """The nodes `name` is made from (through tensors not in `stop`), in no particular order."""
    nodes, todo = {}, [name]
    while todo:
        tensor = todo.pop()
        node = producer.get(tensor)
        if node is None or tensor in stop or id(node) in nodes:
            continue
        nodes[id(node)] = node
        todo.extend(i for i in node.input if i)
    return list(nodes.values())


def _cone_reads(name: str, producer: dict[str, NodeProto], reads_file: set[str]) -> bool:
    return any(i in reads_file for node in _cone(name, producer) for i in node.input)


def stored_nbytes(tensor: TensorProto) -> int:
    """An initializer's bytes as stored (its external data's length, or its raw bytes)."""
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    return len(tensor.raw_data)


def _groups(wanted: list[str], producer: dict[str, NodeProto], initializers: dict[str, TensorProto]
            ) -> list[tuple[list[str], int]]:
    """The wanted constants in groups reading about GROUP_BYTES of initializers each, in graph order, with the
    bytes each group reads."""
    groups = [([], 0)]
    for name in wanted:
        reads = sum(stored_nbytes(initializers[i]) for i in {i for n in _cone(name, producer) for i in n.input}
                    if i in initializers)
        if groups[-1][0] and groups[-1][1] + reads > GROUP_BYTES:
            groups.append(([], 0))
        groups[-1] = (groups[-1][0] + [name], groups[-1][1] + reads)
    return groups


def _evaluate(model: ModelProto, names: list[str], producer: dict[str, NodeProto],
              initializers: dict[str, TensorProto], options: ort.SessionOptions, most: int, graph_path: object
              ) -> list[np.ndarray]:
    """The values of `names`, computed by a session of their nodes alone (nothing optimized, no arena), each
    written straight into an array of its own where ONNX Runtime knows its shape; refused if they would take
    more than `most` bytes."""
    done = {n for n in initializers if n in producer}          # widened already: read, not made again
    nodes = {id(n): n for name in names for n in _cone(name, producer, done)}
    order = {id(n): i for i, n in enumerate(producer.values())}
    nodes = sorted(nodes.values(), key=lambda n: order[id(n)])
    made = {o for n in nodes for o in n.output}
    read = sorted({i for n in nodes for i in n.input if i and i not in made})
    graph = helper.make_graph(nodes, "widen", [], [helper.make_value_info(n, helper.TypeProto()) for n in names],
                              [initializers[i] for i in read])
    mini = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_cpu_mem_arena = False
    session = ort.InferenceSession(mini.SerializeToString(), options, providers=["CPUExecutionProvider"])
    binding, values, total = session.io_binding(), [], 0
    for out in session.get_outputs():
        dtype, shape = _NUMPY.get(out.type), out.shape
        known = dtype is not None and all(isinstance(d, int) for d in shape)
        total += int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize if known else 0
        if total > most:
            raise EngineFormatError(f"{graph_path}: its weight {out.name!r:.80} widens to more than {WIDEST} times "
                                    "the bytes it is made from, which no stored format does; refused")
        if known:
            value = np.empty(shape, dtype)
            binding.bind_output(out.name, "cpu", 0, dtype, shape, value.ctypes.data)
            values.append(value)
        else:
            binding.bind_output(out.name)
            values.append(None)
    session.run_with_iobinding(binding)
    values = [v if v is not None else o.numpy() for v, o in zip(values, binding.get_outputs())]
    if sum(v.nbytes for v in values) > most:
        raise EngineFormatError(f"{graph_path}: its weights {names[0]!r:.80}... widen to more than {WIDEST} times "
                                "the bytes they are made from, which no stored format does; refused")
    return values


def _external(name: str, value: np.ndarray, location: str) -> TensorProto:
    """An initializer `name` holding `value`, read from the in-memory file `location`."""
    tensor = TensorProto(name=name, dims=value.shape, data_type=helper.np_dtype_to_tensor_dtype(value.dtype),
                         data_location=TensorProto.EXTERNAL)
    for key, text in (("location", location), ("offset", "0"), ("length", str(value.nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, text
    return tensor


def _replace(graph, producer: dict[str, NodeProto], initializers: dict[str, TensorProto]) -> None:
    """The graph without the constant nodes nothing reads any more, and with the initializers still read."""
    widened = {n for n in initializers if n in producer}
    needed, keep = {o.name for o in graph.output}, []
    for node in reversed(graph.node):
        if node.output[0] in producer and needed.intersection(node.output) <= widened:
            continue
        keep.append(node)
        needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(keep))
    del graph.initializer[:]
    graph.initializer.extend(initializers[n] for n in initializers if n in needed)
