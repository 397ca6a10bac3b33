"""mHC's Sinkhorn normalization (docs/model.md §2.2): rounds of row then column normalization of the [N, N] stream
mixing matrix, each division's denominator + eps.

Under export the rounds are one `v4::HcSinkhorn` node, and the model gets a local function holding them as one
ONNX Loop (the round count, hc_sinkhorn_iters - 1, is the node's attribute). ONNX Runtime, TensorRT and MIGraphX
inline the function: the engine runs one Loop node per Sinkhorn instead of six nodes per round, the very same
arithmetic in the same order. Unrolled, the rounds were about 40% of every call's nodes, and on a small model
ONNX Runtime's cost per node is most of a call. As an op, the export does not trace them layer by layer either.
Not a plugin: the node carries no plugin_namespace.

An engine built for CUDA graphs (v4build --cuda-graphs) takes the rounds unrolled instead: a CUDA graph cannot
hold a Loop (ONNX Runtime refuses to capture a graph with control-flow nodes), and on a GPU each round's six
elementwise nodes are launches a captured graph no longer pays for one by one.
"""
from __future__ import annotations

import onnx
import torch
from onnx import TensorProto, helper

from .common import DOMAIN, OPSET, exporting, symbolic

NAME = "HcSinkhorn"


def hc_sinkhorn(comb: torch.Tensor, *, rounds: int, eps: float) -> torch.Tensor:
    """comb [..., N, N] (fp32, positive): `rounds` rounds of (rows, then columns) normalization."""
    if exporting():
        return symbolic(NAME, [comb], {"rounds": rounds, "eps": eps}, [comb.dtype], [comb.shape], plugin=False)[0]
    for _ in range(rounds):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _round(comb: str, out: str, tag: str) -> list[onnx.NodeProto]:
    """One round's nodes: rows, then columns, each divided by its sum + eps (values `rows`, `cols`, `eps`)."""
    return [helper.make_node("ReduceSum", [comb, "rows"], [f"row_sum{tag}"], keepdims=1),
            helper.make_node("Add", [f"row_sum{tag}", "eps"], [f"row_den{tag}"]),
            helper.make_node("Div", [comb, f"row_den{tag}"], [f"by_rows{tag}"]),
            helper.make_node("ReduceSum", [f"by_rows{tag}", "cols"], [f"col_sum{tag}"], keepdims=1),
            helper.make_node("Add", [f"col_sum{tag}", "eps"], [f"col_den{tag}"]),
            helper.make_node("Div", [f"by_rows{tag}", f"col_den{tag}"], [out])]


def sinkhorn_function(unrolled_rounds: int | None = None) -> onnx.FunctionProto:
    """The op's ONNX function: one Loop of `rounds` trips over a body of one round (rows, then columns); rounds
    and eps are the node's attributes. One Loop rather than the rounds unrolled: on ONNX Runtime's CPU a trip costs about
    two thirds of six separate nodes, for the same arithmetic in the same order (benchmarks/RESULTS.md).

    `unrolled_rounds`: the rounds written out instead, no Loop (for CUDA graphs, see the module doc); a node's
    `rounds` attribute must then equal it, which the build guarantees (one model, one round count)."""
    eps = helper.make_node("Constant", [], ["eps"])
    eps.attribute.append(onnx.AttributeProto(name="value_float", ref_attr_name="eps", type=onnx.AttributeProto.FLOAT))
    axes = [helper.make_node("Constant", [], ["rows"], value=helper.make_tensor("", TensorProto.INT64, [1], [-1])),
            helper.make_node("Constant", [], ["cols"], value=helper.make_tensor("", TensorProto.INT64, [1], [-2]))]
    if unrolled_rounds is not None:
        names = ["comb", *(f"comb.{r}" for r in range(1, unrolled_rounds)), "out"]
        rounds = [node for r in range(unrolled_rounds) for node in _round(names[r], names[r + 1], f".{r}")]
        rounds = rounds or [helper.make_node("Identity", ["comb"], ["out"])]
        return helper.make_function(DOMAIN, NAME, ["comb"], ["out"], [eps, *axes, *rounds],
                                    [helper.make_opsetid("", OPSET)], attributes=["rounds", "eps"])
    body = helper.make_graph(
        [*_round("comb_in", "comb_out", ""), helper.make_node("Identity", ["go_in"], ["go_out"])],
        "round", [helper.make_tensor_value_info("trip", TensorProto.INT64, []),
                  helper.make_tensor_value_info("go_in", TensorProto.BOOL, []),
                  helper.make_tensor_value_info("comb_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("go_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("comb_out", TensorProto.FLOAT, None)])
    trips = helper.make_node("Constant", [], ["trips"])
    trips.attribute.append(onnx.AttributeProto(name="value_int", ref_attr_name="rounds", type=onnx.AttributeProto.INT))
    nodes = [eps, trips, *axes,
             helper.make_node("Constant", [], ["go"], value=helper.make_tensor("", TensorProto.BOOL, [], [True])),
             helper.make_node("Loop", ["trips", "go", "comb"], ["out"], body=body)]
    return helper.make_function(DOMAIN, NAME, ["comb"], ["out"], nodes, [helper.make_opsetid("", OPSET)],
                                attributes=["rounds", "eps"])


__all__ = ["NAME", "hc_sinkhorn", "sinkhorn_function"]
