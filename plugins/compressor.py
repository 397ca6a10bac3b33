"""Compressor emission (docs/model.md §2.6-2.8): gated pooling of per-token values into compressed rows.

Each token t contributes a value c_t and a gate z_t (+ ape[t mod m]). Window w covers positions
m*w .. m*w+m-1 and closes at its last token. HCA pools one window; CSA pools 2m slots: the first half
(Ca) of window w-1 and the second half (Cb) of window w. The softmax runs over the slots, per channel;
slots at negative positions have weight 0.

The ops see a buffer of per-token values for consecutive positions `first_pos .. first_pos+L-1`
(the `state_tokens` the cache kept, then the S new ones) and emit E = ceil(S/m) row slots: slot i is
window (first_pos + state_tokens) // m + i, with row_id = -1 where that window does not close inside
the buffer. Norm and rope are applied by the caller (standard ops).
"""
from __future__ import annotations

import torch
from onnxscript import FLOAT, INT64, script

from v4engine.contract.layout import emitted_rows

from .common import NEG_INF, V4, exporting, op, symbolic


def _reference(kv: torch.Tensor, gate: torch.Tensor, first_pos: torch.Tensor, ratio: int, state_tokens: int,
               overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    B, L, C = kv.shape
    m = ratio
    E = emitted_rows(L, m, state_tokens)
    start = first_pos + state_tokens                                  # position of the first new token
    windows = torch.div(start, m, rounding_mode="floor").unsqueeze(1) + torch.arange(E, device=kv.device)
    closes_at = windows * m + (m - 1)
    row_ids = torch.where(closes_at <= first_pos.unsqueeze(1) + (L - 1), windows, torch.full_like(windows, -1))

    span = 2 if overlap else 1                                         # windows pooled into one row
    slot_pos = ((windows - (span - 1)) * m).unsqueeze(-1) + torch.arange(span * m, device=kv.device)
    index = (slot_pos - first_pos.view(B, 1, 1)).clamp(0, L - 1).reshape(B, E * span * m, 1).expand(-1, -1, C)
    slot_kv = torch.gather(kv, 1, index).reshape(B, E, span * m, C)
    slot_gate = torch.gather(gate, 1, index).reshape(B, E, span * m, C)
    if overlap:  # Ca (first half of the channels) of window w-1, Cb (second half) of window w
        d = C // 2
        slot_kv = torch.cat([slot_kv[:, :, :m, :d], slot_kv[:, :, m:, d:]], dim=2)
        slot_gate = torch.cat([slot_gate[:, :, :m, :d], slot_gate[:, :, m:, d:]], dim=2)
    slot_gate = slot_gate.float().masked_fill((slot_pos < 0).unsqueeze(-1), NEG_INF)
    weights = torch.softmax(slot_gate, dim=2)
    return (slot_kv.float() * weights).sum(dim=2).to(kv.dtype), row_ids


def _compress(name: str, kv: torch.Tensor, gate: torch.Tensor, first_pos: torch.Tensor, ratio: int,
              state_tokens: int, overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if exporting():
        B, L, C = kv.shape
        E = emitted_rows(L, ratio, state_tokens)
        rows, ids = symbolic(name, [kv, gate, first_pos], dict(ratio=ratio, state_tokens=state_tokens),
                             [kv.dtype, torch.int64], [(B, E, C // 2 if overlap else C), (B, E)])
        return rows, ids
    return _reference(kv, gate, first_pos, ratio, state_tokens, overlap)


def hca_compress(kv: torch.Tensor, gate: torch.Tensor, first_pos: torch.Tensor, *, ratio: int,
                 state_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v4::HcaCompress. kv, gate [B, P+S, d]; first_pos [B]. Returns rows [B,E,d] (before norm, rope), row_ids [B,E]."""
    return _compress("HcaCompress", kv, gate, first_pos, ratio, state_tokens, overlap=False)


def csa_compress(kv: torch.Tensor, gate: torch.Tensor, first_pos: torch.Tensor, *, ratio: int,
                 state_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v4::CsaCompress. kv, gate [B, P+S, 2d] (Ca | Cb). Returns rows [B,E,d] (before norm, rope), row_ids [B,E]."""
    return _compress("CsaCompress", kv, gate, first_pos, ratio, state_tokens, overlap=True)


# --------------------------------------------------------------------------- ONNX functions (standard ops)
@script(V4, default_opset=op)
def WindowSlots(kv: FLOAT, gate: FLOAT, first_pos: INT64, ratio: int, state_tokens: int, span: int):
    """Gather each emitted row's span*ratio slots: (slot values, slot gates with -inf before position 0, row_ids)."""
    m = op.CastLike(ratio, first_pos)
    length = op.Shape(kv, start=1, end=2)
    n_new = length - op.CastLike(state_tokens, first_pos)
    rows = op.Div(n_new + m - op.CastLike(1, m), m)
    start = first_pos + op.CastLike(state_tokens, first_pos)
    windows = op.Unsqueeze(op.Div(start, m), [1]) + op.Unsqueeze(
        op.Range(op.CastLike(0, m), op.Squeeze(rows, [0]), op.CastLike(1, m)), [0])           # [B,E]
    closes_at = windows * m + m - op.CastLike(1, m)
    last_pos = op.Unsqueeze(first_pos, [1]) + length - op.CastLike(1, m)
    row_ids = op.Where(op.LessOrEqual(closes_at, last_pos), windows, op.CastLike(-1, windows))
    width = m * op.CastLike(span, m)
    slot_pos = op.Unsqueeze((windows - op.CastLike(span, m) + op.CastLike(1, m)) * m, [-1]) + op.Range(
        op.CastLike(0, m), width, op.CastLike(1, m))                                              # [B,E,width]
    index = op.Clip(slot_pos - op.Unsqueeze(first_pos, [1, 2]), op.CastLike(0, m), op.Squeeze(length, [0]) - 1)
    index = op.Unsqueeze(index, [-1])
    slot_kv = op.GatherND(kv, index, batch_dims=1)                                               # [B,E,width,C]
    slot_gate = op.GatherND(gate, index, batch_dims=1)
    before_start = op.Unsqueeze(op.Less(slot_pos, op.CastLike(0, m)), [-1])
    slot_gate = op.Where(before_start, op.CastLike(NEG_INF, slot_gate), slot_gate)
    return slot_kv, slot_gate, row_ids


@script(V4, default_opset=op)
def Pool(slot_kv: FLOAT, slot_gate: FLOAT) -> FLOAT:
    """Softmax over the slots (axis 2), per channel, in fp32; weighted sum of the slot values."""
    weights = op.Softmax(op.Cast(slot_gate, to=FLOAT.dtype), axis=2)
    return op.CastLike(op.ReduceSum(op.Cast(slot_kv, to=FLOAT.dtype) * weights, [2], keepdims=0), slot_kv)


@script(V4, default_opset=op)
def HcaCompress(kv: FLOAT, gate: FLOAT, first_pos: INT64, ratio: int, state_tokens: int):
    slot_kv, slot_gate, row_ids = WindowSlots(kv, gate, first_pos, ratio=ratio, state_tokens=state_tokens, span=1)
    return Pool(slot_kv, slot_gate), row_ids


@script(V4, default_opset=op)
def CsaCompress(kv: FLOAT, gate: FLOAT, first_pos: INT64, ratio: int, state_tokens: int):
    slot_kv, slot_gate, row_ids = WindowSlots(kv, gate, first_pos, ratio=ratio, state_tokens=state_tokens, span=2)
    d = op.Div(op.Shape(kv, start=2, end=3), op.CastLike(2, first_pos))
    m = op.Reshape(op.CastLike(ratio, first_pos), [1])
    zero = op.Constant(value_ints=[0])
    big = op.Constant(value_ints=[9223372036854775807])
    ca_kv = op.Slice(op.Slice(slot_kv, zero, m, [2]), zero, d, [3])          # window w-1, first half
    cb_kv = op.Slice(op.Slice(slot_kv, m, big, [2]), d, big, [3])            # window w, second half
    ca_gate = op.Slice(op.Slice(slot_gate, zero, m, [2]), zero, d, [3])
    cb_gate = op.Slice(op.Slice(slot_gate, m, big, [2]), d, big, [3])
    return Pool(op.Concat(ca_kv, cb_kv, axis=2), op.Concat(ca_gate, cb_gate, axis=2)), row_ids


PLUGIN_FUNCTIONS = (HcaCompress, CsaCompress)
HELPER_FUNCTIONS = (WindowSlots, Pool)
