"""mHC's Sinkhorn normalization (docs/model.md §2.2): rounds of row then column normalization of the [N, N] stream
mixing matrix, each division's denominator + eps.

Under export the rounds are one `v4::HcSinkhorn` node, and the model gets a local function holding them as one
ONNX Loop (the round count, hc_sinkhorn_iters - 1, is the node's attribute). ONNX Runtime, TensorRT and MIGraphX
inline the function: the engine runs one Loop node per Sinkhorn instead of six nodes per round, the very same
arithmetic in the same order. Unrolled, the rounds were about 40% of every call's nodes, and on a small model
ONNX Runtime's cost per node is most of a call. As an op, the export does not trace them layer by layer either.
Not a plugin: the node carries no plugin_namespace.
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


def sinkhorn_function() -> onnx.FunctionProto:
    """The op's ONNX function: one Loop of `rounds` trips over a body of one round (rows, then columns); rounds
    and eps are the node's attributes. One Loop rather than the rounds unrolled: on ONNX Runtime's CPU a trip costs about
    two thirds of six separate nodes, for the same arithmetic in the same order (benchmarks/RESULTS.md)."""
    eps = helper.make_node("Constant", [], ["eps"])
    eps.attribute.append(onnx.AttributeProto(name="value_float", ref_attr_name="eps", type=onnx.AttributeProto.FLOAT))
    body = helper.make_graph(
        [helper.make_node("ReduceSum", ["comb_in", "rows"], ["row_sum"], keepdims=1),
         helper.make_node("Add", ["row_sum", "eps"], ["row_den"]),
         helper.make_node("Div", ["comb_in", "row_den"], ["by_rows"]),
         helper.make_node("ReduceSum", ["by_rows", "cols"], ["col_sum"], keepdims=1),
         helper.make_node("Add", ["col_sum", "eps"], ["col_den"]),
         helper.make_node("Div", ["by_rows", "col_den"], ["comb_out"]),
         helper.make_node("Identity", ["go_in"], ["go_out"])],
        "round", [helper.make_tensor_value_info("trip", TensorProto.INT64, []),
                  helper.make_tensor_value_info("go_in", TensorProto.BOOL, []),
                  helper.make_tensor_value_info("comb_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("go_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("comb_out", TensorProto.FLOAT, None)])
    trips = helper.make_node("Constant", [], ["trips"])
    trips.attribute.append(onnx.AttributeProto(name="value_int", ref_attr_name="rounds", type=onnx.AttributeProto.INT))
    nodes = [eps, trips,
             helper.make_node("Constant", [], ["rows"], value=helper.make_tensor("", TensorProto.INT64, [1], [-1])),
             helper.make_node("Constant", [], ["cols"], value=helper.make_tensor("", TensorProto.INT64, [1], [-2])),
             helper.make_node("Constant", [], ["go"], value=helper.make_tensor("", TensorProto.BOOL, [], [True])),
             helper.make_node("Loop", ["trips", "go", "comb"], ["out"], body=body)]
    return helper.make_function(DOMAIN, NAME, ["comb"], ["out"], nodes, [helper.make_opsetid("", OPSET)],
                                attributes=["rounds", "eps"])


__all__ = ["NAME", "hc_sinkhorn", "sinkhorn_function"]
