"""The CUDA variant of an ONNX Runtime engine (`v4build --device cuda`): graphs whose every compute node runs on ONNX
Runtime's CUDA execution provider, with the weights reaching the GPU as they are stored.

What the CPU engine does that a GPU cannot afford, and what this variant does instead (the provider's facts, read
from the onnxruntime-gpu 1.31.1 wheel, are in docs/backends.md §2a):
- FP8 projections: the CPU engine widens them with a blocked DequantizeLinear that ONNX Runtime folds at load, on
  the host, to the activation dtype. The CUDA provider has no blocked FP8 DequantizeLinear (int4 only) and none
  with a bf16 output; its `com.microsoft::MatMulBlockQuantizedFp8Weight` multiplies by e4m3 weights [N, K] read as
  stored, with float32 scales per 128 inputs (the rows of the 128x128 grid). Every projection chain the CPU kernels
  recognize (runtime/sessions/projections.py) becomes one such node, V4's grouped wo_a one per group.
- Routed experts: the build stacked each layer's experts in the layout the provider's MoE takes (builder/weights.py
  PREPACKED). MXFP4 ones run in `QMoE` with quant_type fp4 (e2m1 codes and E8M0 scales, read as stored: its
  fused GEMV and grouped GEMM decode them inside); FP8 ones (the 1.31.1 wheel is built without QMoE's FP8 path)
  are widened on the device at each call, a layer at a time, by a DequantizeLinear ONNX Runtime does not fold
  (to float16, exact for e4m3) and their block scales, into the bf16 `MoE`; float ones go to the bf16 `MoE`
  directly. Neither kernel reads router_weights on CUDA: our router's choice and mixing weights enter as
  router_probs = log(weight) less its row's largest (the softmax over the chosen experts gives weight / sum), and
  the output is scaled by the sum.
- The v4 ops' ONNX functions are inlined, CastLike becomes Cast and the few ops the provider registers only for
  other types (ArgMax of int32 or bf16, ...) take float32, so that every node has a CUDA kernel.
- No control flow (the graphs are exported for CUDA graphs: contract/calls.py), and the build fails naming every
  node that would still run on the CPU or make ONNX Runtime copy between host and device (`placement`): the
  provider's kernels, with their types and which inputs they read in host memory, are vendored in
  ort_cuda_kernels.json (enumerated from the 1.31.1 wheel). What ONNX Runtime still runs on the host is shape
  arithmetic (int64 values made from tensors' shapes, for Reshape, Slice, Range, Expand), which needs no copy and
  which a recorded CUDA graph replays without running: `CudaVariant.host_shape_nodes` counts it.
"""
from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, defs, helper, inliner, numpy_helper
from onnx.external_data_helper import ExternalDataInfo

from v4engine.contract.errors import V4EngineError
from v4engine.plugins import DOMAIN
from v4engine.plugins.moe import NAME as ROUTED_EXPERTS
from v4engine.runtime.sessions.projections import attribute, graph_shapes, only_reader, projections

KERNELS = Path(__file__).with_name("ort_cuda_kernels.json")
MICROSOFT = "com.microsoft"
FP8_BLOCK = 128
OPEN_END = 2**31 - 1
# computed in float32 where their type has no kernel on the provider
FLOAT_ONLY = frozenset({"ArgMax", "ArgMin", "TopK", "ReduceMax", "ReduceMin", "CumSum"})
MOE = {"activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.0, "activation_beta": 0.0,
       "normalize_routing_weights": 0}
QMOE_FP4 = {"quant_type": "fp4", "expert_weight_bits": 4, "block_size": 32, "weights_prepacked": 0}


class CudaVariantError(V4EngineError):
    """A graph that the CUDA variant cannot run wholly on ONNX Runtime's CUDA provider."""


@dataclass(frozen=True)
class CudaVariant:
    """What the preparation of one graph did and found: nodes, the dense FP8 projections on the FP8 MatMul, the
    routed-experts layers by kernel, and the shape arithmetic ONNX Runtime runs on the host (no copy: `placement`)."""

    nodes: int
    fp8_projections: int
    moe: dict[str, int]
    host_shape_nodes: int


def prepare(model: onnx.ModelProto, name: str) -> tuple[onnx.ModelProto, CudaVariant]:
    """The CUDA variant of the exported graph `name` (the module doc), checked (CudaVariantError naming every node
    that would not run on the provider)."""
    moe = routed_experts(model)
    projections = fp8_projections(model)
    model = inline_v4(model)
    typed = shapes_on_device(fold_static_shapes(with_cuda_types(model)))
    found = placement(typed)
    if found.offenders:
        shown = "; ".join(found.offenders[:8]) + (f"; and {len(found.offenders) - 8} more"
                                                  if len(found.offenders) > 8 else "")
        raise CudaVariantError(f"graph '{name}': {len(found.offenders)} node(s) would not run on ONNX Runtime "
                               f"{kernels().version}'s CUDA provider: {shown}")
    return typed, CudaVariant(len(typed.graph.node), projections, moe, len(found.host_shape_nodes))


