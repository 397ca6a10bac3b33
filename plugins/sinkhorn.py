"""mHC's Sinkhorn normalization (docs/model.md §2.2): rounds of row then column normalization of the [N, N] stream
mixing matrix, each division's denominator + eps.

Under export the rounds are one `v4::HcSinkhorn` node, and the model gets a local function holding them unrolled
(the round count is the model's, hc_sinkhorn_iters - 1, so `sinkhorn_function` is made per build). ONNX Runtime
and TensorRT inline it: the engine runs the very same nodes as before. What it saves is export time: traced, the
rounds were about half of every layer's nodes, and the export of a 43-layer model is paid per node. Not a plugin:
the node carries no plugin_namespace.
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


def sinkhorn_function(rounds: int) -> onnx.FunctionProto:
    """The op's ONNX function, unrolled for `rounds` rounds; eps is the node's attribute."""
    eps = helper.make_node("Constant", [], ["eps"])
    eps.attribute.append(onnx.AttributeProto(name="value_float", ref_attr_name="eps", type=onnx.AttributeProto.FLOAT))
    nodes = [eps, helper.make_node("Constant", [], ["rows"], value=helper.make_tensor("", TensorProto.INT64, [1], [-1])),
             helper.make_node("Constant", [], ["cols"], value=helper.make_tensor("", TensorProto.INT64, [1], [-2]))]
    value = "comb"
    for i in range(2 * rounds):
        axes, out = ("rows", "cols")[i % 2], f"c{i}"
        nodes += [helper.make_node("ReduceSum", [value, axes], [f"{out}.sum"], keepdims=1),
                  helper.make_node("Add", [f"{out}.sum", "eps"], [f"{out}.den"]),
                  helper.make_node("Div", [value, f"{out}.den"], [out])]
        value = out
    nodes.append(helper.make_node("Identity", [value], ["out"]))
    return helper.make_function(DOMAIN, NAME, ["comb"], ["out"], nodes, [helper.make_opsetid("", OPSET)],
                                attributes=["rounds", "eps"])


__all__ = ["NAME", "hc_sinkhorn", "sinkhorn_function"]
