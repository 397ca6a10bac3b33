"""DSpark drafting: the drafter of the current V4 releases, one cycle per engine call (builder/model/drafting.py).

DSpark reads the target's `captured` rows (the mean of the hc streams after each of dspark_target_layer_ids) of
every committed position: its graph turns those of the newly committed positions into each stage's context keys
(the rings, W rows: only committed positions ever enter them, never a rejected draft), runs the block
[anchor, noise x (N - 1)] after them, and drafts N tokens left to right through the Markov head, each with a
confidence logit (its chance of surviving given the drafts before it survived; sigmoid in the metrics). The anchor
is the request's last token: the one the target's next verify starts with. A fork recomputes the W positions the
rings hold (graph.py has the cycle every graph drafter shares).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from v4engine.contract.drafting import DSPARK
from v4engine.contract.layout import CAPTURED

from .base import Proposal
from .graph import GraphDrafter


class DSparkDrafter(GraphDrafter):
    spec = DSPARK
    source = CAPTURED
    gives_confidence = True

    @property
    def source_width(self) -> int:
        return DSPARK.captured_width(self.cfg)

    @property
    def snapshot_rows(self) -> int:
        return self.cfg.sliding_window

    def method_feeds(self, requests: list[Any], rows: np.ndarray, lengths: list[int]) -> dict[str, np.ndarray]:
        """The captured rows [B, S, L*D] and each request's anchor [B]: its last token."""
        return {CAPTURED: rows, "anchor": np.array([r.tokens[-1] for r in requests], np.int64)}

    def proposal(self, request: Any, out: dict[str, np.ndarray], b: int) -> Proposal:
        proposal = super().proposal(request, out, b)
        proposal.confidence = 1 / (1 + np.exp(-out["confidence"][b, : len(proposal.tokens)].astype(np.float64)))
        return proposal


__all__ = ["DSparkDrafter"]
