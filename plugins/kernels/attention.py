"""Triton kernels for v4::SlidingAttention, v4::HcaAttention and v4::CsaAttention (docs/model.md §2.3-2.8).

The semantics are those of the PyTorch references in `plugins/attention.py`: every query attends, with one
softmax, to the window keys it can see plus (HCA) every compressed row already closed or (CSA) the rows
the indexer picked for it; a per-head sink adds one logit to the softmax denominator only. MQA: a single
key head, K = V, shared by all H query heads.

Design
------
One core (`_attend`) serves the three ops; three thin entry kernels only give each op its own argument
list in TensorRT's order (inputs, int32 shape scalars S, T, H [, R [, k]], output). A program handles one
query (b, s) and a block of BLOCK_H heads. All heads share the key head, so every key tile is loaded once
per head block and used twice: scores = Q·Kᵀ ([BLOCK_H, BLOCK_N], one tl.dot over the whole head) and
acc += P·K ([BLOCK_H, d], a second tl.dot with K as V). BLOCK_H = 16 is the smallest tl.dot M and gives
the most programs; at d = 512 the accumulator is [16, 512] fp32, 64 registers a thread at 4 warps.
ptxas (sm_90a, bf16, d = 512, BLOCK_N = 32) reports 207-221 registers, no spills, 50 KiB of shared
memory: two programs per SM. Key tiles arrive through cp.async in 16-byte pieces (see `_row_tile`).

The keys come in two sections, each walked in tiles of BLOCK_N: the window (kv, visibility from kv_pos)
and the rows (HCA: rows, visibility from row_ids; CSA: rows gathered through the query's topk_idx).
Each section is first scanned for the first and last key the query sees (a few KiB of int64 ids); the
walk is then an unconditional loop over that span, which Triton software-pipelines, and a prefill
query touches only its own window (T = 127 + S keys, about 128 of them visible) instead of all T keys.
Invisible keys inside the span are masked off the load (no memory traffic) and scored -inf.

Online softmax in base 2 that starts from the sink: the running max starts at sink·log2(e), the running
sum at 1 (the sink's own term) and the accumulator at 0 (the sink has no value). The max is therefore
always finite, a tile with no visible key changes nothing, and a query that sees nothing ends with
acc = 0: output 0, all the weight on the sink, exactly like the reference.

Filling the GPU
---------------
The grid is (B·S, H / BLOCK_H, splits); at V4-Flash sizes (H = 64) that is 4 programs per query.
Prefill (B·S in the thousands) and batched decode fill the 132 SMs of an H200: decode at B = 64, S = 1
is 256 programs, each streaming its query's 640 keys (128 window + 512 HCA rows or CSA picks, 640 KiB
of bf16), once from HBM and 3 more times from L2 for the other head blocks. Small-batch decode does not
(B = 1: 4 programs), and only splitting the keys helps there, since each program must read all of its
query's keys. With splits = P > 1 the visible span is cut into P contiguous tile ranges, each program
writes an unnormalized partial (acc, running max, running sum; split 0 alone counts the sink) to an fp32
buffer, and `combine_kernel` rescales and adds the P partials (flash-decoding). That takes a second
kernel and a temporary buffer, which a TensorRT AOT plugin (one PTX kernel, no workspace) cannot have:
the AOT plugin uses splits = 1. The torch launchers, which can allocate, split when B·S is small: up to
one program per SM and at most one split per key tile (B = 1 HCA or CSA decode: 20 splits, 80 programs).

Dtypes: q, kv and rows are fp32, fp16 or bf16 (all alike); scores, softmax and the accumulator are fp32;
P is rounded to the key dtype for the P·K product (the usual flash-attention choice). fp32 inputs use
an IEEE fp32 tl.dot. Under TRITON_INTERPRET=1 every tl.dot runs in fp32 because the interpreter's bf16
tl.dot returns garbage; the operands are still rounded to the input dtype first, so the numerics match
the GPU path up to summation order.

Index arithmetic that can exceed 2^31 (batch and query offsets, CSA row gathers at 1M context) is int64.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import triton
import triton.language as tl

from .launch import LaunchPlan, cdiv, interpreting, launch, pointer_type
from .paging import paged_row_tile

LOG2E = tl.constexpr(1.4426950408889634)

# Which keys a section holds, and so how visibility is decided (a constexpr switch of the core).
WINDOW_KEYS = tl.constexpr(0)   # kv with kv_pos: visible iff t - window < pos <= t and pos >= 0
CLOSED_ROWS = tl.constexpr(1)   # HCA rows with row_ids: visible iff 0 <= id < (t + 1) // ratio
PICKED_ROWS = tl.constexpr(2)   # CSA rows gathered through topk_idx: visible iff idx >= 0
NO_ROWS = tl.constexpr(3)       # SlidingAttention: the window only

BLOCK_H = 16                    # heads per program (the M of both tl.dots; 16 is tl.dot's minimum)
SCAN = tl.constexpr(256)        # ids read per step of the visible-span scan
MAX_SPLITS = 32                 # most key splits a launcher picks


# --------------------------------------------------------------------------- device helpers
@triton.jit
def _visible(ids, t, KIND: tl.constexpr, WINDOW: tl.constexpr, RATIO: tl.constexpr):
    """Which keys of a section the query at position t sees (ids: positions, row ids or picks; -1 = none)."""
    if KIND == WINDOW_KEYS:
        seen = (ids <= t) & (ids > t - WINDOW) & (ids >= 0)
    elif KIND == CLOSED_ROWS:
        # the GPU's // truncates where Python's floors; they differ only for t + 1 < 0, where no row is seen
        seen = (ids >= 0) & (ids < (t + 1) // RATIO)
    else:
        seen = ids >= 0
    return seen


@triton.jit
def _dot(a, b, IN_FP32: tl.constexpr):
    """a @ b with an fp32 accumulator; IN_FP32: exact fp32 products (fp32 inputs, and the interpreter)."""
    if IN_FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _row_tile(base, rows, dims, HEAD_DIM: tl.constexpr):
    """Pointers [rows, dims] into a row-major [*, HEAD_DIM] tensor, each row promised to start on 16 bytes.

    The promise turns loads and stores into 128-bit vectors; an AOT compile knows nothing about pointer
    alignment by itself. It holds when a row is a multiple of 16 bytes, since TensorRT and the launchers
    below pass 16-byte-aligned tensors. (The hint must be set here, on the address arithmetic: set on a
    function argument it is silently dropped.)
    """
    ptrs = base + rows[:, None] * HEAD_DIM + dims[None, :]
    if (HEAD_DIM * base.dtype.element_ty.primitive_bitwidth) % 128 == 0:
        ptrs = tl.multiple_of(ptrs, [16, 16])
    return ptrs


@triton.jit
def _visible_span(ids_ptr, n, t, KIND: tl.constexpr, WINDOW: tl.constexpr, RATIO: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """[first, end) in tiles of BLOCK_N: the smallest tile range holding every key of the section t sees."""
    first = tl.full([], 0, tl.int32) + n
    last = tl.full([], -1, tl.int32)
    for start in range(0, n, SCAN):
        idx = start + tl.arange(0, SCAN)
        ids = tl.load(ids_ptr + idx, mask=idx < n, other=-1)
        seen = _visible(ids, t, KIND, WINDOW, RATIO) & (idx < n)
        first = tl.minimum(first, tl.min(tl.where(seen, idx, n), axis=0))
        last = tl.maximum(last, tl.max(tl.where(seen, idx, -1), axis=0))
    first_tile = first // BLOCK_N
    return first_tile, tl.maximum((last + BLOCK_N) // BLOCK_N, first_tile)


@triton.jit
def _attend_tiles(acc, m, l, q, t, ids_ptr, keys_ptr, table_ptr, new_ptr, past, n, tile_lo, tile_hi, dims,
                  KIND: tl.constexpr, WINDOW: tl.constexpr, RATIO: tl.constexpr, QK_SCALE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                  PAGE_ROWS: tl.constexpr):
    """Online-softmax update of (acc, m, l) with the key tiles [tile_lo, tile_hi) of one section; PAGE_ROWS > 0:
    keys_ptr is a block pool read through table_ptr for the first `past` rows, then new_ptr's rows
    (plugins/kernels/paging.py)."""
    for tile in range(tile_lo, tile_hi):
        idx = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ids = tl.load(ids_ptr + idx, mask=idx < n, other=-1)
        seen = _visible(ids, t, KIND, WINDOW, RATIO) & (idx < n)
        if KIND == PICKED_ROWS:
            key_rows = tl.maximum(ids, 0)                  # int64: the gather can pass 2^31 elements
        else:
            key_rows = idx
        if PAGE_ROWS > 0:
            tile = paged_row_tile(keys_ptr, table_ptr, new_ptr, key_rows, seen, past, dims, PAGE_ROWS, HEAD_DIM)
        else:
            tile = _row_tile(keys_ptr, key_rows, dims, HEAD_DIM)
        keys = tl.load(tile, mask=seen[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
        scores = _dot(q, tl.trans(keys), DOT_IN_FP32) * QK_SCALE            # [BLOCK_H, BLOCK_N], base 2
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(keys.dtype), keys, DOT_IN_FP32)
        m = m_new
    return acc, m, l


@triton.jit
def _attend(q_ptr, q_pos_ptr, kv_ptr, kv_pos_ptr, rows_ptr, table_ptr, new_ptr, ids_ptr, sink_ptr, S, T, H, R,
            TABLE_W, NEW, NUM_IDS, out_ptr, ROWS: tl.constexpr, WINDOW: tl.constexpr, RATIO: tl.constexpr,
            SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, DOT_IN_FP32: tl.constexpr, PAGE_ROWS: tl.constexpr):
    """Program (query b·S+s, head block, split): BLOCK_H heads of one query over its share of the keys.

    ROWS: NO_ROWS, CLOSED_ROWS (ids = row_ids [B,R], NUM_IDS = R) or PICKED_ROWS (ids = topk_idx [B,S,k],
    NUM_IDS = k). PAGE_ROWS = 0: rows are [B,R,d]; > 0: a block pool [blocks, PAGE_ROWS, d] read through the
    block table [B, TABLE_W], then NEW rows [B, NEW, d] (plugins/kernels/paging.py). SPLITS = 1: out is the output [B,S,H,d]; otherwise the fp32 partials
    [B,S,H,SPLITS,d+2] (accumulator, running max, running sum).
    """
    query = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    b = query // S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < H
    tile_mask = head_ok[:, None] & (dims[None, :] < HEAD_DIM)
    q = tl.load(_row_tile(q_ptr + query * H * HEAD_DIM, heads, dims, HEAD_DIM), mask=tile_mask, other=0.0)
    t = tl.load(q_pos_ptr + query)

    # the visible span of each section, in tiles, and this split's share of the two spans end to end
    win_lo, win_hi = _visible_span(kv_pos_ptr + b * T, T, t, WINDOW_KEYS, WINDOW, RATIO, BLOCK_N)
    if ROWS == NO_ROWS:
        rows_lo, rows_hi = 0, 0
    else:
        if ROWS == PICKED_ROWS:
            ids_ptr += query * NUM_IDS
        else:
            ids_ptr += b * NUM_IDS
        rows_lo, rows_hi = _visible_span(ids_ptr, NUM_IDS, t, ROWS, WINDOW, RATIO, BLOCK_N)
    win_tiles = win_hi - win_lo
    total = win_tiles + rows_hi - rows_lo
    share = (total + SPLITS - 1) // SPLITS
    lo = tl.minimum(split * share, total)
    hi = tl.minimum(lo + share, total)

    # online softmax in base 2 that starts from the sink: max = sink, sum = 1 (split 0 only), acc = 0
    m = tl.load(sink_ptr + heads, mask=head_ok, other=0.0) * LOG2E
    l = tl.zeros([BLOCK_H], tl.float32) + (split == 0).to(tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    acc, m, l = _attend_tiles(acc, m, l, q, t, kv_pos_ptr + b * T, kv_ptr + b * T * HEAD_DIM, table_ptr, new_ptr,
                              0, T, win_lo + tl.minimum(lo, win_tiles), win_lo + tl.minimum(hi, win_tiles), dims,
                              WINDOW_KEYS, WINDOW, RATIO, SCALE * LOG2E, HEAD_DIM, BLOCK_N, DOT_IN_FP32, 0)
    if ROWS != NO_ROWS:
        if PAGE_ROWS > 0:
            table_ptr += b * TABLE_W
            new_ptr += b * NEW * HEAD_DIM
        else:
            rows_ptr += b * R * HEAD_DIM
        acc, m, l = _attend_tiles(acc, m, l, q, t, ids_ptr, rows_ptr, table_ptr, new_ptr, TABLE_W * PAGE_ROWS,
                                  NUM_IDS,
                                  rows_lo + tl.maximum(lo - win_tiles, 0), rows_lo + tl.maximum(hi - win_tiles, 0),
                                  dims, ROWS, WINDOW, RATIO, SCALE * LOG2E, HEAD_DIM, BLOCK_N, DOT_IN_FP32,
                                  PAGE_ROWS)

    if SPLITS == 1:
        tl.store(_row_tile(out_ptr + query * H * HEAD_DIM, heads, dims, HEAD_DIM),
                 (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=tile_mask)
    else:
        part = out_ptr + ((query * H + heads) * SPLITS + split) * (HEAD_DIM + 2)       # [BLOCK_H] row starts
        tl.store(part[:, None] + dims[None, :], acc, mask=tile_mask)
        tl.store(part + HEAD_DIM, m, mask=head_ok)
        tl.store(part + HEAD_DIM + 1, l, mask=head_ok)


# --------------------------------------------------------------------------- kernels (TensorRT argument order)
# The shape scalars are never specialized, so that a JIT launch compiles the very code TensorRT runs
# (it would otherwise make S = 1 a constant and assume what it sees of their divisibility by 16).


@triton.jit(do_not_specialize=["S", "T", "H"])
def sliding_attention_kernel(q, q_pos, kv, kv_pos, sink, S, T, H, out,
                             WINDOW: tl.constexpr, SCALE: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             SPLITS: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    _attend(q, q_pos, kv, kv_pos, kv, kv_pos, kv, kv_pos, sink, S, T, H, 0, 0, 0, 0, out, NO_ROWS, WINDOW, 1, SCALE,
            HEAD_DIM, BLOCK_H, BLOCK_N, BLOCK_D, SPLITS, DOT_IN_FP32, 0)


@triton.jit(do_not_specialize=["S", "T", "H", "R"])
def hca_attention_kernel(q, q_pos, kv, kv_pos, rows, row_ids, sink, S, T, H, R, out,
                         WINDOW: tl.constexpr, RATIO: tl.constexpr, SCALE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         SPLITS: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    _attend(q, q_pos, kv, kv_pos, rows, row_ids, rows, row_ids, sink, S, T, H, R, 0, 0, R, out, CLOSED_ROWS, WINDOW,
            RATIO, SCALE, HEAD_DIM, BLOCK_H, BLOCK_N, BLOCK_D, SPLITS, DOT_IN_FP32, 0)


@triton.jit(do_not_specialize=["S", "T", "H", "R", "k"])
def csa_attention_kernel(q, q_pos, kv, kv_pos, rows, topk_idx, sink, S, T, H, R, k, out,
                         WINDOW: tl.constexpr, SCALE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         SPLITS: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    _attend(q, q_pos, kv, kv_pos, rows, topk_idx, rows, topk_idx, sink, S, T, H, R, 0, 0, k, out, PICKED_ROWS,
            WINDOW, 1, SCALE, HEAD_DIM, BLOCK_H, BLOCK_N, BLOCK_D, SPLITS, DOT_IN_FP32, 0)


@triton.jit(do_not_specialize=["S", "T", "H", "R", "W", "N"])
def hca_attention_paged_kernel(q, q_pos, kv, kv_pos, pool, block_table, new_rows, row_ids, sink, S, T, H, R, W, N,
                               out, WINDOW: tl.constexpr, RATIO: tl.constexpr, SCALE: tl.constexpr,
                               HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                               PAGE_ROWS: tl.constexpr):
    _attend(q, q_pos, kv, kv_pos, pool, block_table, new_rows, row_ids, sink, S, T, H, R, W, N, R, out, CLOSED_ROWS,
            WINDOW, RATIO, SCALE, HEAD_DIM, BLOCK_H, BLOCK_N, BLOCK_D, SPLITS, DOT_IN_FP32, PAGE_ROWS)


@triton.jit(do_not_specialize=["S", "T", "H", "W", "N", "k"])
def csa_attention_paged_kernel(q, q_pos, kv, kv_pos, pool, block_table, new_rows, topk_idx, sink, S, T, H, W, N, k,
                               out, WINDOW: tl.constexpr, SCALE: tl.constexpr, HEAD_DIM: tl.constexpr,
                               BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               SPLITS: tl.constexpr, DOT_IN_FP32: tl.constexpr, PAGE_ROWS: tl.constexpr):
    _attend(q, q_pos, kv, kv_pos, pool, block_table, new_rows, topk_idx, sink, S, T, H, 0, W, N, k, out,
            PICKED_ROWS, WINDOW, 1, SCALE, HEAD_DIM, BLOCK_H, BLOCK_N, BLOCK_D, SPLITS, DOT_IN_FP32, PAGE_ROWS)


@triton.jit
def combine_kernel(part, out, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """Program (b·S+s)·H+h: merge the SPLITS partials of one (query, head) into its output row."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_P)
    dims = tl.arange(0, BLOCK_D)
    starts = (row * SPLITS + splits) * (HEAD_DIM + 2)
    used = splits < SPLITS
    m = tl.load(part + starts + HEAD_DIM, mask=used, other=float("-inf"))
    l = tl.load(part + starts + HEAD_DIM + 1, mask=used, other=0.0)
    acc = tl.load(part + starts[:, None] + dims[None, :], mask=used[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))
    o = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out + row * HEAD_DIM + dims, o.to(out.dtype.element_ty), mask=dims < HEAD_DIM)


