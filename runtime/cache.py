"""Grouped caches with exact rollback: one preallocated buffer per cache group per sequence.

Groups and their sizes come from the cache layout (runtime/layout.py): the sliding window and the compressor's
partial windows are rings of `rows_fixed` rows indexed by position (at least window + k slots, so a
rolled-back draft tail never overwrites a row a later query still sees); compressed rows and index keys grow
one row per `ratio` tokens up to the sequence's capacity. The engine never writes caches: it returns deltas,
and `commit(n)` keeps the first n new positions. Rollback is committing fewer.
"""
from __future__ import annotations

import numpy as np

from .config import V4Config
from .layout import CacheGroup, closed_windows

NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16}


class SequenceCache:
    """All cache groups of one part (target or draft) of one sequence, sized for `capacity` tokens."""

    def __init__(self, cfg: V4Config, groups: list[CacheGroup], capacity: int, dtype: type):
        self.cfg, self.groups, self.capacity = cfg, groups, capacity
        self.length = 0
        self.buffers = {(g.layer, g.name): np.zeros((g.rows_for(capacity), g.width), dtype=dtype) for g in groups}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def past(self, group: CacheGroup) -> np.ndarray:
        """What the engine reads for `group`: the last rows before `length` (zeros before position 0), or the
        compressed rows closed so far."""
        buf = self.buffers[(group.layer, group.name)]
        if group.ratio:
            return buf[: self.length // group.ratio]
        n = group.view_rows
        positions = np.arange(self.length - n, self.length)
        rows = buf[positions % buf.shape[0]]
        rows[positions < 0] = 0
        return rows

    def commit(self, deltas: dict[tuple[int, str], np.ndarray], n: int) -> None:
        """Append the first n new positions (deltas of this sequence's row, per group)."""
        if self.length + n > self.capacity:
            raise ValueError(f"cache overflow: {self.length} + {n} > capacity {self.capacity}")
        for g in self.groups:
            new = deltas[(g.layer, g.name)]
            buf = self.buffers[(g.layer, g.name)]
            if g.ratio:      # the rows of windows closed within the committed positions
                first, closed = self.length // g.ratio, closed_windows(self.length, n, g.ratio)
                buf[first:first + closed] = new[:closed]
            else:      # only the last ring-size positions survive a long chunk: write just those, once each
                keep = min(n, buf.shape[0])
                buf[np.arange(self.length + n - keep, self.length + n) % buf.shape[0]] = new[n - keep:n]
        self.length += n


def batch_views(caches: list[SequenceCache], groups: list[CacheGroup]) -> dict[str, np.ndarray]:
    """The `past.*` inputs of one engine call over these sequences (compressed rows padded)."""
    feeds = {}
    for g in groups:
        parts = [c.past(g) for c in caches]
        if g.ratio:
            rows = max(p.shape[0] for p in parts)
            parts = [np.concatenate([p, np.zeros((rows - p.shape[0], g.width), p.dtype)]) if p.shape[0] < rows else p
                     for p in parts]
        feeds[g.past] = np.stack(parts)
    return feeds
