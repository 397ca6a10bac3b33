"""V4's routed experts as one op (docs/model.md §2.6): only the experts the router chose run.

The router stays in the model (sqrt-softplus scores, the bias for selection only, the hash layers' table, top-k
ties by lowest index, routed scaling). It hands this op its choice, `indices` [T, k] and `weights` [T, k], and the
op returns the fp32 sum over each token's k picks of weight * SwiGLU-with-clamp expert(x), from the stacked expert
weights w1, w3 [E, inter, D] and w2 [E, D, inter]. A hash layer may pick one expert twice: both picks count.

Realisations, each exact against the dense sum of every expert weighted by the dense routing matrix:
- the PyTorch reference groups tokens by expert: one [tokens, D] product per chosen expert;
- the ONNX function (the op's definition on any backend) gathers each token's k experts' weights and applies
  them; it reads only chosen experts, but holds T x k weight copies, so it suits decode and checking, not a long
  prefill: ONNX Runtime runs its own grouped MoE instead (builder/backends/onnxruntime.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from onnxscript import FLOAT, INT64, script

from .common import V4, exporting, op, symbolic

NAME = "RoutedExperts"


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """V4's SwiGLU in fp32: silu(gate clamped above at limit) * up clamped to [-limit, limit]."""
    return F.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)


def _reference(x, indices, weights, w1, w2, w3, limit):
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    k = indices.shape[1]
    picks = indices.reshape(-1)
    order = torch.argsort(picks, stable=True)                     # the picks grouped by expert
    experts, counts = torch.unique_consecutive(picks[order], return_counts=True)
    for expert, rows in zip(experts.tolist(), torch.split(order, counts.tolist())):
        tokens = rows // k
        xs = x[tokens]
        h = swiglu(xs @ w1[expert].t(), xs @ w3[expert].t(), limit) * weights.reshape(-1)[rows].unsqueeze(-1)
        out.index_add_(0, tokens, (h.to(x.dtype) @ w2[expert].t()).float())
    return out


def routed_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, w3: torch.Tensor, *, limit: float) -> torch.Tensor:
    """v4::RoutedExperts. x [T, D]; indices [T, k] int64; weights [T, k] fp32; w1, w3 [E, inter, D];
    w2 [E, D, inter] -> [T, D] fp32."""
    if exporting():
        return symbolic(NAME, [x, indices, weights, w1, w2, w3], {"limit": limit}, [torch.float32],
                        [(x.shape[0], w2.shape[1])], plugin=False)[0]
    return _reference(x, indices, weights, w1, w2, w3, limit)


@script(V4, default_opset=op)
def RoutedExperts(x: FLOAT, indices: INT64, weights: FLOAT, w1: FLOAT, w2: FLOAT, w3: FLOAT, limit: float
                  ) -> FLOAT:
    column = op.Unsqueeze(x, [1, 3])                                                       # [T, 1, D, 1]
    gate = op.Cast(op.Squeeze(op.MatMul(op.Gather(w1, indices, axis=0), column), [3]), to=FLOAT.dtype)
    up = op.Cast(op.Squeeze(op.MatMul(op.Gather(w3, indices, axis=0), column), [3]), to=FLOAT.dtype)
    bound = op.CastLike(limit, gate)
    gate = op.Min(gate, bound)
    h = gate * op.Sigmoid(gate) * op.Clip(up, op.Neg(bound), bound) * op.Unsqueeze(weights, [2])   # [T, k, inter]
    down = op.MatMul(op.Gather(w2, indices, axis=0), op.Unsqueeze(op.CastLike(h, x), [3]))      # [T, k, D, 1]
    return op.ReduceSum(op.Cast(op.Squeeze(down, [3]), to=FLOAT.dtype), [1], keepdims=0)


__all__ = ["NAME", "RoutedExperts", "routed_experts", "swiglu"]
