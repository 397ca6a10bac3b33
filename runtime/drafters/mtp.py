"""MTP drafting: V4's one-layer MTP module, a whole draft cycle per engine call (builder/model/drafting.py).

The MTP layer at position i reads the target's streams H_i and the next token t_{i+1}, and keeps a window ring of
its own. Each cycle runs DRAFT-EXTEND over the positions the target committed since the last cycle; its last row
gives d1, then k - 1 more steps on the layer's own streams give d2..dk. Only the extend's rows are committed: the
drafts' own rows never are (the next cycle rewrites those positions from the target's true streams). A fork
recomputes the W - 1 positions of the window it reads (graph.py has the cycle every graph drafter shares).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from v4engine.contract.drafting import MTP
from v4engine.contract.layout import STREAMS

from .graph import GraphDrafter


class MtpDrafter(GraphDrafter):
    spec = MTP
    source = STREAMS

    @property
    def source_width(self) -> int:
        return self.cfg.hc_mult * self.cfg.hidden_size

    @property
    def snapshot_rows(self) -> int:
        return self.cfg.sliding_window - 1

    def method_feeds(self, requests: list[Any], rows: np.ndarray, lengths: list[int]) -> dict[str, np.ndarray]:
        """The streams [B, S, hc, D] and, beside each, the token after its position [B, S]."""
        ids = np.zeros(rows.shape[:2], np.int64)
        for b, (r, n) in enumerate(zip(requests, lengths)):
            start = r.draft_state.cache.length + 1
            ids[b, :n] = r.tokens[start: start + n]
        return {STREAMS: rows, "input_ids": ids}


__all__ = ["MtpDrafter"]
