"""Triton kernels for v4::RoutedExperts (plugins/moe.py): only the chosen experts run, tokens grouped by expert,
quantized weights dequantized inside the kernels, fp32 accumulation.

A call is four launches, one LaunchPlan each (TensorRT's argument order); what passes between them is extra
outputs, since AOT plugins get no workspace. P = T x k picks (token t's slot j is pick t*k + j).
1. group (one program): the picks counted per expert (tl.histogram), each expert's count rounded up to blocks of
   BLOCK_T picks, the experts' blocks laid out one after another: `block_expert` [MAX_BLOCKS] (each block's
   expert, -1 past the last) and `order` [MAX_BLOCKS * BLOCK_T] (each slot's pick, -1 if none). Within an expert
   the picks keep their order. MAX_BLOCKS = ceil(P / BLOCK_T) + E bounds the blocks whatever the routing.
2. up (a program per block and BLOCK_N of inter): the block's tokens' rows of x against the expert's w1 and w3
   tiles: gate and up in fp32, V4's SwiGLU with its clamp, times the pick's routing weight, cast to the
   activation dtype (the reference's order) into `hidden` [MAX_BLOCKS * BLOCK_T, inter].
3. down (a program per block and BLOCK_N of D): hidden against the expert's w2 into `picked` [P, D] fp32, the row
   of each pick.
4. sum (a program per token and BLOCK_N of D): a token's k picks added in slot order (fixed, so the result is
   deterministic); picks whose expert is out of range count nothing: a token whose picks are all masked gets 0.
Each expert's weights are read once per block of its tokens: at decode, once.

Weight formats (FORMAT): FLOAT (stored in the activation dtype), FP8 (e4m3 bytes and an fp32 scale per 128
inputs, one row per output row, as ONNX's blocked DequantizeLinear has it), MXFP4 (two e2m1 codes per byte, low
nibble first, and an E8M0 byte per 32 inputs, 2^(e-127): the checkpoint's own bytes, decoded in the kernel). FP8 and FP4 values are decoded from their bits, then scaled:
exact in fp32 and in bf16 (no FP4 or FP8 tensor cores are needed: on Hopper this is W4A16/W8A16), so the dots take
the activation dtype with fp32 accumulation (fp32 activations: an IEEE fp32 dot). Every pointer argument exists in
every format; a FLOAT call passes one-element stand-ins as scales.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import triton
import triton.language as tl

from .launch import LaunchPlan, cdiv, interpreting, launch, pointer_type

FLOAT, FP8, MXFP4 = 0, 1, 2
FORMATS = {"float": FLOAT, "fp8": FP8, "mxfp4": MXFP4}
SCALE_BLOCK = {FP8: 128, MXFP4: 32}
BLOCK_T = 16            # picks per block (the dots' M)


@triton.jit
def _picks_experts(indices, picks, P, EXPERTS: tl.constexpr):
    """Each pick's expert as int32; EXPERTS for a pick past P or whose expert is out of range."""
    e = tl.load(indices + picks, mask=picks < P, other=-1)
    return tl.where((e >= 0) & (e < EXPERTS), e, EXPERTS).to(tl.int32)


@triton.jit
def _group_kernel(indices, P, block_expert, order,
                  EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_B: tl.constexpr):
    bins = tl.arange(0, E_PAD)
    lanes = tl.arange(0, BLOCK_P)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        counts += tl.histogram(_picks_experts(indices, p0 + lanes, P, EXPERTS), E_PAD)
    counts = tl.where(bins < EXPERTS, counts, 0)
    blocks = (counts + BLOCK_T - 1) // BLOCK_T
    first = tl.cumsum(blocks, 0) - blocks                            # each expert's first block
    max_blocks = (P + BLOCK_T - 1) // BLOCK_T + EXPERTS
    for b0 in range(0, max_blocks, BLOCK_B):                         # blocks' experts; every slot empty
        ids = b0 + tl.arange(0, BLOCK_B)
        inside = (first[None, :] <= ids[:, None]) & (ids[:, None] < (first + blocks)[None, :])
        tl.store(block_expert + ids, tl.max(tl.where(inside, bins[None, :], -1), axis=1), mask=ids < max_blocks)
        slots = ids[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        tl.store(order + slots, tl.full([BLOCK_B, BLOCK_T], -1, tl.int32), mask=slots < max_blocks * BLOCK_T)
    tl.debug_barrier()
    seen = tl.zeros([E_PAD], dtype=tl.int32)                         # picks placed so far, per expert
    for p0 in range(0, P, BLOCK_P):
        picks = p0 + lanes
        e = _picks_experts(indices, picks, P, EXPERTS)
        earlier = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)                  # same-expert picks before it in this chunk
        base = tl.sum(tl.where(e[:, None] == bins[None, :], (first * BLOCK_T + seen)[None, :], 0), axis=1)
        tl.store(order + base + rank, picks, mask=e < EXPERTS)
        seen += tl.histogram(e, E_PAD)


