"""Triton kernel for v4::IndexerTopK, the lightning indexer's top-k (docs/model.md §2.7, plugins/indexer.py).

score[t, r] = sum_h weights[t,h] * ReLU(q[t,h] . keys[r]) * scale over the rows visible to query t
(0 <= key_ids[r] < (t+1) // ratio). The result is the top k = min(topk, R) slots by score, descending,
ties going to the LOWEST slot index, with -1 for picks that are not visible: exactly what the reference's
stable descending sort gives. ReLU zeroes whole rows of scores, so exact ties are common and the order
among them is part of the contract, not an approximation.

Design: one program per query (grid (S, B, 1)), no workspace, a single kernel.
* Packed keys. Each visible row becomes one int64, `order_key(score) << 32 | (2**31 - 1 - r)`, where
  order_key is the usual order-preserving map of an fp32 onto an int32 (negative floats get their
  magnitude bits flipped; -0.0 is first folded onto +0.0, which the reference's sort treats as equal).
  A larger packed value means a higher score, then a lower slot, so the reference's order is plain
  descending int64 order and every key is distinct. Invisible rows (and padding) get EMPTY, the
  smallest int64, below every visible row; they decode to -1.
* Running top-k by bitonic merging. The program keeps `best`, the BUFFER largest keys seen so far
  (BUFFER = the next power of two >= topk), sorted descending. It scores BUFFER rows at a time
  (BUFFER // BLOCK_R sub-blocks, each one tensor-core dot [heads, dI] x [dI, BLOCK_R]), sorts those
  candidates ascending (tl.sort) and takes max(best[i], cand[i]) element-wise: for a descending and
  an ascending list of equal length that is exactly the top BUFFER of their union, as a bitonic
  sequence, which tl.bitonic_merge puts back in descending order in log2(BUFFER) steps. R rows cost
  R/BUFFER sorts and merges of BUFFER keys whatever the scores, no workspace, and the state lives in
  registers (4 KiB per program for topk=512). tl.sort and tl.bitonic_merge are public in Triton 3.6
  (the GPU image) and 3.9, and run under the interpreter; tl.topk is not used (its signature differs
  between the two: 3.6 has no `descending`).
* Scores accumulate in fp32. bf16/fp16 inputs go to the tensor cores as they are (their products are
  exact in fp32); fp32 inputs use an IEEE fp32 dot (FP32_DOT). The torch launcher also sets FP32_DOT
  under TRITON_INTERPRET, because the interpreter's bf16 dot returns garbage; the plan itself (what
  TensorRT compiles) always describes the GPU kernel.

At V4-Flash sizes (h=64, dI=128, topk=512, R <= 16384, bf16): 8 warps, BLOCK_R=32, BUFFER=512, so each
program runs R/512 rounds of 16 dots [64,128]x[128,32], one sort and one merge of 512 int64; grid
(S, B, 1). That compiles to about 110 registers per thread and no spills on sm90 and sm100 (BLOCK_R=64
needs 180-255 and spills on sm100; fp32 operands use BLOCK_R=16 for the same reason). Decode (S=1) is
one program per sequence; splitting R over programs would need a second merge pass (a workspace).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import triton
import triton.language as tl

from .launch import LaunchPlan, interpreting, launch, pointer_type
from .paging import paged_row_tile

EMPTY = tl.constexpr(-(2 ** 63))        # packed key of an invisible row: below every visible one
SLOT_MASK = tl.constexpr(2 ** 31 - 1)   # the low 32 bits hold r ^ SLOT_MASK = 2**31-1-r: bit 31 is 0


@triton.jit
def _order_key(score):
    """int32 with the same order as the fp32 score (-0.0 and +0.0 equal, as in torch.sort)."""
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _pack(score, rows, visible):
    """One int64 per row: higher score first, then lower slot; EMPTY where not visible."""
    packed = (_order_key(score).to(tl.int64) << 32) | (rows ^ SLOT_MASK).to(tl.int64)
    return tl.where(visible, packed, EMPTY)


@triton.jit
def _unpack(packed):
    """The slot index of each packed key, or -1 for EMPTY."""
    return tl.where(packed == EMPTY, -1, (packed & SLOT_MASK) ^ SLOT_MASK)


@triton.jit
def _score_block(query, head_w, keys, table, new, past, key_ids, b, R, r0, limit,
                 SCALE: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                 FP32_DOT: tl.constexpr, PAGE_ROWS: tl.constexpr):
    """Packed keys of rows r0 .. r0+BLOCK_R-1 for one query: query [BLOCK_H, BLOCK_D] as loaded,
    head_w [BLOCK_H] fp32 (0 on padded heads). PAGE_ROWS > 0: keys is a block pool read through `table`, this
    sequence's row of the block table, for its first `past` rows, then `new`'s (plugins/kernels/paging.py)."""
    rows = r0 + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    in_range = rows < R
    if PAGE_ROWS > 0:
        tile = paged_row_tile(keys, table, new, rows, in_range, past, dims, PAGE_ROWS, DIM)
    else:
        tile = keys + (b * R + rows[:, None]) * DIM + dims[None, :]
    key_tile = tl.load(tile, mask=in_range[:, None] & (dims[None, :] < DIM), other=0.0)
    if FP32_DOT:
        dots = tl.dot(query.to(tl.float32), tl.trans(key_tile.to(tl.float32)), input_precision="ieee")
    else:
        dots = tl.dot(query, tl.trans(key_tile))                           # fp32 accumulation
    scores = tl.sum(tl.maximum(dots, 0.0) * SCALE * head_w[:, None], axis=0)   # [BLOCK_R]
    ids = tl.load(key_ids + b * R + rows, mask=in_range, other=-1)
    return _pack(scores, rows, (ids >= 0) & (ids < limit))


@triton.jit
def _indexer_topk_kernel(q, weights, keys, key_ids, q_pos, S, R, idx,
                         TOPK: tl.constexpr, RATIO: tl.constexpr, SCALE: tl.constexpr,
                         HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_R: tl.constexpr, BUFFER: tl.constexpr, FP32_DOT: tl.constexpr):
    _indexer_topk(q, weights, keys, key_ids, keys, key_ids, q_pos, S, R, 0, 0, idx, TOPK, RATIO, SCALE, HEADS, DIM,
                  BLOCK_H, BLOCK_D, BLOCK_R, BUFFER, FP32_DOT, 0)


@triton.jit(do_not_specialize=["S", "R", "W", "N"])
def _indexer_topk_paged_kernel(q, weights, pool, block_table, new_keys, key_ids, q_pos, S, R, W, N, idx,
                               TOPK: tl.constexpr, RATIO: tl.constexpr, SCALE: tl.constexpr,
                               HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_R: tl.constexpr, BUFFER: tl.constexpr, FP32_DOT: tl.constexpr,
                               PAGE_ROWS: tl.constexpr):
    _indexer_topk(q, weights, pool, block_table, new_keys, key_ids, q_pos, S, R, W, N, idx, TOPK, RATIO, SCALE, HEADS,
                  DIM, BLOCK_H, BLOCK_D, BLOCK_R, BUFFER, FP32_DOT, PAGE_ROWS)


@triton.jit
def _indexer_topk(q, weights, keys, block_table, new_keys, key_ids, q_pos, S, R, W, N, idx,
                  TOPK: tl.constexpr, RATIO: tl.constexpr, SCALE: tl.constexpr,
                  HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_R: tl.constexpr, BUFFER: tl.constexpr, FP32_DOT: tl.constexpr, PAGE_ROWS: tl.constexpr):
    """Program (s, b): query b·S+s's top k (PAGE_ROWS > 0: keys a block pool through block_table [B, W], then
    N new keys per batch row)."""
    s = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t = b * S + s                                                          # the query's flat index
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    query = tl.load(q + (t * HEADS + heads[:, None]) * DIM + dims[None, :],
                    mask=(heads[:, None] < HEADS) & (dims[None, :] < DIM), other=0.0)
    head_w = tl.load(weights + t * HEADS + heads, mask=heads < HEADS, other=0.0).to(tl.float32)
    limit = (tl.load(q_pos + t) + 1) // RATIO                              # windows 0 .. limit-1 closed

    SUB: tl.constexpr = BUFFER // BLOCK_R
    sub = tl.arange(0, SUB)[:, None]
    best = tl.full([BUFFER], EMPTY, tl.int64)                              # sorted descending
    for r0 in range(0, R, BUFFER):
        cand = tl.full([SUB, BLOCK_R], EMPTY, tl.int64)
        for j in range(SUB):
            block = _score_block(query, head_w, keys, block_table + b * W, new_keys + b * N * DIM, W * PAGE_ROWS,
                                 key_ids, b, R, r0 + j * BLOCK_R, limit, SCALE, DIM, BLOCK_D, BLOCK_R, FP32_DOT,
                                 PAGE_ROWS)
            cand = tl.where(sub == j, block[None, :], cand)             # row j of the candidates
        cand = tl.sort(tl.reshape(cand, [BUFFER]))                         # ascending
        best = tl.bitonic_merge(tl.maximum(best, cand), descending=True)   # top BUFFER of the union

    k = tl.minimum(R, TOPK)
    picks = tl.arange(0, BUFFER)
    tl.store(idx + t * k + picks, _unpack(best), mask=picks < k)


def _pow2(n: int, at_least: int = 1) -> int:
    return max(triton.next_power_of_2(n), at_least)


def plan_indexer_topk(dims: dict[str, Any], dtype: Any, *, topk: int, ratio: int, scale: float,
                      weights_dtype: Any = None, page_rows: int = 0) -> LaunchPlan:
    """IndexerTopK for dims B, S, h, dI, R (h and dI must be ints); dtype of q and keys, weights_dtype of
    weights (default: dtype). page_rows > 0: the paged kernel, keys a block pool [blocks, page_rows, dI] read
    through a block table [B, W], then N new keys (dims W and N too)."""
    buffer = _pow2(topk, 16)
    fp32 = pointer_type(dtype) == "*fp32"
    block_r = min(buffer, 16 if fp32 else 32)          # keeps the dot's registers from spilling
    keys = {"pool": pointer_type(dtype), "block_table": "*i64", "new_keys": pointer_type(dtype)} if page_rows \
        else {"keys": pointer_type(dtype)}
    constexprs = dict(TOPK=topk, RATIO=ratio, SCALE=float(scale), HEADS=dims["h"], DIM=dims["dI"],
                      BLOCK_H=_pow2(dims["h"], 16), BLOCK_D=_pow2(dims["dI"], 16),
                      BLOCK_R=block_r, BUFFER=buffer, FP32_DOT=fp32)
    return LaunchPlan(
        kernel=_indexer_topk_paged_kernel if page_rows else _indexer_topk_kernel,
        inputs={"q": pointer_type(dtype), "weights": pointer_type(weights_dtype or dtype), **keys,
                "key_ids": "*i64", "q_pos": "*i64"},
        scalars={"S": dims["S"], "R": dims["R"]} | ({"W": dims["W"], "N": dims["N"]} if page_rows else {}),
        outputs={"idx": "*i64"},
        constexprs=constexprs | ({"PAGE_ROWS": page_rows} if page_rows else {}),
        grid=(dims["S"], dims["B"], 1),
        num_warps=8,
        name="IndexerTopKPaged" if page_rows else "IndexerTopK")


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_ids: torch.Tensor,
                 q_pos: torch.Tensor, *, topk: int, ratio: int, scale: float) -> torch.Tensor:
    """v4::IndexerTopK on torch tensors: q [B,S,h,dI]; weights [B,S,h]; keys [B,R,dI]; key_ids [B,R];
    q_pos [B,S] -> [B,S,min(topk,R)] int64 slot indices, -1 where the pick is not visible."""
    return _indexer(q, weights, [keys.to(q.dtype).contiguous()], key_ids, q_pos, {}, topk, ratio, scale)


def indexer_topk_paged(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                       new_keys: torch.Tensor, key_ids: torch.Tensor, q_pos: torch.Tensor, *, topk: int, ratio: int,
                       scale: float) -> torch.Tensor:
    """indexer_topk whose keys are the W * page_rows a block table [B, W] addresses in a pool [blocks, page_rows,
    dI], then new_keys [B, N, dI] (plugins/kernels/paging.py; key_ids [B, R] as for the dense op)."""
    keys = [pool.to(q.dtype).contiguous(), block_table.contiguous(), new_keys.to(q.dtype).contiguous()]
    return _indexer(q, weights, keys, key_ids, q_pos,
                    dict(W=block_table.shape[1], N=new_keys.shape[1], page_rows=pool.shape[1]), topk, ratio, scale)


def _indexer(q: torch.Tensor, weights: torch.Tensor, keys: list[torch.Tensor], key_ids: torch.Tensor,
             q_pos: torch.Tensor, paged: dict[str, int], topk: int, ratio: int, scale: float) -> torch.Tensor:
    B, S, h, dI = q.shape
    R = key_ids.shape[1]
    idx = torch.empty(B, S, min(topk, R), dtype=torch.int64, device=q.device)
    if idx.numel() == 0:
        return idx
    page_rows = paged.pop("page_rows", 0)
    plan = plan_indexer_topk(dict(B=B, S=S, h=h, dI=dI, R=R, **paged), q.dtype, topk=topk, ratio=ratio, scale=scale,
                             weights_dtype=weights.dtype, page_rows=page_rows)
    if interpreting():                     # the interpreter's bf16 dot is wrong: score in fp32 there
        plan = replace(plan, constexprs={**plan.constexprs, "FP32_DOT": True})
    launch(plan, [q.contiguous(), weights.contiguous(), *keys, key_ids.contiguous(), q_pos.contiguous()], [idx])
    return idx