# ---------------------------------------------------------------------- routed experts
def routed_experts(model: onnx.ModelProto) -> dict[str, int]:
    """Replace each v4::RoutedExperts node by the provider's MoE over the experts the build prepacked (module doc);
    how many layers went to each kernel."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    done: dict[str, int] = {}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != ROUTED_EXPERTS:
            nodes.append(node)
            continue
        x, indices, weights, w1, w2, _ = node.input
        fc1, name, out = w1.removesuffix(".w1") + ".fc1", node.name or node.output[0], node.output[0]
        stacked = next((initializers[f"{fc1}{suffix}"] for suffix in (".fp4", ".fp8", "")
                        if f"{fc1}{suffix}" in initializers), None)
        if stacked is None:
            raise CudaVariantError(f"{name}: its experts were not prepacked for the CUDA provider (no {fc1!r})")
        experts = stacked.dims[0]
        attributes = {**MOE, "k": _picks(graph, indices, name), "swiglu_limit": attribute(node, "limit")}
        probs, mixing_sum = _router(graph, nodes, x, indices, weights, experts, name)
        if stacked.name == f"{fc1}.fp4":
            ones = [_constant(graph, f"v4.moe.ones_{experts}", np.ones(experts, np.float32))] * 2
            inputs = [x, probs, f"{fc1}.fp4", f"{fc1}.e8m0", "", f"{w2}.fp4", f"{w2}.e8m0"] + [""] * 8 + ones
            nodes.append(helper.make_node("QMoE", inputs, [f"{name}.shares"], name=name, domain=MICROSOFT,
                                          **attributes, **QMOE_FP4))
            kernel = "QMoE fp4"
        else:
            if stacked.name == f"{fc1}.fp8":
                fc1_w, w2_w = (_widened_fp8(graph, nodes, w, initializers) for w in (fc1, w2))
                kernel = "MoE, FP8 widened on the device"
            else:
                fc1_w, w2_w, kernel = fc1, w2, "MoE"
            nodes.append(helper.make_node("MoE", [x, probs, fc1_w, "", w2_w], [f"{name}.shares"], name=name,
                                          domain=MICROSOFT, **attributes))
        nodes += [helper.make_node("Cast", [f"{name}.shares"], [f"{name}.shares_fp32"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", [f"{name}.shares_fp32", mixing_sum], [out])]
        done[kernel] = done.get(kernel, 0) + 1
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
        if all(o.domain != MICROSOFT for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MICROSOFT, 1))
    return done


def _picks(graph: onnx.GraphProto, indices: str, name: str) -> int:
    info = next((v for v in graph.value_info if v.name == indices), None)
    dims = info.type.tensor_type.shape.dim if info is not None else []
    if len(dims) != 2 or not dims[1].dim_value:
        raise CudaVariantError(f"{name}: the exporter gave {indices!r} no static number of picks per token")
    return dims[1].dim_value


def _router(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], x: str, indices: str, weights: str, experts: int,
            name: str) -> tuple[str, str]:
    """(router_probs [T, E] in x's type, the mixing weights' sum per token [T, 1] float32): our choice and mixing
    weights as the provider's MoE takes them. Its softmax over log(weight) gives weight / sum at the chosen experts
    (a hash layer's repeated pick: their sum) and 0 elsewhere (-inf); less the row's largest, the largest enters
    exactly in the activation type."""
    count = _constant(graph, f"v4.moe.experts_{experts}", np.array([experts], np.int64))
    last = _constant(graph, "v4.moe.last_axis", np.array([-1], np.int64))
    nodes += [helper.make_node("Shape", [x], [f"{name}.tokens"], end=1),
              helper.make_node("Concat", [f"{name}.tokens", count], [f"{name}.route_shape"], axis=0),
              helper.make_node("ConstantOfShape", [f"{name}.route_shape"], [f"{name}.zeros"],
                               value=numpy_helper.from_array(np.zeros(1, np.float32))),
              helper.make_node("ScatterElements", [f"{name}.zeros", indices, weights], [f"{name}.mixing"], axis=1,
                               reduction="add"),
              helper.make_node("ReduceSum", [f"{name}.mixing", last], [f"{name}.mixing_sum"]),
              helper.make_node("Log", [f"{name}.mixing"], [f"{name}.log_mixing"]),
              helper.make_node("ReduceMax", [f"{name}.log_mixing", last], [f"{name}.log_max"]),
              helper.make_node("Sub", [f"{name}.log_mixing", f"{name}.log_max"], [f"{name}.log_shares"]),
              helper.make_node("CastLike", [f"{name}.log_shares", x], [f"{name}.router_probs"])]
    return f"{name}.router_probs", f"{name}.mixing_sum"


def _widened_fp8(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], weight: str,
                 initializers: dict[str, TensorProto]) -> str:
    """The prepacked FP8 experts `weight.fp8` [E, rows, cols] widened to bf16 on the device: a DequantizeLinear to
    float16 (exact for e4m3; ONNX Runtime folds no DequantizeLinear of a constant unless told to, so this runs at
    each call, not on the host at load), then the block scales `weight.fp8_scale` [E, rows, nb], each over
    cols / nb inputs (nb = 1, or 128 inputs a block)."""
    if any(f"{weight}.widened" in node.output for node in nodes):   # a draft graph's steps share the experts
        return f"{weight}.widened"
    experts, rows, cols = initializers[f"{weight}.fp8"].dims
    blocks = initializers[f"{weight}.fp8_scale"].dims[2]
    if cols % blocks or (blocks > 1 and cols // blocks != FP8_BLOCK):
        raise CudaVariantError(f"{weight}: {cols} inputs a row in {blocks} scale blocks; the CUDA variant widens FP8 "
                               f"experts by whole blocks of {FP8_BLOCK} (or one block a row) only")
    grouped = _constant(graph, f"v4.shape_{experts}x{rows}x{blocks}x{cols // blocks}",
                        np.array([experts, rows, blocks, cols // blocks], np.int64))
    stacked = _constant(graph, f"v4.shape_{experts}x{rows}x{cols}", np.array([experts, rows, cols], np.int64))
    unit = _constant(graph, "v4.moe.fp16_one", np.array(1.0, np.float16))
    axis = _constant(graph, "v4.moe.last_axis", np.array([-1], np.int64))
    nodes += [helper.make_node("DequantizeLinear", [f"{weight}.fp8", unit], [f"{weight}.fp16"]),
              helper.make_node("Cast", [f"{weight}.fp16"], [f"{weight}.bf16"], to=TensorProto.BFLOAT16),
              helper.make_node("Reshape", [f"{weight}.bf16", grouped], [f"{weight}.blocks"]),
              helper.make_node("Cast", [f"{weight}.fp8_scale"], [f"{weight}.scale_bf16"], to=TensorProto.BFLOAT16),
              helper.make_node("Unsqueeze", [f"{weight}.scale_bf16", axis], [f"{weight}.block_scale"]),
              helper.make_node("Mul", [f"{weight}.blocks", f"{weight}.block_scale"], [f"{weight}.scaled"]),
              helper.make_node("Reshape", [f"{weight}.scaled", stacked], [f"{weight}.widened"])]
    return f"{weight}.widened"


def _constant(graph: onnx.GraphProto, name: str, value: np.ndarray) -> str:
    """A small inline initializer shared by the graph (added once); its name."""
    if all(t.name != name for t in graph.initializer):
        graph.initializer.append(numpy_helper.from_array(value, name))
    return name


# ---------------------------------------------------------------------- dense FP8 projections
def fp8_projections(model: onnx.ModelProto) -> int:
    """Every X W^T over an FP8 weight (a blocked DequantizeLinear of an e4m3 initializer and float32 scale rows,
    its Cast to the activation dtype, then a projection chain: runtime/sessions/projections.py) becomes
    com.microsoft::MatMulBlockQuantizedFp8Weight over the stored weight, one per group of V4's grouped wo_a (its
    rows split in place: each group's weight and scale rows are a byte range of the stacked ones). Returns how
    many chains moved."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for value in node.input:
            readers.setdefault(value, []).append(node)
    outputs, shapes = {o.name for o in graph.output}, graph_shapes(graph)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    gone: set[int] = set()
    for node in graph.node:
        weight = _fp8_weight(node, initializers, readers)
        if weight is None:
            continue
        cast = only_reader(node.output[0], readers, outputs)
        if cast is None or cast.op_type != "Cast":
            continue
        found = projections(cast.output[0], list(initializers[weight].dims), readers, outputs, shapes)
        if found is None:
            continue
        for chain, groups in found:
            x, y = chain[-1].input[0], chain[-1].output[0]
            replaced[id(chain[-1])] = _fp8_matmuls(graph, initializers, x, y, weight, node.input[1], groups)
            gone.update(id(n) for n in chain[:-1])
        gone.update((id(node), id(cast)))
    if replaced:
        kept = []
        for node in graph.node:
            if id(node) not in gone:
                kept += replaced.get(id(node), [node])
        del graph.node[:]
        graph.node.extend(kept)
        if all(o.domain != MICROSOFT for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MICROSOFT, 1))
    return len(replaced)


