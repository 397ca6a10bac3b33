"""Compressor emission (V4_MODEL.md §2.6-2.8): gated pooling of per-token values into compressed rows.

Each token t contributes a value c_t and a gate z_t (+ ape[t mod m]). Window w covers positions
m*w .. m*w+m-1 and closes at its last token. HCA pools one window; CSA (`overlap`) pools 2m slots:
the first half (Ca) of window w-1 and the second half (Cb) of window w. The softmax runs over the
slots, per channel; slots at negative positions have weight 0.

The op sees a buffer of per-token values for consecutive positions `first_pos .. first_pos+L-1`
(the state tokens the cache kept, then the new ones) and emits the rows of the windows that close
inside the new tokens: E = ceil(S/m) slots, row i being window first_new // m + i, with row_ids = -1
where that window does not close inside the buffer.
"""
from __future__ import annotations

import torch


def compressor_pool(kv: torch.Tensor, gate: torch.Tensor, first_pos: torch.Tensor, *, ratio: int, overlap: bool,
                    state_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v4::CompressorPool. kv, gate: [B, P+S, C] with P = state_tokens; first_pos [B] = position of slot 0.

    Returns pooled rows [B, E, C/2 if overlap else C] (before norm and rope) and row_ids [B, E].
    """
    B, L, C = kv.shape
    m = ratio
    n_new = L - state_tokens
    E = (n_new + m - 1) // m
    start = first_pos + state_tokens                                  # position of the first new token
    first_window = torch.div(start, m, rounding_mode="floor")          # [B]
    windows = first_window.unsqueeze(1) + torch.arange(E, device=kv.device).unsqueeze(0)   # [B,E]
    closes_at = windows * m + (m - 1)
    row_ids = torch.where(closes_at <= first_pos.unsqueeze(1) + (L - 1), windows, torch.full_like(windows, -1))

    width = 2 * m if overlap else m
    slot_start = (windows - 1) * m if overlap else windows * m          # position of each row's first slot
    slot_pos = slot_start.unsqueeze(-1) + torch.arange(width, device=kv.device)      # [B,E,width]
    index = (slot_pos - first_pos.view(B, 1, 1)).clamp(0, L - 1)
    flat = index.reshape(B, E * width, 1).expand(-1, -1, C)
    slot_kv = torch.gather(kv, 1, flat).reshape(B, E, width, C)
    slot_gate = torch.gather(gate, 1, flat).reshape(B, E, width, C)
    if overlap:
        d = C // 2
        slot_kv = torch.cat([slot_kv[:, :, :m, :d], slot_kv[:, :, m:, d:]], dim=2)
        slot_gate = torch.cat([slot_gate[:, :, :m, :d], slot_gate[:, :, m:, d:]], dim=2)
    slot_gate = slot_gate.float().masked_fill((slot_pos < 0).unsqueeze(-1), float("-inf"))
    weights = torch.softmax(slot_gate, dim=2).to(kv.dtype)
    return (slot_kv * weights).sum(dim=2), row_ids