# --------------------------------------------------------------------------- launch plans
def _plans(kernel, name: str, inputs: dict[str, str], scalars: dict[str, Any], dims: Mapping[str, Any], dtype: Any,
           attrs: dict[str, Any], splits: int) -> list[LaunchPlan]:
    """[attention plan], or with splits > 1 [attention plan, combine plan]: the attention plan's 'out' is
    then an fp32 buffer [B,S,H,splits,d+2] of partials that the combine plan reads as 'part'."""
    d = int(dims["d"])
    B, S, H = dims["B"], dims["S"], dims["H"]
    fp32 = pointer_type("float32")
    constexprs = dict(attrs, HEAD_DIM=d, BLOCK_H=BLOCK_H, BLOCK_N=_block_n(dtype),
                      BLOCK_D=max(16, triton.next_power_of_2(d)), SPLITS=splits,
                      DOT_IN_FP32=pointer_type(dtype) == fp32 or interpreting())
    outputs = {"out": pointer_type(dtype) if splits == 1 else fp32}        # the output, or the partials
    attend = LaunchPlan(kernel, inputs, scalars, outputs, constexprs, (B * S, cdiv(H, BLOCK_H), splits),
                        num_warps=4, num_stages=2, name=name)
    if splits == 1:
        return [attend]
    combine = LaunchPlan(combine_kernel, {"part": fp32}, {}, {"out": pointer_type(dtype)},
                         dict(SPLITS=splits, HEAD_DIM=d, BLOCK_P=triton.next_power_of_2(splits),
                              BLOCK_D=constexprs["BLOCK_D"]),
                         (B * S * H, 1, 1), num_warps=4, num_stages=1, name=f"{name}.combine")
    return [attend, combine]