def _fp8_weight(node: onnx.NodeProto, initializers: dict[str, TensorProto],
                readers: dict[str, list[onnx.NodeProto]]) -> str | None:
    """The e4m3 initializer [N, K] a blocked DequantizeLinear (axis 1, block 128, float32 scales [N, ceil(K/128)])
    widens, read by nothing else; None for any other node."""
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    weight, scale = initializers.get(node.input[0]), initializers.get(node.input[1])
    if weight is None or scale is None or weight.data_type != TensorProto.FLOAT8E4M3FN or len(weight.dims) != 2 \
            or len(readers[weight.name]) != 1 or scale.data_type != TensorProto.FLOAT:
        return None
    if attribute(node, "axis") not in (1, -1) or attribute(node, "block_size") != FP8_BLOCK \
            or list(scale.dims) != [weight.dims[0], -(-weight.dims[1] // FP8_BLOCK)]:
        return None
    return weight.name


def _fp8_matmuls(graph: onnx.GraphProto, initializers: dict[str, TensorProto], x: str, y: str, weight: str,
                 scale: str, groups: int) -> list[onnx.NodeProto]:
    """The nodes computing y = x W^T from the stored e4m3 weight: one FP8 MatMul; for G groups (x [G, T, K] or
    [T, K], y [G, T, N / G]) one per group over its rows, stacked."""
    if groups == 1:
        return [helper.make_node("MatMulBlockQuantizedFp8Weight", [x, weight, scale], [y], name=f"{y}.fp8",
                                 domain=MICROSOFT, block_size=FP8_BLOCK)]
    rank = next((len(v.type.tensor_type.shape.dim) for v in graph.value_info if v.name == x), None)
    axis = _constant(graph, "v4.axis_0", np.array([0], np.int64))
    parts = [_row_slice(graph, initializers[name], groups) for name in (weight, scale)]
    nodes, made = [], []
    for g in range(groups):
        part_x = x
        if rank == 3:
            index = _constant(graph, f"v4.index_{g}", np.array(g, np.int64))
            part_x = f"{y}.x{g}"
            nodes.append(helper.make_node("Gather", [x, index], [part_x], axis=0))
        nodes += [helper.make_node("MatMulBlockQuantizedFp8Weight", [part_x, parts[0][g], parts[1][g]], [f"{y}.{g}"],
                                   name=f"{y}.fp8.{g}", domain=MICROSOFT, block_size=FP8_BLOCK),
                  helper.make_node("Unsqueeze", [f"{y}.{g}", axis], [f"{y}.{g}.stacked"])]
        made.append(f"{y}.{g}.stacked")
    nodes.append(helper.make_node("Concat", made, [y], axis=0))
    return nodes


def _row_slice(graph: onnx.GraphProto, tensor: TensorProto, groups: int) -> list[str]:
    """`groups` initializers over the row blocks of a 2-D external initializer, each the byte range of its rows in
    the same file (nothing copied)."""
    rows, cols = tensor.dims
    names = [f"{tensor.name}.group{g}" for g in range(groups)]
    if any(t.name == names[0] for t in graph.initializer):       # (a draft graph's steps share the weight)
        return names
    info = ExternalDataInfo(tensor)
    width = {TensorProto.FLOAT8E4M3FN: 1, TensorProto.FLOAT: 4}[tensor.data_type]
    step = rows // groups * cols * width
    for g in range(groups):
        part = TensorProto(name=names[g], data_type=tensor.data_type, dims=[rows // groups, cols],
                           data_location=TensorProto.EXTERNAL)
        for key, value in (("location", info.location), ("offset", (info.offset or 0) + g * step), ("length", step)):
            part.external_data.add(key=key, value=str(value))
        graph.initializer.append(part)
    return names


# ---------------------------------------------------------------------- inlining and types
def inline_v4(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with every v4 op's function inlined (ONNX Runtime would inline them itself; placement reads the
    nodes it would run)."""
    inlined = inliner.inline_local_functions(model)
    del inlined.functions[:]
    kept = [o for o in inlined.opset_import if o.domain != DOMAIN]
    del inlined.opset_import[:]
    inlined.opset_import.extend(kept)
    return inlined


def with_cuda_types(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with CastLike made Cast (the provider has no CastLike kernel) and each op of FLOAT_ONLY whose input
    type the provider has no kernel for computed in float32 (its other outputs cast back), then its types inferred."""
    typed = _inferred(model)
    types = value_types(typed)
    nodes: list[onnx.NodeProto] = []
    for node in typed.graph.node:
        if node.op_type == "CastLike" and node.domain in ("", "ai.onnx"):
            nodes.append(helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name,
                                          to=types[node.input[1]]))
        elif node.op_type in FLOAT_ONLY and types.get(node.input[0]) not in (TensorProto.FLOAT, None) \
                and kernels().match(node, types, _opset(typed)) is None:
            nodes += _in_float(node, types)
        else:
            nodes.append(node)
    del typed.graph.node[:]
    typed.graph.node.extend(nodes)
    return _inferred(typed)


def _in_float(node: onnx.NodeProto, types: dict[str, int]) -> list[onnx.NodeProto]:
    """`node` on float32 inputs (its first; TopK's values output cast back to the input's type)."""
    widened = f"{node.output[0]}.float_in"
    inner = onnx.NodeProto()
    inner.CopyFrom(node)
    inner.input[0] = widened
    out = [helper.make_node("Cast", [node.input[0]], [widened], to=TensorProto.FLOAT), inner]
    if node.op_type != "ArgMax" and node.op_type != "ArgMin":           # the values keep the input's type
        inner.output[0] = f"{node.output[0]}.float_out"
        out.append(helper.make_node("Cast", [inner.output[0]], [node.output[0]], to=types[node.input[0]]))
    return out


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every value's type inferred; onnx knows no com.microsoft op, whose outputs take their first
    input's type (QMoE, MoE and the FP8 MatMul keep the activation type), inferred again until none is left."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    while True:
        known = value_types(inferred)
        found = [helper.make_tensor_value_info(node.output[0], known[node.input[0]], None)
                 for node in inferred.graph.node
                 if node.domain == MICROSOFT and node.output[0] not in known and node.input[0] in known]
        if not found:
            return inferred
        inferred.graph.value_info.extend(found)
        inferred = onnx.shape_inference.infer_shapes(inferred, data_prop=True)


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Every typed value of the graph: inputs, outputs, value_info, initializers."""
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output, *graph.value_info)
             if v.type.tensor_type.elem_type}
    types.update({t.name: t.data_type for t in graph.initializer})
    return types


def _opset(model: onnx.ModelProto) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}


# ---------------------------------------------------------------------- shapes
def fold_static_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with every Shape node whose dims are all static (a pool's rows per block, a head's width) a
    Constant, so that what is made from it is folded at load, not computed on the host at each call."""
    shapes = value_shapes(model)
    nodes = []
    for node in model.graph.node:
        dims = _shape_slice(node, shapes)
        if dims is not None and all(isinstance(d, int) for d in dims):
            nodes.append(helper.make_node("Constant", [], list(node.output), name=node.name,
                                          value=numpy_helper.from_array(np.array(dims, np.int64))))
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def shapes_on_device(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with each value that device arithmetic reads but ONNX Runtime would make on the host (shape
    arithmetic from a dynamic dim: a compressor's window length, seq + state rows) computed again on the device for
    it: each Shape behind it becomes the count of its tensor's rows along that axis, taken on the device (a few
    tiny kernels, which a CUDA graph records), and the host arithmetic after it is repeated there. ONNX Runtime
    would otherwise copy the value from the host at each call (a Memcpy node, which rules out recording)."""
    shapes = value_shapes(model)
    _constant(model.graph, "v4.cuda.zero", np.array(0, np.int64))
    twins: dict[str, str] = {}
    for _ in range(4):                 # each round moves the values the previous one left on the host
        typed = _inferred(model)
        producer = {o: n for n in typed.graph.node for o in n.output}
        reads = _host_reads(typed)
        if not reads:
            return typed
        made: list[onnx.NodeProto] = []
        for node, i, value in reads:
            node.input[i] = _device_twin(value, producer, shapes, twins, made)
        ordered = _before_readers(list(typed.graph.node), made)
        del typed.graph.node[:]
        typed.graph.node.extend(ordered)
        model = typed
    return _inferred(model)


def _host_reads(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, int, str]]:
    """(node, input index, value) for each input of a node on the device that ONNX Runtime would make on the
    host (the Memcpy cases of `placement`)."""
    return [(node, i, value) for node, i, value, where in _Placed(model).copies() if where == "device"]


def _device_twin(value: str, producer: dict[str, onnx.NodeProto], shapes: dict[str, list], twins: dict[str, str],
                 made: list[onnx.NodeProto]) -> str:
    """`value` (host shape arithmetic) computed on the device: the same nodes, each Shape replaced by row counts
    taken on the device (_device_dims); constants as they are."""
    if value in twins:
        return twins[value]
    node = producer.get(value)
    if node is None:                                            # a graph input or a constant
        return value
    if node.op_type == "Shape":
        twin = _device_dims(node, shapes, made)
    else:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = f"{node.name or node.output[0]}.device"
        for i, inner in enumerate(node.input):
            if inner:
                copy.input[i] = _device_twin(inner, producer, shapes, twins, made)
        for i, out in enumerate(node.output):
            copy.output[i] = f"{out}.device"
        made.append(copy)
        twin = copy.output[list(node.output).index(value)]
    twins[value] = twin
    return twin


def _device_dims(node: onnx.NodeProto, shapes: dict[str, list], made: list[onnx.NodeProto]) -> str:
    """Shape(x, start, end) [end - start] int64 on the device: for each axis, x's elements along it (the others
    held at 0) counted there: Gather, IsNaN-free ones (not x > x), ReduceSum."""
    x, out = node.input[0], f"{node.output[0]}.device"
    rank = len(shapes[x])
    start, end = attribute(node, "start") or 0, attribute(node, "end")
    end = rank if end is None else end
    axes = range(start + rank if start < 0 else start, min(end + rank if end < 0 else end, rank))
    counts = []
    for axis in axes:
        line = x
        for other in reversed([a for a in range(rank) if a != axis]):     # x[0, .., :, .., 0]
            made.append(helper.make_node("Gather", [line, "v4.cuda.zero"], [f"{out}.{axis}.{other}"], axis=other))
            line = f"{out}.{axis}.{other}"
        made += [helper.make_node("Cast", [line], [f"{out}.{axis}.float"], to=TensorProto.FLOAT),
                 helper.make_node("Greater", [f"{out}.{axis}.float", f"{out}.{axis}.float"], [f"{out}.{axis}.never"]),
                 helper.make_node("Not", [f"{out}.{axis}.never"], [f"{out}.{axis}.always"]),
                 helper.make_node("Cast", [f"{out}.{axis}.always"], [f"{out}.{axis}.ones"], to=TensorProto.INT64),
                 helper.make_node("ReduceSum", [f"{out}.{axis}.ones"], [f"{out}.{axis}"], keepdims=1)]
        counts.append(f"{out}.{axis}")
    made.append(helper.make_node("Concat", counts, [out], axis=0) if len(counts) != 1 else
                helper.make_node("Identity", counts, [out]))
    return out


def _before_readers(nodes: list[onnx.NodeProto], made: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` and `made` in an order where every value is made before it is read."""
    everything = nodes + made
    producer = {o: n for n in everything for o in n.output}
    ordered, placed = [], set()

    def place(node: onnx.NodeProto) -> None:
        stack = [(node, False)]
        while stack:
            current, ready = stack.pop()
            if id(current) in placed:
                continue
            if ready:
                placed.add(id(current))
                ordered.append(current)
                continue
            stack.append((current, True))
            stack.extend((producer[v], False) for v in current.input if v in producer
                         and id(producer[v]) not in placed)

    for node in everything:
        place(node)
    return ordered


def _shape_slice(node: onnx.NodeProto, shapes: dict[str, list]) -> list | None:
    """The dims a Shape node gives (ints where static, names where not), or None for another node or an input of
    unknown rank."""
    if node.op_type != "Shape" or node.domain not in ("", "ai.onnx") or node.input[0] not in shapes:
        return None
    dims = shapes[node.input[0]]
    start, end = attribute(node, "start") or 0, attribute(node, "end")
    return dims[start:end]


def value_shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Every value's shape the graph states: an int per static dim, its name (or None) per other."""
    graph = model.graph
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                       for d in v.type.tensor_type.shape.dim]
              for v in (*graph.input, *graph.output, *graph.value_info) if v.type.tensor_type.HasField("shape")}
    shapes.update({t.name: list(t.dims) for t in graph.initializer})
    return shapes


