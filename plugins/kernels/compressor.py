"""Triton kernel for v4::HcaCompress and v4::CsaCompress (docs/model.md §2.6-2.8, plugins/compressor.py).

The ops see per-token values kv and gates for consecutive positions first_pos .. first_pos+L-1 (the
`state_tokens` the cache kept, then the new tokens) and emit E = ceil((L - state_tokens) / ratio) rows:
row e pools window w = (first_pos + state_tokens) // ratio + e, and its row_id is w, or -1 when the
window does not close inside the buffer. A row is a per-channel softmax over its slots of the gates,
times the values, summed:
* HCA (OVERLAP=False): the m = ratio tokens of window w, all C channels.
* CSA (OVERLAP=True): 2m slots, the first half of the channels (Ca) of window w-1's tokens, then the
  second half (Cb) of window w's tokens; d = C/2 output channels.
Slots at negative positions have weight 0; slot positions outside the buffer are clamped to its ends,
exactly as the reference gathers them (such rows carry row_id -1 anyway).

Design: one kernel for both ops, grid (E, B, ceil(d_out / BLOCK_C)) (E first: it may exceed 65535).
A program loads the [slots, BLOCK_C] tiles of values and gates (slots padded to a power of two and
masked), takes the softmax over the slot axis and the weighted sum in fp32, and stores one [BLOCK_C]
piece of the row; the program of channel block 0 also writes the row_id. Loads are upcast to fp32 at
once (the Triton interpreter's bf16 arithmetic is unreliable). BLOCK_C keeps a tile within 4K elements
and 128 channels: at V4-Flash sizes HCA (m=128, C=512) runs [128, 32] tiles on grid (E, B, 16) and CSA
(m=4, C=2*512) runs [8, 128] tiles on grid (E, B, 4), about 100-125 and 32 registers per thread.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from v4engine.contract.layout import emitted_rows

from .launch import LaunchPlan, cdiv, launch, pointer_type

TILE = 4096                 # at most slots * BLOCK_C elements per program
MAX_BLOCK_C = 128


@triton.jit
def _compress_kernel(kv, gate, first_pos, L, C, rows, row_ids,
                     RATIO: tl.constexpr, STATE_TOKENS: tl.constexpr, OVERLAP: tl.constexpr,
                     BLOCK_SLOTS: tl.constexpr, BLOCK_C: tl.constexpr):
    e = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cb = tl.program_id(2)
    SPAN: tl.constexpr = 2 if OVERLAP else 1                   # windows pooled into one row
    d_out = C // SPAN
    n_rows = (L - STATE_TOKENS + RATIO - 1) // RATIO

    start = tl.load(first_pos + b)                                         # position of buffer slot 0
    window = (start + STATE_TOKENS) // RATIO + e
    closes = window * RATIO + RATIO - 1
    if cb == 0:
        tl.store(row_ids + b * n_rows + e, tl.where(closes <= start + L - 1, window, -1))

    slots = tl.arange(0, BLOCK_SLOTS)
    pos = (window - (SPAN - 1)) * RATIO + slots                            # position of each slot
    token = tl.minimum(tl.maximum(pos - start, 0), L - 1)                  # clamped into the buffer
    out_ch = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    in_ch = out_ch[None, :] + tl.where(slots >= RATIO, d_out, 0)[:, None]  # CSA: window w's slots read Cb
    tile = (b * L + token)[:, None] * C + in_ch
    mask = (slots < SPAN * RATIO)[:, None] & (out_ch < d_out)[None, :]
    values = tl.load(kv + tile, mask=mask, other=0.0).to(tl.float32)
    logits = tl.load(gate + tile, mask=mask, other=0.0).to(tl.float32)
    logits = tl.where(((slots < SPAN * RATIO) & (pos >= 0))[:, None], logits, float("-inf"))

    p = tl.exp(logits - tl.max(logits, axis=0)[None, :])
    weights = p / tl.sum(p, axis=0)[None, :]
    pooled = tl.sum(values * weights, axis=0)
    tl.store(rows + (b * n_rows + e) * d_out + out_ch, pooled.to(rows.dtype.element_ty), mask=out_ch < d_out)


def _plan_compress(dims: dict[str, Any], dtype: Any, *, ratio: int, state_tokens: int,
                   overlap: bool) -> LaunchPlan:
    """HcaCompress (overlap=False) or CsaCompress (overlap=True) for dims B, L, C (C must be an int)."""
    span = 2 if overlap else 1
    d_out = dims["C"] // span
    block_slots = triton.next_power_of_2(span * ratio)
    block_c = min(triton.next_power_of_2(d_out), MAX_BLOCK_C, max(1, TILE // block_slots))
    n_rows = emitted_rows(dims["L"], ratio, state_tokens)
    return LaunchPlan(
        kernel=_compress_kernel,
        inputs={"kv": pointer_type(dtype), "gate": pointer_type(dtype), "first_pos": "*i64"},
        scalars={"L": dims["L"], "C": dims["C"]},
        outputs={"rows": pointer_type(dtype), "row_ids": "*i64"},
        constexprs=dict(RATIO=ratio, STATE_TOKENS=state_tokens, OVERLAP=overlap,
                        BLOCK_SLOTS=block_slots, BLOCK_C=block_c),
        grid=(n_rows, dims["B"], cdiv(d_out, block_c)),
        name="CsaCompress" if overlap else "HcaCompress")


def plan_hca_compress(dims: dict[str, Any], dtype: Any, *, ratio: int, state_tokens: int) -> LaunchPlan:
    return _plan_compress(dims, dtype, ratio=ratio, state_tokens=state_tokens, overlap=False)


def plan_csa_compress(dims: dict[str, Any], dtype: Any, *, ratio: int, state_tokens: int) -> LaunchPlan:
    return _plan_compress(dims, dtype, ratio=ratio, state_tokens=state_tokens, overlap=True)


def _compress(kv: torch.Tensor, gate: torch.Tensor, first_pos: torch.Tensor, ratio: int, state_tokens: int,
              overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    B, L, C = kv.shape
    plan = _plan_compress(dict(B=B, L=L, C=C), kv.dtype, ratio=ratio, state_tokens=state_tokens, overlap=overlap)
    n_rows = plan.grid[0]
    rows = torch.empty(B, n_rows, C // 2 if overlap else C, dtype=kv.dtype, device=kv.device)
    row_ids = torch.empty(B, n_rows, dtype=torch.int64, device=kv.device)
    if n_rows:
        launch(plan, [kv.contiguous(), gate.to(kv.dtype).contiguous(), first_pos.contiguous()], [rows, row_ids])
    return rows, row_ids


def hca_compress(kv: torch.Tensor, gate: torch.Tensor, first_pos: torch.Tensor, *, ratio: int,
                 state_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v4::HcaCompress: kv, gate [B,L,C]; first_pos [B] -> rows [B,E,C] (kv dtype), row_ids [B,E] int64."""
    return _compress(kv, gate, first_pos, ratio, state_tokens, overlap=False)


def csa_compress(kv: torch.Tensor, gate: torch.Tensor, first_pos: torch.Tensor, *, ratio: int,
                 state_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v4::CsaCompress: kv, gate [B,L,2d] (Ca | Cb); first_pos [B] -> rows [B,E,d] (kv dtype), row_ids [B,E]."""
    return _compress(kv, gate, first_pos, ratio, state_tokens, overlap=True)