def _block_n(dtype: Any) -> int:
    """Keys per tile: a 32 KiB tile at d = 512 in 16-bit types (16 keys of fp32)."""
    return 16 if pointer_type(dtype) == pointer_type("float32") else 32


def _window_inputs(dtype: Any) -> dict[str, str]:
    act = pointer_type(dtype)
    return {"q": act, "q_pos": "*i64", "kv": act, "kv_pos": "*i64"}


def plan_sliding_attention(dims: Mapping[str, Any], dtype: Any, *, window: int, scale: float,
                           splits: int = 1) -> list[LaunchPlan]:
    """SlidingAttention. dims: B, S, H, d, T (d an int; the rest ints or shape expressions)."""
    inputs = _window_inputs(dtype) | {"sink": "*fp32"}
    scalars = {n: dims[n] for n in ("S", "T", "H")}
    return _plans(sliding_attention_kernel, "SlidingAttention", inputs, scalars, dims, dtype,
                  dict(WINDOW=window, SCALE=scale), splits)


def plan_hca_attention(dims: Mapping[str, Any], dtype: Any, *, window: int, ratio: int, scale: float,
                       splits: int = 1) -> list[LaunchPlan]:
    """HcaAttention. dims: B, S, H, d, T, R."""
    inputs = _window_inputs(dtype) | {"rows": pointer_type(dtype), "row_ids": "*i64", "sink": "*fp32"}
    scalars = {n: dims[n] for n in ("S", "T", "H", "R")}
    return _plans(hca_attention_kernel, "HcaAttention", inputs, scalars, dims, dtype,
                  dict(WINDOW=window, RATIO=ratio, SCALE=scale), splits)