# ---------------------------------------------------------------------- the provider's kernels
@dataclass(frozen=True)
class Kernel:
    """One registered kernel: the opset versions it serves, its type constraints (one allowed combination per
    registration), and the inputs and outputs it keeps in host memory."""

    since: int
    end: int
    types: tuple[dict[str, frozenset[str]], ...]
    cpu_inputs: frozenset[int]
    cpu_outputs: frozenset[int]


class CudaKernels:
    """ort_cuda_kernels.json: what ONNX Runtime's CUDA provider registers, and the kernel it gives a node."""

    def __init__(self, path: Path = KERNELS):
        raw = json.loads(path.read_text())
        self.version = raw["onnxruntime"]
        self._kernels: dict[tuple[str, str], list[Kernel]] = {}
        for row in raw["kernels"]:
            kernel = Kernel(row["since"], row.get("end", OPEN_END),
                            tuple({name: frozenset(allowed) for name, allowed in combination.items()}
                                  for combination in row["types"]),
                            frozenset(row.get("cpu_inputs", ())), frozenset(row.get("cpu_outputs", ())))
            self._kernels.setdefault((row["domain"], row["op"]), []).append(kernel)

    def match(self, node: onnx.NodeProto, types: dict[str, int], opset: dict[str, int]) -> Kernel | None:
        """The kernel ONNX Runtime's CUDA provider runs `node` with (its types from `types`), or None. As ONNX
        Runtime matches (KernelRegistry::VerifyKernelDef): the kernel starts at the op's since-version for this
        opset, or starts before it and ends at or after it; every formal parameter's type is one its constraint
        allows."""
        domain = "" if node.domain == "ai.onnx" else node.domain
        schema = _schema(node.op_type, opset.get(domain, 1), domain)
        if schema is None:
            return None
        actual: dict[str, set[str]] = {}
        for values, formals in ((node.input, schema.inputs), (node.output, schema.outputs)):
            for i, value in enumerate(values):
                if not value or not formals or value not in types:
                    continue
                formal = formals[min(i, len(formals) - 1)]
                actual.setdefault(formal.type_str, set()).add(_TYPE_NAMES[types[value]])
        for kernel in self._kernels.get((domain, node.op_type), []):
            since = schema.since_version
            if not (kernel.since == since or kernel.since < since <= kernel.end != OPEN_END):
                continue
            for combination in kernel.types:
                if all(names <= combination[c] for c, names in actual.items() if c in combination):
                    return kernel
        return None


