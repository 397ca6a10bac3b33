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

Two more ops take the experts as stored, for kernels that dequantize inside (the TensorRT plugins run
plugins/kernels/moe.py): `Fp8RoutedExperts` (e4m3 bytes and fp32 scales per 128 inputs, a row each) and
`Mxfp4RoutedExperts` (two e2m1 codes per byte, low nibble first, and fp32 scales per 32 inputs). Their bytes are
int8 tensors (TensorRT has no uint8 weights) read as unsigned. The export never makes them: the TensorRT and
MIGraphX preparations rewrite RoutedExperts into one when the build kept the experts as stored bytes. Their functions decode
the gathered bytes arithmetically (opset 23 has no bit cast), exactly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from onnxscript import FLOAT, INT8, INT32, INT64, script

from .common import V4, exporting, op, symbolic

NAME = "RoutedExperts"
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)      # the e2m1 magnitudes of codes 0..7 (8..15: negated)
FP8_BLOCK, MXFP4_BLOCK = 128, 32                            # inputs per scale
NAN = float("nan")


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """V4's SwiGLU in fp32: silu(gate clamped above at limit) * up clamped to [-limit, limit]."""
    return F.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)


def decode_fp8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes [..., n] (int8 or uint8) and fp32 scales [..., ceil(n/128)] -> fp32 [..., n]."""
    values = data.view(torch.uint8).view(torch.float8_e4m3fn).float()
    return values * scale.repeat_interleave(FP8_BLOCK, -1)[..., :values.shape[-1]]


def e8m0_scales(data: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (int8 or uint8) as their fp32 scales 2^(e-127) (e = 255, E8M0's NaN, gives inf; e = 0 the
    subnormal 2^-127), as the graphs and kernels compute them."""
    return torch.exp2(data.view(torch.uint8).float() - 127)


def decode_mxfp4(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 bytes [..., n/2] (int8 or uint8, low nibble first) and fp32 scales [..., n/32] -> fp32 [..., n]."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=data.device)
    codes = data.view(torch.uint8).long()
    values = table[torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)]
    return values * scale.repeat_interleave(MXFP4_BLOCK, -1)


def _reference(x, indices, weights, expert, d_out, limit):
    """expert(e) -> (w1, w2, w3) of expert e in x's dtype; d_out: the output width."""
    out = torch.zeros(x.shape[0], d_out, dtype=torch.float32, device=x.device)
    k = indices.shape[1]
    picks = indices.reshape(-1)
    order = torch.argsort(picks, stable=True)                     # the picks grouped by expert
    experts, counts = torch.unique_consecutive(picks[order], return_counts=True)
    for e, rows in zip(experts.tolist(), torch.split(order, counts.tolist())):
        w1, w2, w3 = expert(e)
        tokens = rows // k
        xs = x[tokens]
        h = swiglu(xs @ w1.t(), xs @ w3.t(), limit) * weights.reshape(-1)[rows].unsqueeze(-1)
        out.index_add_(0, tokens, (h.to(x.dtype) @ w2.t()).float())
    return out


def routed_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, w3: torch.Tensor, *, limit: float) -> torch.Tensor:
    """v4::RoutedExperts. x [T, D]; indices [T, k] int64; weights [T, k] fp32; w1, w3 [E, inter, D];
    w2 [E, D, inter] -> [T, D] fp32."""
    if exporting():
        return symbolic(NAME, [x, indices, weights, w1, w2, w3], {"limit": limit}, [torch.float32],
                        [(x.shape[0], w2.shape[1])], plugin=False)[0]
    return _reference(x, indices, weights, lambda e: (w1[e], w2[e], w3[e]), w2.shape[1], limit)


def _quantized(decode, x, indices, weights, w1, w1_scale, w2, w2_scale, w3, w3_scale, limit):
    def expert(e: int) -> tuple[torch.Tensor, ...]:
        return tuple(decode(w[e], s[e]).to(x.dtype) for w, s in ((w1, w1_scale), (w2, w2_scale), (w3, w3_scale)))
    return _reference(x, indices, weights, expert, w2.shape[1], limit)


def fp8_routed_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                       w1_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w3: torch.Tensor,
                       w3_scale: torch.Tensor, *, limit: float) -> torch.Tensor:
    """v4::Fp8RoutedExperts: RoutedExperts with e4m3 experts, w1, w3 [E, inter, D] and w2 [E, D, inter] int8
    bytes, their fp32 scales [E, rows, ceil(cols/128)]."""
    return _quantized(decode_fp8, x, indices, weights, w1, w1_scale, w2, w2_scale, w3, w3_scale, limit)


