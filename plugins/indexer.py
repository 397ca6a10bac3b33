"""Lightning indexer top-k (V4_MODEL.md §2.7): which compressed rows each CSA query attends to.

score[t, r] = sum_h weights[t,h] * ReLU(q[t,h] . key[r]) * scale over the rows visible to t
(0 <= row_id < (t+1) // ratio). The top min(topk, R) rows are kept, ties broken by LOWEST slot index
(rows are stored in window order, so lowest window wins) in every realisation: ReLU makes whole rows
of scores exactly 0, and an unstable top-k would select different rows in prefill and decode
(DESIGN.md). Picks that are not visible come back as -1.
"""
from __future__ import annotations

import torch


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_ids: torch.Tensor,
                 q_pos: torch.Tensor, *, topk: int, ratio: int, scale: float) -> torch.Tensor:
    """v4::IndexerTopK. q [B,S,h,dI]; weights [B,S,h]; keys [B,R,dI]; key_ids [B,R]; q_pos [B,S] -> [B,S,k] int64."""
    scores = torch.relu(torch.einsum("bshd,brd->bshr", q.float(), keys.float())) * scale
    scores = (scores * weights.float().unsqueeze(-1)).sum(dim=2)                    # [B,S,R]
    limit = torch.div(q_pos + 1, ratio, rounding_mode="floor").unsqueeze(-1)
    ids = key_ids.unsqueeze(1)
    visible = (ids >= 0) & (ids < limit)
    scores = scores.masked_fill(~visible, float("-inf"))
    k = min(topk, keys.shape[1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen_visible = torch.gather(visible, -1, order)
    return torch.where(chosen_visible, order, torch.full_like(order, -1))
