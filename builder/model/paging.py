"""Reading the runtime's cache pools inside the graphs (contract/layout.py, engine contract v5).

The model's layers take cache views (LayerCache); the graphs take the pools the runtime keeps. Rings (windows,
compressors' partial windows: a few rows per slot) become dense views by one gather each. The rows that grow
(compressed rows, index keys) stay where they are: the layers get them as PagedRows (plugins/paging.py), pool and
block table, which the attention and indexer ops read in place (their TensorRT plugins through the table; their
ONNX functions by a gather). Nothing of a sequence's history is copied on the host to make a call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from v4engine.plugins.paging import PagedRows


class PoolReader:
    """One call's cache views: dense rings from pools of ring slots ([slots, R, C]: a position's row at index
    position % R of its slot), PagedRows of pools of blocks ([blocks, block_rows, C], through `block_table`).

    Rings of one size share their row indices: the exported graph computes them once per ring size, not once per
    group (three fewer nodes a group, and a faster export)."""

    def __init__(self, slots: torch.Tensor, start: torch.Tensor, block_table: torch.Tensor | None = None):
        self.slots, self.start, self.block_table = slots, start, block_table
        self._rings: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def ring(self, pool: torch.Tensor) -> torch.Tensor:
        """[B, R, C]: the rows of positions start-R .. start-1, zeros for positions before 0."""
        size = pool.shape[1]
        if size not in self._rings:
            positions = self.start.unsqueeze(1) - size + torch.arange(size, device=pool.device).unsqueeze(0)
            index = self.slots.unsqueeze(1) * size + torch.remainder(positions, size)          # [B, R]
            self._rings[size] = index, (positions >= 0).unsqueeze(-1)
        index, real = self._rings[size]
        rows = _gather_rows(pool, index)
        return torch.where(real, rows, torch.zeros_like(rows))

    def blocks(self, pool: torch.Tensor) -> PagedRows:
        """Each row's blocks in table order, read in place by the ops. Rows past a sequence's own count are
        whatever its last block or the padding holds: the layers mask them by position (past_row_ids), as they
        masked the zero padding of a dense batch."""
        return PagedRows(pool, self.block_table)


def _gather_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B, N, C]: rows `index` [B, N] of the pool's rows. As an embedding lookup it exports as one ONNX Gather;
    advanced indexing would export as GatherND with transposes and expands around it."""
    return F.embedding(index, pool.reshape(-1, pool.shape[2]))