@triton.jit
def _e2m1(code):
    """fp32 values of e2m1 codes (int32 0..15: sign bit 3, exponent bits 2-1, mantissa bit 0), built from bits."""
    m = code & 7
    bits = tl.where(m >= 2, (((m >> 1) + 126) << 23) | ((m & 1) << 22), tl.where(m == 1, 126 << 23, 0))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(byte):
    """fp32 values of e4m3 bytes (int32 0..255: sign, 4 exponent bits of bias 7, 3 mantissa bits), exactly; the
    NaN codes (exponent and mantissa all ones) give NaN."""
    exponent = (byte >> 3) & 15
    mantissa = byte & 7
    normal = ((exponent + 120) << 23 | mantissa << 20).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)        # subnormals: m * 2^-9
    value = tl.where((exponent == 15) & (mantissa == 7), float("nan"), value)
    return tl.where(byte >= 128, -value, value)


@triton.jit
def _weight_tile(w, scale, e, rows, cols, N: tl.constexpr, K: tl.constexpr, FORMAT: tl.constexpr):
    """Expert e's weight [N, K] at rows x cols, fp32 (0 outside)."""
    inside = (rows[:, None] < N) & (cols[None, :] < K)
    element = (e * N + rows[:, None]).to(tl.int64) * K + cols[None, :]
    if FORMAT == 0:
        return tl.load(w + element, mask=inside, other=0.0).to(tl.float32)
    if FORMAT == 1:
        values = _e4m3(tl.load(w + element, mask=inside, other=0).to(tl.int32))
        block = 128
    else:
        byte = tl.load(w + element // 2, mask=inside, other=0).to(tl.int32)
        values = _e2m1(tl.where(cols[None, :] % 2 == 0, byte & 15, byte >> 4))
        block = 32
    blocks = (K + block - 1) // block
    at = scale + (e * N + rows[:, None]).to(tl.int64) * blocks + cols[None, :] // block
    if FORMAT == 1:
        factor = tl.load(at, mask=inside, other=0.0)
    else:                                                          # an E8M0 byte: 2^(e-127), from its bits
        factor = tl.exp2(tl.load(at, mask=inside, other=127).to(tl.float32) - 127.0)
    return values * factor


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """a [M, K] x b [N, K]^T with fp32 accumulation; IEEE fp32 when FP32_DOT."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(b.to(a.dtype)))


@triton.jit
def _block_picks(block_expert, order, K_PICKS: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's block: (expert, slot positions, picks, whether each slot holds a pick, their tokens)."""
    b = tl.program_id(0)
    e = tl.load(block_expert + b)
    positions = b * BLOCK_T + tl.arange(0, BLOCK_T)
    picks = tl.load(order + positions)
    held = picks >= 0
    return e, positions, picks, held, tl.where(held, picks // K_PICKS, 0)


@triton.jit
def _rows(base, rows, held, cols, WIDTH: tl.constexpr):
    """[len(rows), len(cols)] of the activation base [*, WIDTH]: the held rows at cols, 0 elsewhere."""
    return tl.load(base + rows[:, None].to(tl.int64) * WIDTH + cols[None, :],
                   mask=held[:, None] & (cols[None, :] < WIDTH), other=0.0)


@triton.jit
def _up_kernel(x, weights, block_expert, order, w1, w1_scale, w3, w3_scale, hidden,
               DIM: tl.constexpr, INTER: tl.constexpr, K_PICKS: tl.constexpr, LIMIT: tl.constexpr,
               FORMAT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               FP32_DOT: tl.constexpr):
    e, positions, picks, held, tokens = _block_picks(block_expert, order, K_PICKS, BLOCK_T)
    if e >= 0:
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        gate = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, DIM, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xs = _rows(x, tokens, held, cols, DIM)
            gate += _dot(xs, _weight_tile(w1, w1_scale, e, rows, cols, INTER, DIM, FORMAT), FP32_DOT)
            up += _dot(xs, _weight_tile(w3, w3_scale, e, rows, cols, INTER, DIM, FORMAT), FP32_DOT)
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        routing = tl.load(weights + picks, mask=held, other=0.0)
        h = gate * tl.sigmoid(gate) * up * routing[:, None]
        tl.store(hidden + positions[:, None].to(tl.int64) * INTER + rows[None, :],
                 h.to(hidden.dtype.element_ty), mask=held[:, None] & (rows[None, :] < INTER))


@triton.jit
def _down_kernel(hidden, block_expert, order, w2, w2_scale, picked,
                 DIM: tl.constexpr, INTER: tl.constexpr, K_PICKS: tl.constexpr, FORMAT: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
    e, positions, picks, held, tokens = _block_picks(block_expert, order, K_PICKS, BLOCK_T)
    if e >= 0:
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            acc += _dot(_rows(hidden, positions, held, cols, INTER), _weight_tile(w2, w2_scale, e, rows, cols, DIM, INTER, FORMAT), FP32_DOT)
        tl.store(picked + picks[:, None].to(tl.int64) * DIM + rows[None, :], acc,
                 mask=held[:, None] & (rows[None, :] < DIM))


@triton.jit
def _sum_kernel(indices, picked, out, DIM: tl.constexpr, EXPERTS: tl.constexpr, K_PICKS: tl.constexpr,
                BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(K_PICKS):
        e = tl.load(indices + t * K_PICKS + j)
        counted = (e >= 0) & (e < EXPERTS)
        row = tl.load(picked + (t * K_PICKS + j) * DIM + cols, mask=cols < DIM, other=0.0)   # written or not
        acc += tl.where(counted, row, 0.0)
    tl.store(out + t * DIM + cols, acc, mask=cols < DIM)


# --------------------------------------------------------------------------- plans
def _pow2(n: int, at_least: int = 16) -> int:
    return max(triton.next_power_of_2(n), at_least)


def max_blocks(picks: Any, experts: int) -> Any:
    """The blocks of BLOCK_T picks any routing of `picks` picks over `experts` experts needs at most."""
    return cdiv(picks, BLOCK_T) + experts


def plan_routed_experts(dims: dict[str, Any], dtype: Any, *, experts: int, dim: int, inter: int, k: int,
                        limit: float, weight_format: str) -> list[LaunchPlan]:
    """RoutedExperts for T tokens (dims["T"]: an int or a shape expression) of `dtype`: group, up, down, sum."""
    fmt = FORMATS[weight_format]
    act, fp32 = pointer_type(dtype), pointer_type("float32")
    stored, scale = {FLOAT: (act, fp32), FP8: ("*u8", fp32), MXFP4: ("*u8", "*u8")}[fmt]
    T = dims["T"]
    blocks = max_blocks(T * k, experts)
    fp32_dot = act == fp32
    block_k = 32 if fp32_dot else 64
    tiles = dict(BLOCK_T=BLOCK_T, BLOCK_N=64, BLOCK_K=block_k, FP32_DOT=fp32_dot)
    group = LaunchPlan(_group_kernel, {"indices": "*i64"}, {"P": T * k},
                       {"block_expert": "*i32", "order": "*i32"},
                       dict(EXPERTS=experts, E_PAD=_pow2(experts + 1), BLOCK_T=BLOCK_T, BLOCK_P=32, BLOCK_B=16),
                       (1, 1, 1), num_warps=4, num_stages=1, name="RoutedExperts.group")
    up = LaunchPlan(_up_kernel, {"x": act, "weights": fp32, "block_expert": "*i32", "order": "*i32", "w1": stored,
                                 "w1_scale": scale, "w3": stored, "w3_scale": scale},
                    {}, {"hidden": act},
                    dict(DIM=dim, INTER=inter, K_PICKS=k, LIMIT=float(limit), FORMAT=fmt, **tiles),
                    (blocks, cdiv(inter, 64), 1), num_warps=4, num_stages=2, name="RoutedExperts.up")
    down = LaunchPlan(_down_kernel, {"hidden": act, "block_expert": "*i32", "order": "*i32", "w2": stored,
                                     "w2_scale": scale},
                      {}, {"picked": fp32}, dict(DIM=dim, INTER=inter, K_PICKS=k, FORMAT=fmt, **tiles),
                      (blocks, cdiv(dim, 64), 1), num_warps=4, num_stages=2, name="RoutedExperts.down")
    total = LaunchPlan(_sum_kernel, {"indices": "*i64", "picked": fp32}, {}, {"out": fp32},
                       dict(DIM=dim, EXPERTS=experts, K_PICKS=k, BLOCK_N=128),
                       (T, cdiv(dim, 128), 1), num_warps=4, num_stages=1, name="RoutedExperts.sum")
    return [group, up, down, total]


# --------------------------------------------------------------------------- torch launcher
def routed_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                   w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, *, limit: float,
                   scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   weight_format: str = "float") -> torch.Tensor:
    """v4::RoutedExperts on torch tensors: x [T, D]; indices [T, k] int64; weights [T, k] fp32; w1, w3 [E, inter,
    D] and w2 [E, D, inter] as stored (FLOAT: x's dtype; fp8: e4m3 as uint8; mxfp4: packed uint8 [.., in/2]) with
    their scales (w1, w2, w3 order: fp8 fp32, mxfp4 E8M0 bytes) -> [T, D] fp32."""
    T, D = x.shape
    k = indices.shape[1]
    experts, inter = w1.shape[0], w1.shape[1]
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    if scales is None:
        scales = (torch.ones(1, dtype=torch.float32, device=x.device),) * 3
    plans = plan_routed_experts({"T": T}, x.dtype, experts=experts, dim=D, inter=inter, k=k, limit=limit,
                                weight_format=weight_format)
    if interpreting():     # the interpreter's 16-bit dot is wrong: dot in fp32 there (the plans describe the GPU)
        plans = [replace(plan, constexprs={**plan.constexprs, "FP32_DOT": True}) if "FP32_DOT" in plan.constexprs
                 else plan for plan in plans]
    blocks = max_blocks(T * k, experts)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=x.device)
    order = torch.empty(blocks * BLOCK_T, dtype=torch.int32, device=x.device)
    hidden = torch.empty(blocks * BLOCK_T, inter, dtype=x.dtype, device=x.device)
    picked = torch.empty(T * k, D, dtype=torch.float32, device=x.device)
    indices, weights = indices.contiguous(), weights.float().contiguous()
    w1, w2, w3 = (w.contiguous().view(torch.uint8) if weight_format != "float" else w.contiguous()
                  for w in (w1, w2, w3))
    if weight_format == "mxfp4":
        scales = tuple(s.contiguous().view(torch.uint8) for s in scales)
    group, up, down, total = plans
    launch(group, [indices], [block_expert, order])
    launch(up, [x.contiguous(), weights, block_expert, order, w1, scales[0], w3, scales[2]], [hidden])
    launch(down, [hidden, block_expert, order, w2, scales[1]], [picked])
    launch(total, [indices, picked], [out])
    return out


def fp8_routed_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                       w1_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w3: torch.Tensor,
                       w3_scale: torch.Tensor, *, limit: float) -> torch.Tensor:
    """v4::Fp8RoutedExperts (plugins/moe.py) on torch tensors: routed_experts with e4m3 bytes and their scales."""
    return routed_experts(x, indices, weights, w1, w2, w3, limit=limit, scales=(w1_scale, w2_scale, w3_scale),
                          weight_format="fp8")


def mxfp4_routed_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                         w1_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w3: torch.Tensor,
                         w3_scale: torch.Tensor, *, limit: float) -> torch.Tensor:
    """v4::Mxfp4RoutedExperts (plugins/moe.py) on torch tensors: routed_experts with packed e2m1 bytes and their
    E8M0 scale bytes."""
    return routed_experts(x, indices, weights, w1, w2, w3, limit=limit, scales=(w1_scale, w2_scale, w3_scale),
                          weight_format="mxfp4")


__all__ = ["FORMATS", "BLOCK_T", "max_blocks", "plan_routed_experts", "routed_experts", "fp8_routed_experts",
           "mxfp4_routed_experts"]
