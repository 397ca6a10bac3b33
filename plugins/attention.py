"""Attention with a per-head sink over the sliding window plus compressed rows (docs/model.md §2.3-2.8).

Three ops share one core: every V4 layer attends to its raw window (the last `window` positions,
itself included); HCA layers add every compressed row already closed; CSA layers add only the rows
the lightning indexer picked. K = V (MQA, one head shared by all query heads). The sink is one extra
logit per head that appears only in the softmax denominator.

Shapes: q [B,S,H,d]; q_pos [B,S]; kv [B,T,d] window keys with kv_pos [B,T] (-1 = empty slot);
rows [B,R,d] compressed rows with row_ids [B,R] (window index, -1 = empty slot); topk_idx [B,S,k].
The rows may also be `PagedRows` (plugins/paging.py: a block pool through a table, then new rows): the op is then
its paged form (HcaAttentionPaged, CsaAttentionPaged), the same computation on the same logical rows.
"""
from __future__ import annotations

import torch
from onnxscript import BOOL, FLOAT, INT64, script

from .common import NEG_INF, V4, exporting, op, symbolic
from .paging import PagedRows, PagedRowsDense


# --------------------------------------------------------------------------- PyTorch reference
def window_visible(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[B,S,T]: key at position p is visible to the query at t iff t - window < p <= t and p >= 0."""
    t = q_pos.unsqueeze(-1)
    p = kv_pos.unsqueeze(-2)
    return (p <= t) & (p > t - window) & (p >= 0)


def attend_with_sink(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax over [q.k * scale (visible keys only), sink] times keys, sink column dropped.

    keys: [B,1,T,d] (shared by every query of a row) or [B,S,T,d] (chosen per query); visible [B,S,T].
    """
    qf, kf = q.float(), keys.float()
    B, S, H, d = q.shape
    shared = kf.shape[1] == 1 and S > 1          # one key set per row: no need to broadcast it per query
    if shared:
        logits = torch.matmul(qf.reshape(B, S * H, d), kf[:, 0].transpose(-1, -2)).view(B, S, H, -1)
    else:
        logits = torch.matmul(qf, kf.transpose(-1, -2))                          # [B,S,H,T]
    logits = (logits * scale).masked_fill(~visible.unsqueeze(2), NEG_INF)
    sinks = sink.float().view(1, 1, -1, 1).expand(*logits.shape[:3], 1)
    combined = torch.cat([logits, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    if shared:
        return torch.matmul(probs.reshape(B, S * H, -1), kf[:, 0]).view(B, S, H, d).to(q.dtype)
    return torch.matmul(probs, kf).to(q.dtype)


def rows_visible(q_pos: torch.Tensor, row_ids: torch.Tensor, ratio: int) -> torch.Tensor:
    """[B,S,R]: compressed row w is visible to the query at t iff 0 <= w < (t+1) // ratio."""
    limit = torch.div(q_pos + 1, ratio, rounding_mode="floor").unsqueeze(-1)
    ids = row_ids.unsqueeze(-2)
    return (ids >= 0) & (ids < limit)


def _sliding_reference(q, q_pos, kv, kv_pos, sink, window, scale):
    return attend_with_sink(q, kv.unsqueeze(1), window_visible(q_pos, kv_pos, window), sink, scale)


def _hca_reference(q, q_pos, kv, kv_pos, rows, row_ids, sink, window, ratio, scale):
    keys = torch.cat([kv, rows], dim=1).unsqueeze(1)
    visible = torch.cat([window_visible(q_pos, kv_pos, window), rows_visible(q_pos, row_ids, ratio)], dim=-1)
    return attend_with_sink(q, keys, visible, sink, scale)


def _csa_reference(q, q_pos, kv, kv_pos, rows, topk_idx, sink, window, scale):
    B, S, k = topk_idx.shape
    gather = topk_idx.clamp(min=0).reshape(B, S * k, 1).expand(-1, -1, rows.shape[-1])
    chosen = torch.gather(rows, 1, gather).reshape(B, S, k, rows.shape[-1])
    keys = torch.cat([kv.unsqueeze(1).expand(-1, S, -1, -1), chosen], dim=2)
    visible = torch.cat([window_visible(q_pos, kv_pos, window), topk_idx >= 0], dim=-1)
    return attend_with_sink(q, keys, visible, sink, scale)


# --------------------------------------------------------------------------- the ops
def sliding_attention(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                      sink: torch.Tensor, *, window: int, scale: float) -> torch.Tensor:
    """v4::SlidingAttention: the window only (sliding layers and the MTP layer)."""
    if exporting():
        return symbolic("SlidingAttention", [q, q_pos, kv, kv_pos, sink], dict(window=window, scale=scale),
                        [q.dtype], [q.shape])[0]
    return _sliding_reference(q, q_pos, kv, kv_pos, sink, window, scale)


def hca_attention(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                  rows: torch.Tensor | PagedRows, row_ids: torch.Tensor, sink: torch.Tensor, *, window: int,
                  ratio: int, scale: float) -> torch.Tensor:
    """v4::HcaAttention: the window plus every compressed row w with w < (t+1) // ratio."""
    if isinstance(rows, PagedRows):
        return hca_attention_paged(q, q_pos, kv, kv_pos, rows.pool, rows.block_table, rows.new, row_ids, sink,
                                   window=window, ratio=ratio, scale=scale)
    if exporting():
        return symbolic("HcaAttention", [q, q_pos, kv, kv_pos, rows, row_ids, sink],
                        dict(window=window, ratio=ratio, scale=scale), [q.dtype], [q.shape])[0]
    return _hca_reference(q, q_pos, kv, kv_pos, rows, row_ids, sink, window, ratio, scale)


def csa_attention(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                  rows: torch.Tensor | PagedRows, topk_idx: torch.Tensor, sink: torch.Tensor, *, window: int,
                  scale: float) -> torch.Tensor:
    """v4::CsaAttention: the window plus the compressed rows the indexer picked (topk_idx [B,S,k], -1 = none)."""
    if isinstance(rows, PagedRows):
        return csa_attention_paged(q, q_pos, kv, kv_pos, rows.pool, rows.block_table, rows.new, topk_idx, sink,
                                   window=window, scale=scale)
    if exporting():
        return symbolic("CsaAttention", [q, q_pos, kv, kv_pos, rows, topk_idx, sink],
                        dict(window=window, scale=scale), [q.dtype], [q.shape])[0]
    return _csa_reference(q, q_pos, kv, kv_pos, rows, topk_idx, sink, window, scale)


def hca_attention_paged(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                        pool: torch.Tensor, block_table: torch.Tensor, new_rows: torch.Tensor, row_ids: torch.Tensor,
                        sink: torch.Tensor, *, window: int, ratio: int, scale: float) -> torch.Tensor:
    """v4::HcaAttentionPaged: HcaAttention on PagedRows(pool, block_table, new_rows)."""
    if exporting():
        return symbolic("HcaAttentionPaged", [q, q_pos, kv, kv_pos, pool, block_table, new_rows, row_ids, sink],
                        dict(window=window, ratio=ratio, scale=scale), [q.dtype], [q.shape])[0]
    rows = PagedRows(pool, block_table, new_rows).dense()
    return _hca_reference(q, q_pos, kv, kv_pos, rows, row_ids, sink, window, ratio, scale)


def csa_attention_paged(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                        pool: torch.Tensor, block_table: torch.Tensor, new_rows: torch.Tensor, topk_idx: torch.Tensor,
                        sink: torch.Tensor, *, window: int, scale: float) -> torch.Tensor:
    """v4::CsaAttentionPaged: CsaAttention on PagedRows(pool, block_table, new_rows)."""
    if exporting():
        return symbolic("CsaAttentionPaged", [q, q_pos, kv, kv_pos, pool, block_table, new_rows, topk_idx, sink],
                        dict(window=window, scale=scale), [q.dtype], [q.shape])[0]
    rows = PagedRows(pool, block_table, new_rows).dense()
    return _csa_reference(q, q_pos, kv, kv_pos, rows, topk_idx, sink, window, scale)


# --------------------------------------------------------------------------- ONNX functions (standard ops)
@script(V4, default_opset=op)
def WindowVisible(q_pos: INT64, kv_pos: INT64, window: int) -> BOOL:
    t = op.Unsqueeze(q_pos, [-1])
    p = op.Unsqueeze(kv_pos, [1])
    lowest = t - op.CastLike(window, t)
    return op.And(op.And(op.LessOrEqual(p, t), op.Greater(p, lowest)), op.GreaterOrEqual(p, op.CastLike(0, p)))


@script(V4, default_opset=op)
def RowsVisible(q_pos: INT64, row_ids: INT64, ratio: int) -> BOOL:
    limit = op.Unsqueeze(op.Div(q_pos + op.CastLike(1, q_pos), op.CastLike(ratio, q_pos)), [-1])
    ids = op.Unsqueeze(row_ids, [1])
    return op.And(op.GreaterOrEqual(ids, op.CastLike(0, ids)), op.Less(ids, limit))


@script(V4, default_opset=op)
def SinkSoftmax(logits: FLOAT, visible: BOOL, sink: FLOAT) -> FLOAT:
    """softmax over [logits (visible keys only), sink] per query and head, sink column dropped: [B,S,H,T]."""
    logits = op.Where(op.Unsqueeze(visible, [2]), logits, op.CastLike(NEG_INF, logits))
    sinks = op.Expand(op.Reshape(op.Cast(sink, to=FLOAT.dtype), [1, 1, -1, 1]),
                      op.Concat(op.Slice(op.Shape(logits), [0], [3]), [1], axis=0))
    combined = op.Concat(logits, sinks, axis=-1)
    combined = combined - op.ReduceMax(combined, [-1], keepdims=1)
    return op.Slice(op.Softmax(combined, axis=-1), [0], [-1], [-1])


@script(V4, default_opset=op)
def AttendWithSink(q: FLOAT, keys: FLOAT, visible: BOOL, sink: FLOAT, scale: float) -> FLOAT:
    qf = op.Cast(q, to=FLOAT.dtype)                                # fp32 whatever the activation dtype
    kf = op.Cast(keys, to=FLOAT.dtype)
    logits = op.MatMul(qf, op.Transpose(kf, perm=[0, 1, 3, 2])) * op.CastLike(scale, qf)
    return op.CastLike(op.MatMul(SinkSoftmax(logits, visible, sink), kf), q)


@script(V4, default_opset=op)
def SlidingAttention(q: FLOAT, q_pos: INT64, kv: FLOAT, kv_pos: INT64, sink: FLOAT, window: int,
                     scale: float) -> FLOAT:
    visible = WindowVisible(q_pos, kv_pos, window=window)
    return AttendWithSink(q, op.Unsqueeze(kv, [1]), visible, sink, scale=scale)


@script(V4, default_opset=op)
def HcaAttention(q: FLOAT, q_pos: INT64, kv: FLOAT, kv_pos: INT64, rows: FLOAT, row_ids: INT64, sink: FLOAT,
                 window: int, ratio: int, scale: float) -> FLOAT:
    keys = op.Unsqueeze(op.Concat(kv, rows, axis=1), [1])
    visible = op.Concat(WindowVisible(q_pos, kv_pos, window=window), RowsVisible(q_pos, row_ids, ratio=ratio),
                        axis=-1)
    return AttendWithSink(q, keys, visible, sink, scale=scale)


@script(V4, default_opset=op)
def CsaAttention(q: FLOAT, q_pos: INT64, kv: FLOAT, kv_pos: INT64, rows: FLOAT, topk_idx: INT64, sink: FLOAT,
                 window: int, scale: float) -> FLOAT:
    """The window's keys are every query's of a row: they are multiplied as one [S*H, d] x [d, T] product, never
    copied per query (a [B,S,T,d] copy was 0.8 MB a query, most of a prefill chunk's memory on the slice); the
    chosen rows are per query. One softmax over both."""
    picked = op.GreaterOrEqual(topk_idx, op.CastLike(0, topk_idx))
    index = op.Unsqueeze(op.Max(topk_idx, op.CastLike(0, topk_idx)), [-1])
    chosen = op.Cast(op.GatherND(rows, index, batch_dims=1), to=FLOAT.dtype)       # [B,S,k,d]
    qf = op.Cast(q, to=FLOAT.dtype)                                                  # [B,S,H,d]
    kf = op.Cast(kv, to=FLOAT.dtype)                                                 # [B,T,d]
    heads = op.Reshape(qf, op.Concat(op.Shape(q, start=0, end=1), [-1], op.Shape(q, start=3, end=4), axis=0))
    window_logits = op.Reshape(op.MatMul(heads, op.Transpose(kf, perm=[0, 2, 1])),   # [B,S*H,T]
                               op.Concat(op.Shape(q, start=0, end=3), [-1], axis=0))  # [B,S,H,T]
    chosen_logits = op.MatMul(qf, op.Transpose(chosen, perm=[0, 1, 3, 2]))          # [B,S,H,k]
    logits = op.Concat(window_logits, chosen_logits, axis=-1) * op.CastLike(scale, qf)
    visible = op.Concat(WindowVisible(q_pos, kv_pos, window=window), picked, axis=-1)
    probs = SinkSoftmax(logits, visible, sink)                                       # [B,S,H,T+k]
    T = op.Shape(kv, start=1, end=2)
    window_probs = op.Reshape(op.Slice(probs, [0], T, [-1]), op.Concat(op.Shape(heads, start=0, end=2), [-1],
                                                                         axis=0))   # [B,S*H,T]
    chosen_probs = op.Slice(probs, T, [9223372036854775807], [-1])                   # [B,S,H,k]
    out = op.Reshape(op.MatMul(window_probs, kf), op.Shape(q)) + op.MatMul(chosen_probs, chosen)
    return op.CastLike(out, q)


@script(V4, default_opset=op)
def HcaAttentionPaged(q: FLOAT, q_pos: INT64, kv: FLOAT, kv_pos: INT64, pool: FLOAT, block_table: INT64,
                      new_rows: FLOAT, row_ids: INT64, sink: FLOAT, window: int, ratio: int, scale: float) -> FLOAT:
    rows = PagedRowsDense(pool, block_table, new_rows)
    return HcaAttention(q, q_pos, kv, kv_pos, rows, row_ids, sink, window=window, ratio=ratio, scale=scale)


@script(V4, default_opset=op)
def CsaAttentionPaged(q: FLOAT, q_pos: INT64, kv: FLOAT, kv_pos: INT64, pool: FLOAT, block_table: INT64,
                      new_rows: FLOAT, topk_idx: INT64, sink: FLOAT, window: int, scale: float) -> FLOAT:
    rows = PagedRowsDense(pool, block_table, new_rows)
    return CsaAttention(q, q_pos, kv, kv_pos, rows, topk_idx, sink, window=window, scale=scale)


PLUGIN_FUNCTIONS = (SlidingAttention, HcaAttention, CsaAttention, HcaAttentionPaged, CsaAttentionPaged)
HELPER_FUNCTIONS = (WindowVisible, RowsVisible, SinkSoftmax, AttendWithSink)