def plan_hca_attention_paged(dims: Mapping[str, Any], dtype: Any, *, window: int, ratio: int, scale: float,
                             page_rows: int, splits: int = 1) -> list[LaunchPlan]:
    """HcaAttention over a block pool [blocks, page_rows, d] read through its table [B, W], then N new rows.
    dims: B, S, H, d, T, R, W, N."""
    inputs = _window_inputs(dtype) | {"pool": pointer_type(dtype), "block_table": "*i64",
                                      "new_rows": pointer_type(dtype), "row_ids": "*i64", "sink": "*fp32"}
    scalars = {n: dims[n] for n in ("S", "T", "H", "R", "W", "N")}
    return _plans(hca_attention_paged_kernel, "HcaAttentionPaged", inputs, scalars, dims, dtype,
                  dict(WINDOW=window, RATIO=ratio, SCALE=scale, PAGE_ROWS=page_rows), splits)


def plan_csa_attention(dims: Mapping[str, Any], dtype: Any, *, window: int, scale: float,
                       splits: int = 1) -> list[LaunchPlan]:
    """CsaAttention. dims: B, S, H, d, T, R, k."""
    inputs = _window_inputs(dtype) | {"rows": pointer_type(dtype), "topk_idx": "*i64", "sink": "*fp32"}
    scalars = {n: dims[n] for n in ("S", "T", "H", "R", "k")}
    return _plans(csa_attention_kernel, "CsaAttention", inputs, scalars, dims, dtype,
                  dict(WINDOW=window, SCALE=scale), splits)


