"""Where a graph multiplies by a weight: the node chains an exported projection X W^T takes (MatMul of a transposed
weight, Gemm with transB, V4's grouped wo_a), found from the weight's widening on. v4engine's CPU kernels
(stored_weights.py) and the CUDA variant of an engine (builder/backends/onnxruntime_cuda.py) both replace these
chains by one node that reads the stored weight."""
from __future__ import annotations

from dataclasses import dataclass

from onnx import NodeProto, TensorProto, helper, numpy_helper


def projection(widened: str, dims: list[int], readers: dict[str, list[NodeProto]], outputs: set[str],
                shapes: GraphShapes) -> tuple[list[NodeProto], int] | None:
    """The nodes that multiply by the widened weight [N, K] as X W^T, the product last, and the number of groups:
    [Transpose, MatMul] or [Gemm] (one group); [Reshape to [G, N / G, K], Transpose of the last two, MatMul of an X
    of rank 2 or 3] (G groups: V4's wo_a, a [N / G, K] weight per group); None for any other use."""
    user = only_reader(widened, readers, outputs)
    return None if user is None else chain_from(user, widened, dims, readers, outputs, shapes)


def projections(widened: str, dims: list[int], readers: dict[str, list[NodeProto]], outputs: set[str],
                shapes: GraphShapes) -> list[tuple[list[NodeProto], int]] | None:
    """Every projection chain reading the widened weight (as `projection` finds one), when each of its readers
    begins one (a draft graph's k steps share one layer's weights); None otherwise."""
    users = readers.get(widened, [])
    if widened in outputs or not users or any(u.domain not in ("", "ai.onnx") for u in users):
        return None
    chains = [chain_from(user, widened, dims, readers, outputs, shapes) for user in users]
    return None if any(chain is None for chain in chains) else chains


def chain_from(user: NodeProto, widened: str, dims: list[int], readers: dict[str, list[NodeProto]],
               outputs: set[str], shapes: GraphShapes) -> tuple[list[NodeProto], int] | None:
    """The projection chain (`projection`) that begins at `user`, a reader of the widened weight."""
    if user.op_type == "Gemm":
        plain = (len(user.input) == 2 or not user.input[2]) and user.input[1] == widened and user.input[0] != widened
        ok = plain and attribute(user, "transB") == 1 and not attribute(user, "transA") \
            and attribute(user, "alpha") in (None, 1.0)
        return ([user], 1) if ok else None
    chain, groups, perm = [], 1, (None, [1, 0])
    if user.op_type == "Reshape" and user.input[0] == widened:
        shape = shapes.values.get(user.input[1]) if len(user.input) == 2 else None
        if shape is None or len(shape) != 3 or shape[0] <= 0 or shape[1] <= 0 or shape[0] * shape[1] != dims[0] \
                or shape[2] not in (dims[1], -1):
            return None
        chain, groups, perm = [user], int(shape[0]), ([0, 2, 1],)
        user = only_reader(user.output[0], readers, outputs)
    if user is None or user.op_type != "Transpose" or attribute(user, "perm") not in perm:
        return None
    product = only_reader(user.output[0], readers, outputs)
    if product is None or product.op_type != "MatMul" \
            or list(product.input) != [product.input[0], user.output[0]] or product.input[0] == user.output[0]:
        return None
    if groups > 1 and shapes.ranks.get(product.input[0]) not in (2, 3):     # the kernel's grouped X (stored_weights.cc)
        return None
    return [*chain, user, product], groups


def only_reader(name: str, readers: dict[str, list[NodeProto]], outputs: set[str]) -> NodeProto | None:
    """The one standard node reading `name`, where nothing else (nor the graph's caller) does."""
    users = readers.get(name, [])
    if name in outputs or len(users) != 1 or users[0].domain not in ("", "ai.onnx"):
        return None
    return users[0]


@dataclass
class GraphShapes:
    """What a graph says of its values' shapes: the values of 1-D int64 constants (initializers, Constant nodes and
    Concats of them: a Reshape's target) and the ranks of values (value_info, or a Transpose's perm)."""

    values: dict[str, list[int]]
    ranks: dict[str, int]


def graph_shapes(graph) -> GraphShapes:
    values = {t.name: numpy_helper.to_array(t).tolist() for t in graph.initializer
              if t.data_location != TensorProto.EXTERNAL and t.data_type == TensorProto.INT64 and len(t.dims) == 1}
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in (*graph.input, *graph.value_info)
             if v.type.tensor_type.HasField("shape")}
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Constant" and len(node.attribute) == 1:
            kind, value = node.attribute[0].name, helper.get_attribute_value(node.attribute[0])
            if kind == "value_ints":
                values[node.output[0]] = list(value)
            elif kind == "value" and value.data_type == TensorProto.INT64 and len(value.dims) == 1:
                values[node.output[0]] = numpy_helper.to_array(value).tolist()
        elif node.op_type == "Concat" and node.input and all(i in values for i in node.input):
            values[node.output[0]] = [v for i in node.input for v in values[i]]
        elif node.op_type == "Transpose" and attribute(node, "perm") is not None:
            ranks.setdefault(node.output[0], len(attribute(node, "perm")))
    return GraphShapes(values, ranks)


def attribute(node: NodeProto, name: str):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None