def mxfp4_routed_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                         w1_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w3: torch.Tensor,
                         w3_scale: torch.Tensor, *, limit: float) -> torch.Tensor:
    """v4::Mxfp4RoutedExperts: RoutedExperts with MXFP4 experts, w1, w3 [E, inter, D/2] and w2 [E, D, inter/2]
    packed int8 bytes, their E8M0 scale bytes [E, rows, cols/32] (int8: 2^(e-127), as stored)."""
    return _quantized(lambda w, s: decode_mxfp4(w, e8m0_scales(s)), x, indices, weights, w1, w1_scale, w2, w2_scale,
                      w3, w3_scale, limit)


# --------------------------------------------------------------------------- ONNX functions (standard ops)
@script(V4, default_opset=op)
def ApplyExperts(x: FLOAT, weights: FLOAT, g1: FLOAT, g2: FLOAT, g3: FLOAT, limit: float) -> FLOAT:
    """Each token's k gathered experts (g1, g3 [T, k, inter, D], g2 [T, k, D, inter], x's dtype) on x [T, D]."""
    column = op.Unsqueeze(x, [1, 3])                                                       # [T, 1, D, 1]
    gate = op.Cast(op.Squeeze(op.MatMul(g1, column), [3]), to=FLOAT.dtype)
    up = op.Cast(op.Squeeze(op.MatMul(g3, column), [3]), to=FLOAT.dtype)
    bound = op.CastLike(limit, gate)
    gate = op.Min(gate, bound)
    h = gate * op.Sigmoid(gate) * op.Clip(up, op.Neg(bound), bound) * op.Unsqueeze(weights, [2])   # [T, k, inter]
    down = op.MatMul(g2, op.Unsqueeze(op.CastLike(h, x), [3]))                                  # [T, k, D, 1]
    return op.ReduceSum(op.Cast(op.Squeeze(down, [3]), to=FLOAT.dtype), [1], keepdims=0)


@script(V4, default_opset=op)
def RoutedExperts(x: FLOAT, indices: INT64, weights: FLOAT, w1: FLOAT, w2: FLOAT, w3: FLOAT, limit: float
                  ) -> FLOAT:
    return ApplyExperts(x, weights, op.Gather(w1, indices, axis=0), op.Gather(w2, indices, axis=0),
                        op.Gather(w3, indices, axis=0), limit=limit)


@script(V4, default_opset=op)
def UnsignedBytes(data: INT8) -> INT32:
    """int8 bytes as their unsigned values 0..255."""
    wide = op.Cast(data, to=INT32.dtype)
    return op.Mod(wide + op.CastLike(256, wide), op.CastLike(256, wide))


@script(V4, default_opset=op)
def ScaledBlocks(values: FLOAT, scale: FLOAT, like: FLOAT, block: int) -> FLOAT:
    """values [..., n] times scale [..., ceil(n/block)], each scale repeated over its block; cast like `like`."""
    repeated = op.Expand(op.Unsqueeze(scale, [-1]), op.Concat(op.Shape(scale), op.Reshape(block, [1]), axis=0))
    flat = op.Reshape(repeated, op.Concat(op.Shape(values, end=-1), op.Constant(value_ints=[-1]), axis=0))
    factors = op.Slice(flat, op.Constant(value_ints=[0]), op.Shape(values, start=-1), op.Constant(value_ints=[-1]))
    return op.CastLike(values * factors, like)


@script(V4, default_opset=op)
def DecodeFp8(data: INT8, scale: FLOAT, like: FLOAT) -> FLOAT:
    """e4m3 bytes [..., n] with their scales [..., ceil(n/128)], in like's dtype: sign, 4 exponent bits (bias
    7), 3 mantissa bits; exponent 0 is subnormal (m * 2^-9), exponent 15 with mantissa 7 is NaN."""
    byte = UnsignedBytes(data)
    magnitude = op.Mod(byte, op.CastLike(128, byte))
    exponent = op.Cast(op.Div(magnitude, op.CastLike(8, byte)), to=FLOAT.dtype)
    mantissa = op.Cast(op.Mod(magnitude, op.CastLike(8, byte)), to=FLOAT.dtype)
    eighth = op.CastLike(0.125, mantissa)
    normal = (op.CastLike(1.0, mantissa) + mantissa * eighth) * op.Pow(op.CastLike(2.0, exponent),
                                                                       exponent - op.CastLike(7.0, exponent))
    subnormal = mantissa * op.CastLike(0.001953125, mantissa)
    value = op.Where(op.Equal(exponent, op.CastLike(0.0, exponent)), subnormal, normal)
    value = op.Where(op.Equal(magnitude, op.CastLike(127, byte)), op.CastLike(NAN, value), value)
    sign = op.Where(op.GreaterOrEqual(byte, op.CastLike(128, byte)), op.CastLike(-1.0, value), op.CastLike(1.0, value))
    value = value * sign                                           # 0x80 is -0.0 (a Where of Neg(0) drops the sign)
    return ScaledBlocks(value, scale, like, block=128)