def plan_csa_attention_paged(dims: Mapping[str, Any], dtype: Any, *, window: int, scale: float, page_rows: int,
                             splits: int = 1) -> list[LaunchPlan]:
    """CsaAttention over a block pool [blocks, page_rows, d] read through its table [B, W], then N new rows.
    dims: B, S, H, d, T, W, N, k."""
    inputs = _window_inputs(dtype) | {"pool": pointer_type(dtype), "block_table": "*i64",
                                      "new_rows": pointer_type(dtype), "topk_idx": "*i64", "sink": "*fp32"}
    scalars = {n: dims[n] for n in ("S", "T", "H", "W", "N", "k")}
    return _plans(csa_attention_paged_kernel, "CsaAttentionPaged", inputs, scalars, dims, dtype,
                  dict(WINDOW=window, SCALE=scale, PAGE_ROWS=page_rows), splits)


# --------------------------------------------------------------------------- torch launchers
def _auto_splits(q: torch.Tensor, keys: int, dims: Mapping[str, int]) -> int:
    """Key splits that bring a small grid up to about one program per SM, each with at least one key tile."""
    if q.device.type != "cuda":
        return 1
    programs = dims["B"] * dims["S"] * cdiv(dims["H"], BLOCK_H)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return max(1, min(MAX_SPLITS, sms // programs, cdiv(keys, _block_n(q.dtype))))


def _operand(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned, as the kernels assume (see _row_tile)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _attention(plan_fn, inputs: list[torch.Tensor], keys: int, splits: int | None, more_dims: dict[str, int],
               **attrs: Any) -> torch.Tensor:
    """Plan from the tensors' shapes (keys: the most keys a query can have), allocate, launch."""
    q, kv = inputs[0], inputs[2]
    B, S, H, d = q.shape
    dims = dict(B=B, S=S, H=H, d=d, T=kv.shape[1], **more_dims)
    plans = plan_fn(dims, q.dtype, splits=splits or _auto_splits(q, keys, dims), **attrs)
    inputs = [_operand(t) for t in inputs]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if len(plans) == 1:
        launch(plans[0], inputs, [out])
    else:
        part = torch.empty(B, S, H, plans[0].constexprs["SPLITS"], d + 2, dtype=torch.float32, device=q.device)
        launch(plans[0], inputs, [part])
        launch(plans[1], [part], [out])
    return out


def sliding_attention(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                      sink: torch.Tensor, *, window: int, scale: float, splits: int | None = None) -> torch.Tensor:
    """v4::SlidingAttention on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1.

    splits: key splits (None: enough to fill the GPU when B·S is small; 1 on the CPU)."""
    return _attention(plan_sliding_attention, [q, q_pos, kv, kv_pos, sink.float()], kv.shape[1], splits, {},
                      window=window, scale=scale)


def hca_attention(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                  rows: torch.Tensor, row_ids: torch.Tensor, sink: torch.Tensor, *, window: int, ratio: int,
                  scale: float, splits: int | None = None) -> torch.Tensor:
    """v4::HcaAttention on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    return _attention(plan_hca_attention, [q, q_pos, kv, kv_pos, rows, row_ids, sink.float()],
                      kv.shape[1] + rows.shape[1], splits, dict(R=rows.shape[1]), window=window, ratio=ratio,
                      scale=scale)


def csa_attention(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                  rows: torch.Tensor, topk_idx: torch.Tensor, sink: torch.Tensor, *, window: int, scale: float,
                  splits: int | None = None) -> torch.Tensor:
    """v4::CsaAttention on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    return _attention(plan_csa_attention, [q, q_pos, kv, kv_pos, rows, topk_idx, sink.float()],
                      kv.shape[1] + topk_idx.shape[2], splits, dict(R=rows.shape[1], k=topk_idx.shape[2]),
                      window=window, scale=scale)


def hca_attention_paged(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                        pool: torch.Tensor, block_table: torch.Tensor, new_rows: torch.Tensor, row_ids: torch.Tensor,
                        sink: torch.Tensor, *, window: int, ratio: int, scale: float,
                        splits: int | None = None) -> torch.Tensor:
    """hca_attention whose rows are the W * page_rows a block table [B, W] addresses in a pool [blocks, page_rows,
    d], then new_rows [B, N, d] (plugins/kernels/paging.py; row_ids [B, R] as for the dense op)."""
    return _attention(plan_hca_attention_paged,
                      [q, q_pos, kv, kv_pos, pool, block_table, new_rows, row_ids, sink.float()],
                      kv.shape[1] + row_ids.shape[1], splits,
                      dict(R=row_ids.shape[1], W=block_table.shape[1], N=new_rows.shape[1]),
                      window=window, ratio=ratio, scale=scale, page_rows=pool.shape[1])


def csa_attention_paged(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                        pool: torch.Tensor, block_table: torch.Tensor, new_rows: torch.Tensor, topk_idx: torch.Tensor,
                        sink: torch.Tensor, *, window: int, scale: float, splits: int | None = None) -> torch.Tensor:
    """csa_attention whose rows are a block pool's through a table, then new_rows (as hca_attention_paged)."""
    return _attention(plan_csa_attention_paged,
                      [q, q_pos, kv, kv_pos, pool, block_table, new_rows, topk_idx, sink.float()],
                      kv.shape[1] + topk_idx.shape[2], splits,
                      dict(W=block_table.shape[1], N=new_rows.shape[1], k=topk_idx.shape[2]),
                      window=window, scale=scale, page_rows=pool.shape[1])
