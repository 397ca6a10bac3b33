"""Attention with a per-head sink over the sliding window plus compressed rows (V4_MODEL.md §2.3-2.8).

Three ops share one core: every V4 layer attends to its raw window (the last `window` positions,
itself included); HCA layers add every compressed row already closed; CSA layers add only the rows
the lightning indexer picked. K = V (MQA, one head shared by all query heads). The sink is one extra
logit per head that appears only in the softmax denominator.

Shapes: q [B,S,H,d]; q_pos [B,S]; kv [B,T,d] window keys with kv_pos [B,T] (-1 = empty slot);
rows [B,R,d] compressed rows with row_ids [B,R] (window index, -1 = empty slot).
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def window_bias(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[B,S,T] additive mask: key p is visible to query t iff t - window < p <= t (and p >= 0)."""
    t = q_pos.unsqueeze(-1)
    p = kv_pos.unsqueeze(-2)
    visible = (p <= t) & (p > t - window) & (p >= 0)
    return torch.zeros(visible.shape, dtype=torch.float32, device=q_pos.device).masked_fill(~visible, NEG_INF)


def attend_with_sink(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax([q.k * scale + bias, sink]) @ keys, the sink column dropped. keys: [B,S|1,T,d]; bias [B,S,T]."""
    qf = q.float()
    kf = keys.float()
    if kf.dim() == 3:  # keys shared by every query of the row
        logits = torch.einsum("bshd,btd->bsht", qf, kf)
    else:  # keys chosen per query
        logits = torch.einsum("bshd,bstd->bsht", qf, kf)
    logits = logits * scale + bias.unsqueeze(2)
    sinks = sink.float().view(1, 1, -1, 1).expand(logits.shape[0], logits.shape[1], -1, 1)
    combined = torch.cat([logits, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    if kf.dim() == 3:
        out = torch.einsum("bsht,btd->bshd", probs, kf)
    else:
        out = torch.einsum("bsht,bstd->bshd", probs, kf)
    return out.to(q.dtype)


def sliding_attention(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                      sink: torch.Tensor, *, window: int, scale: float) -> torch.Tensor:
    """v4::SlidingAttention: the window only (sliding layers and the MTP layer)."""
    return attend_with_sink(q, kv, window_bias(q_pos, kv_pos, window), sink, scale)


def hca_attention(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                  rows: torch.Tensor, row_ids: torch.Tensor, sink: torch.Tensor, *, window: int, ratio: int,
                  scale: float) -> torch.Tensor:
    """v4::HcaAttention: the window plus every compressed row w with w < (t+1) // ratio."""
    visible = (row_ids.unsqueeze(-2) >= 0) & (row_ids.unsqueeze(-2) < torch.div(q_pos + 1, ratio,
                                                                                 rounding_mode="floor").unsqueeze(-1))
    row_bias = torch.zeros(visible.shape, dtype=torch.float32, device=q.device).masked_fill(~visible, NEG_INF)
    keys = torch.cat([kv, rows], dim=1)
    bias = torch.cat([window_bias(q_pos, kv_pos, window), row_bias], dim=-1)
    return attend_with_sink(q, keys, bias, sink, scale)


def csa_attention(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                  rows: torch.Tensor, topk_idx: torch.Tensor, sink: torch.Tensor, *, window: int,
                  scale: float) -> torch.Tensor:
    """v4::CsaAttention: the window plus the compressed rows the indexer picked (topk_idx [B,S,k], -1 = none)."""
    B, S, k = topk_idx.shape
    picked = topk_idx >= 0
    gather = topk_idx.clamp(min=0).reshape(B, S * k, 1).expand(-1, -1, rows.shape[-1])
    chosen = torch.gather(rows, 1, gather).reshape(B, S, k, rows.shape[-1])
    window_keys = kv.unsqueeze(1).expand(-1, S, -1, -1)
    keys = torch.cat([window_keys, chosen], dim=2)
    row_bias = torch.zeros(picked.shape, dtype=torch.float32, device=q.device).masked_fill(~picked, NEG_INF)
    bias = torch.cat([window_bias(q_pos, kv_pos, window), row_bias], dim=-1)
    return attend_with_sink(q, keys, bias, sink, scale)