_TYPE_NAMES = {value: name.lower() for name, value in TensorProto.DataType.items()}


@cache
def kernels() -> CudaKernels:
    return CudaKernels()


@cache
def _schema(op: str, version: int, domain: str):
    """The schema of an op at an opset: onnx's for the standard domain, ONNX Runtime's for com.microsoft."""
    if domain == MICROSOFT:
        return _microsoft_schemas().get(op)
    try:
        return defs.get_schema(op, version, domain)
    except defs.SchemaError:
        return None


@cache
def _microsoft_schemas() -> dict:
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    schemas = {}
    for schema in ort_state.get_all_operator_schema():
        if schema.domain == MICROSOFT:
            schemas[schema.name] = _Schema(schema.since_version, [_Formal(p.typeStr) for p in schema.inputs],
                                           [_Formal(p.typeStr) for p in schema.outputs])
    return schemas


@dataclass(frozen=True)
class _Formal:
    type_str: str


@dataclass(frozen=True)
class _Schema:
    since_version: int
    inputs: list[_Formal]
    outputs: list[_Formal]


# ---------------------------------------------------------------------- where ONNX Runtime would run each node
@dataclass
class Placement:
    """Where ONNX Runtime would run a graph given the CUDA provider first (`placement`): the nodes it would run on
    the CPU provider although they compute on tensors (`offenders`: no CUDA kernel for their types, control flow,
    a copy between host and device), and the shape arithmetic it places on the host (`host_shape_nodes`)."""

    offenders: list[str]
    host_shape_nodes: list[str]


