"""Committed caches for the eager model: builds the read-only views a forward needs and commits its deltas.

This is the builder's small PyTorch twin of the runtime's cache manager: it keeps each sequence's whole
history per layer (simple, and tests are tiny), hands the model exactly the views of the engine contract,
and commits the first n new positions of each row, so that rollback is simply committing fewer.
"""
from __future__ import annotations

import numpy as np
import torch

from v4engine.contract.config import V4Config
from v4engine.contract.drafting import MTP
from v4engine.contract.layout import CacheLayout, closed_windows
from v4engine.runtime.cache import CachePool, SequenceCache
from v4engine.runtime.pool_arrays import HostArrays

from .v4 import LayerCache, LayerDelta


class ModelState:
    """Per-sequence histories of every cache of the target (draft=False) or of the MTP layer (draft=True)."""

    def __init__(self, cfg: V4Config, batch: int, draft: bool = False, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.layout = layout = MTP.layout(cfg) if draft else CacheLayout.target(cfg)
        self.layers = [layout.of_layer(layer) for layer in dict.fromkeys(g.layer for g in layout.groups)]
        self.lengths = [0] * batch
        self.history: list[list[dict[str, torch.Tensor]]] = [
            [{g.name: torch.zeros(0, g.width, dtype=dtype, device=self.device) for g in groups} for _ in range(batch)]
            for groups in self.layers]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def positions(self, n_new: int) -> torch.Tensor:
        """[B, n_new] consecutive positions starting at each row's committed length."""
        start = torch.tensor(self.lengths, device=self.device).unsqueeze(1)
        return start + torch.arange(n_new, device=self.device).unsqueeze(0)

    def views(self) -> list[LayerCache]:
        """What a forward reads of each layer: the rows the layout's view holds, compressed rows padded."""
        out = []
        for groups, rows in zip(self.layers, self.history):
            view = {g.name: self._padded(rows, g.name) if g.ratio else self._last(rows, g.name, g.rows_fixed)
                    for g in groups}
            out.append(LayerCache(**view))
        return out

    def pool_feeds(self, dtype: str = "fp32") -> dict[str, np.ndarray]:
        """The same caches as an engine call reads them: the runtime's pools (runtime/cache.py) holding every row's
        history, with their `slots` and `block_table`."""
        pool = CachePool(self.layout, self.batch, max(1, self.batch * self.layout.blocks_for(max(self.lengths))),
                         HostArrays(dtype))
        sequences = []
        for b, length in enumerate(self.lengths):
            sequence = SequenceCache(pool)
            sequence.reserve(length)
            sequence.commit({g.pool: rows[b][g.name].cpu().numpy() for groups, rows in zip(self.layers, self.history)
                             for g in groups}, length)
            sequences.append(sequence)
        return pool.feeds(sequences)

    def commit(self, deltas: list[LayerDelta], n_new: list[int]) -> None:
        """Keep the first n_new[b] new positions of row b (the accepted prefix); drop the rest."""
        for groups, rows, delta in zip(self.layers, self.history, deltas):
            for b, (row, n) in enumerate(zip(rows, n_new)):
                for g in groups:
                    new = getattr(delta, g.name)
                    kept = closed_windows(self.lengths[b], n, g.ratio) if g.ratio else n
                    row[g.name] = torch.cat([row[g.name], new[b, :kept].detach().to(self.dtype)])
        self.lengths = [length + n for length, n in zip(self.lengths, n_new)]

    def _last(self, rows: list[dict[str, torch.Tensor]], name: str, count: int) -> torch.Tensor:
        """The rows of the `count` positions before each row's length; zeros before position 0."""
        out = []
        for row in rows:
            hist = row[name][-count:] if count else row[name][:0]
            pad = torch.zeros(count - hist.shape[0], hist.shape[1], dtype=self.dtype, device=self.device)
            out.append(torch.cat([pad, hist]))
        return torch.stack(out)

    def _padded(self, rows: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
        width = rows[0][name].shape[1]
        longest = max(row[name].shape[0] for row in rows)
        return torch.stack([torch.cat([row[name], torch.zeros(longest - row[name].shape[0], width, dtype=self.dtype,
                                                                device=self.device)]) for row in rows])