@script(V4, default_opset=op)
def DecodeMxfp4(data: INT8, e8m0: INT8, like: FLOAT) -> FLOAT:
    """Packed e2m1 bytes [..., n/2] (low nibble first) with their E8M0 scale bytes [..., n/32] (2^(e-127)), in
    like's dtype."""
    exponent = op.Cast(UnsignedBytes(e8m0), to=FLOAT.dtype) - op.Constant(value_float=127.0)
    scale = op.Pow(op.Constant(value_float=2.0), exponent)
    byte = UnsignedBytes(data)
    sixteen = op.CastLike(16, byte)
    codes = op.Concat(op.Unsqueeze(op.Mod(byte, sixteen), [-1]), op.Unsqueeze(op.Div(byte, sixteen), [-1]),
                      axis=-1)                                                                 # [..., n/2, 2]
    table = op.Constant(value_floats=[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                      -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    values = op.Gather(table, codes, axis=0)
    unpacked = op.Concat(op.Shape(data, end=-1), op.Constant(value_ints=[-1]), axis=0)
    return ScaledBlocks(op.Reshape(values, unpacked), scale, like, block=32)


@script(V4, default_opset=op)
def Fp8RoutedExperts(x: FLOAT, indices: INT64, weights: FLOAT, w1: INT8, w1_scale: FLOAT, w2: INT8,
                     w2_scale: FLOAT, w3: INT8, w3_scale: FLOAT, limit: float) -> FLOAT:
    g1 = DecodeFp8(op.Gather(w1, indices, axis=0), op.Gather(w1_scale, indices, axis=0), x)
    g2 = DecodeFp8(op.Gather(w2, indices, axis=0), op.Gather(w2_scale, indices, axis=0), x)
    g3 = DecodeFp8(op.Gather(w3, indices, axis=0), op.Gather(w3_scale, indices, axis=0), x)
    return ApplyExperts(x, weights, g1, g2, g3, limit=limit)


@script(V4, default_opset=op)
def Mxfp4RoutedExperts(x: FLOAT, indices: INT64, weights: FLOAT, w1: INT8, w1_scale: INT8, w2: INT8,
                       w2_scale: INT8, w3: INT8, w3_scale: INT8, limit: float) -> FLOAT:
    g1 = DecodeMxfp4(op.Gather(w1, indices, axis=0), op.Gather(w1_scale, indices, axis=0), x)
    g2 = DecodeMxfp4(op.Gather(w2, indices, axis=0), op.Gather(w2_scale, indices, axis=0), x)
    g3 = DecodeMxfp4(op.Gather(w3, indices, axis=0), op.Gather(w3_scale, indices, axis=0), x)
    return ApplyExperts(x, weights, g1, g2, g3, limit=limit)


QUANTIZED_FUNCTIONS = {"fp8": Fp8RoutedExperts, "mxfp4": Mxfp4RoutedExperts}   # by weight format
PLUGIN_FUNCTIONS = (RoutedExperts, Fp8RoutedExperts, Mxfp4RoutedExperts)
HELPER_FUNCTIONS = (ApplyExperts, UnsignedBytes, ScaledBlocks, DecodeFp8, DecodeMxfp4)

__all__ = ["NAME", "E2M1_VALUES", "FP8_BLOCK", "MXFP4_BLOCK", "RoutedExperts", "routed_experts",
           "fp8_routed_experts", "mxfp4_routed_experts", "decode_fp8", "decode_mxfp4", "e8m0_scales", "swiglu",
           "QUANTIZED_FUNCTIONS", "PLUGIN_FUNCTIONS", "HELPER_FUNCTIONS"]