def placement(model: onnx.ModelProto) -> Placement:
    """What ONNX Runtime 1.31 would do with `model` (types inferred) on the CUDA provider, modelled from its
    partitioning: constant subgraphs are folded first (ConstantFolding, which leaves a DequantizeLinear of a
    constant alone), every node with a CUDA kernel for its types goes to CUDA, then the consumers of host outputs
    (Shape's) whose every input is on the host move there (GetCpuPreferredNodes, never for float16/bf16 inputs),
    and a value read where it does not live is a Memcpy node, which rules out recording a CUDA graph."""
    placed = _Placed(model)
    offenders: list[str] = []
    for node in placed.nodes:
        if node.op_type in CONTROL_FLOW:
            offenders.append(f"{node.op_type} '{node.name or node.output[0]}' (control flow: no CUDA graph holds it)")
        elif placed.kernel_of[id(node)] is None:
            offenders.append(f"{_described(node, placed.types)} (no CUDA kernel for these types)")
        elif node.op_type == "DequantizeLinear" and (attribute(node, "block_size") or 0) \
                and placed.types.get(node.input[0]) not in (TensorProto.INT4, TensorProto.UINT4):
            offenders.append(f"{_described(node, placed.types)} (blocked: the CUDA kernel implements blocks for int4 "
                             "only)")
    for node, _, value, where in placed.copies():
        offenders.append(f"{_described(node, placed.types)} reads {value!r} on the {where}, where "
                         f"{placed.producer[value].op_type} does not put it (a Memcpy node)")
    return Placement(offenders, [n.name or n.output[0] for n in placed.nodes if id(n) in placed.host])


