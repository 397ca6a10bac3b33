"""Committed caches for the eager model: builds the read-only views a forward needs and commits its deltas.

This is the builder's small PyTorch twin of the runtime's cache manager: it keeps each sequence's whole
history per layer (simple, and tests are tiny), hands the model exactly the views of the engine contract,
and commits the first n new positions of each row, so that rollback is simply committing fewer.
"""
from __future__ import annotations

import torch

from v4engine.runtime.config import CSA, ROW_GROUPS, SLIDING, V4Config

from .v4 import LayerCache, LayerDelta


class ModelState:
    """Per-sequence histories of every cache of the target (draft=False) or of the MTP layer (draft=True)."""

    def __init__(self, cfg: V4Config, batch: int, draft: bool = False, dtype: torch.dtype = torch.float32):
        self.cfg, self.dtype = cfg, dtype
        self.kinds = [SLIDING] if draft else list(cfg.layer_types)
        self.lengths = [0] * batch
        self.history: list[list[dict[str, torch.Tensor]]] = []
        for kind in self.kinds:
            names = {"window_kv": cfg.head_dim}
            if kind != SLIDING:
                c = 2 * cfg.head_dim if kind == CSA else cfg.head_dim
                names.update(compressor_kv=c, compressor_gate=c, compressed_kv=cfg.head_dim)
            if kind == CSA:
                names.update(indexer_kv=2 * cfg.index_head_dim, indexer_gate=2 * cfg.index_head_dim,
                             index_keys=cfg.index_head_dim)
            self.history.append([{n: torch.zeros(0, w, dtype=dtype) for n, w in names.items()} for _ in range(batch)])

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def positions(self, n_new: int) -> torch.Tensor:
        """[B, n_new] consecutive positions starting at each row's committed length."""
        start = torch.tensor(self.lengths).unsqueeze(1)
        return start + torch.arange(n_new).unsqueeze(0)

    def views(self) -> list[LayerCache]:
        cfg = self.cfg
        out = []
        for kind, rows in zip(self.kinds, self.history):
            view = LayerCache(window_kv=self._last(rows, "window_kv", cfg.sliding_window - 1))
            if kind != SLIDING:
                p = cfg.state_tokens(kind)
                view.compressor_kv = self._last(rows, "compressor_kv", p)
                view.compressor_gate = self._last(rows, "compressor_gate", p)
                view.compressed_kv = self._padded(rows, "compressed_kv")
            if kind == CSA:
                view.indexer_kv = self._last(rows, "indexer_kv", p)
                view.indexer_gate = self._last(rows, "indexer_gate", p)
                view.index_keys = self._padded(rows, "index_keys")
            out.append(view)
        return out

    def commit(self, deltas: list[LayerDelta], n_new: list[int]) -> None:
        """Keep the first n_new[b] new positions of row b (the accepted prefix); drop the rest."""
        for kind, rows, delta in zip(self.kinds, self.history, deltas):
            m = self.cfg.compress_rates.get(kind, 0)
            for b, (row, n) in enumerate(zip(rows, n_new)):
                for name in row:
                    new = getattr(delta, name)
                    if name in ROW_GROUPS:  # rows of windows that closed within the accepted positions
                        n_rows = (self.lengths[b] + n) // m - self.lengths[b] // m
                        new = new[b, :n_rows]
                    else:
                        new = new[b, :n]
                    row[name] = torch.cat([row[name], new.detach().to(self.dtype)])
        self.lengths = [length + n for length, n in zip(self.lengths, n_new)]

    def _last(self, rows: list[dict[str, torch.Tensor]], name: str, count: int) -> torch.Tensor:
        """The rows of the `count` positions before each row's length; zeros before position 0."""
        out = []
        for row in rows:
            hist = row[name][-count:] if count else row[name][:0]
            pad = torch.zeros(count - hist.shape[0], hist.shape[1], dtype=self.dtype)
            out.append(torch.cat([pad, hist]))
        return torch.stack(out)

    def _padded(self, rows: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
        width = rows[0][name].shape[1]
        longest = max(row[name].shape[0] for row in rows)
        return torch.stack([torch.cat([row[name], torch.zeros(longest - row[name].shape[0], width,
                                                                dtype=self.dtype)]) for row in rows])