class _Placed:
    """A graph as ONNX Runtime would partition it (`placement` says how): the nodes left after constant folding,
    each one's CUDA kernel (None: none), the nodes on the host, and where each value lives."""

    def __init__(self, model: onnx.ModelProto):
        graph, catalogue, opset = model.graph, kernels(), _opset(model)
        self.types = value_types(model)
        self.inputs = {i.name for i in graph.input}
        self.constants = {t.name for t in graph.initializer}
        self.nodes = []
        for node in graph.node:                 # ConstantFolding, as ONNX Runtime runs it before partitioning
            folded = node.op_type != "DequantizeLinear" and all(not i or i in self.constants for i in node.input)
            if folded and node.op_type not in CONTROL_FLOW:
                self.constants.update(node.output)
            else:
                self.nodes.append(node)
        self.kernel_of = {id(node): catalogue.match(node, self.types, opset) for node in self.nodes}
        self.host = _host_nodes(self.nodes, self.kernel_of, self.types, self.constants | self.inputs)
        self.host_values = {o for n in self.nodes if id(n) in self.host for o in n.output}
        for node in self.nodes:
            kernel = self.kernel_of[id(node)]
            if kernel is not None:
                self.host_values.update(o for i, o in enumerate(node.output) if i in kernel.cpu_outputs)
        self.producer = {o: n for n in self.nodes for o in n.output}

    def copies(self) -> list[tuple[onnx.NodeProto, int, str, str]]:
        """(node, input index, value, where the node reads it: "host" or "device") for each value a node with a
        kernel reads where its producer (with a kernel too) does not put it: ONNX Runtime's Memcpy nodes."""
        found = []
        for node in self.nodes:
            kernel, on_host = self.kernel_of[id(node)], id(node) in self.host
            if kernel is None:
                continue
            for i, value in enumerate(node.input):
                if not value or value in self.constants or value in self.inputs or value not in self.producer \
                        or self.kernel_of[id(self.producer[value])] is None:
                    continue
                wants_host = on_host or i in kernel.cpu_inputs
                if wants_host != (value in self.host_values):
                    found.append((node, i, value, "host" if wants_host else "device"))
        return found


CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
_NARROW = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})


def _host_nodes(nodes: list[onnx.NodeProto], kernel_of: dict[int, Kernel | None], types: dict[str, int],
                fixed: set[str]) -> set[int]:
    """The nodes ONNX Runtime places on the CPU provider to keep shape arithmetic on the host (its
    GetCpuPreferredNodes): from the consumers of host outputs, in graph order, each node whose inputs are all
    constants, graph inputs or host values that its CUDA kernel does not itself read in host memory, and none of
    them float16 or bf16."""
    order = {id(n): i for i, n in enumerate(nodes)}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for value in node.input:
            consumers.setdefault(value, []).append(node)
    host_values: set[str] = set()
    queue: list[tuple[int, int, onnx.NodeProto]] = []
    for node in nodes:
        kernel = kernel_of[id(node)]
        for i, value in enumerate(node.output):
            if kernel is not None and i in kernel.cpu_outputs:
                host_values.add(value)
                queue += [(order[id(c)], id(c), c) for c in consumers.get(value, [])]
    heapq.heapify(queue)
    host, seen = set(), set()
    while queue:
        _, key, node = heapq.heappop(queue)
        if key in seen:
            continue
        seen.add(key)
        kernel = kernel_of[key]
        if kernel is None:
            continue
        if all(not value or (types.get(value) not in _NARROW and (
                value in fixed or (value in host_values and i not in kernel.cpu_inputs)))
               for i, value in enumerate(node.input)):
            host.add(key)
            for value in node.output:
                host_values.add(value)
                for consumer in consumers.get(value, []):
                    heapq.heappush(queue, (order[id(consumer)], id(consumer), consumer))
    return host


def _described(node: onnx.NodeProto, types: dict[str, int]) -> str:
    kinds = ", ".join(_TYPE_NAMES.get(types.get(i, 0), "?") for i in node.input if i)
    domain = f"{node.domain}::" if node.domain not in ("", "ai.onnx") else ""
    return f"{domain}{node.op_type} '{node.name or node.output[0]}' ({kinds})"


__all__ = ["prepare", "placement", "Placement", "CudaVariant", "CudaVariantError", "CudaKernels", "kernels",
           "routed_experts", "fp8_projections", "inline_v4", "with_cuda_types"]
