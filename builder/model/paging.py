"""Reading the runtime's cache pools inside the graphs (runtime/layout.py, engine contract v5).

The model's layers take dense views (LayerCache: a window of W - 1 rows, compressed rows 0..R-1); the graphs take
the pools the runtime keeps and build those views first, as gathers: a graph call reads the rows it attends to
where they already are, and nothing of a sequence's history is copied on the host to make a call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class PoolReader:
    """The dense views of one call's rows, from pools of ring slots ([slots, R, C]: a position's row at index
    position % R of its slot) and of blocks ([blocks, block_rows, C], in each row's `block_table` order).

    Pools of one shape share their row indices: the exported graph computes them once per ring size and block
    size, not once per group (three fewer nodes a group, and a faster export)."""

    def __init__(self, slots: torch.Tensor, start: torch.Tensor, block_table: torch.Tensor | None = None):
        self.slots, self.start, self.block_table = slots, start, block_table
        self._rings: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._blocks: dict[int, torch.Tensor] = {}

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

    def blocks(self, pool: torch.Tensor) -> torch.Tensor:
        """[B, blocks * block_rows, C]: each row's blocks in table order. Rows past a sequence's own count are
        whatever its last block or the padding holds: the layers mask them by position (past_row_ids), as they
        masked the zero padding of a dense batch."""
        block_rows = pool.shape[1]
        if block_rows not in self._blocks:
            r = torch.arange(self.block_table.shape[1] * block_rows, device=pool.device)
            self._blocks[block_rows] = self.block_table[:, r // block_rows] * block_rows + r % block_rows
        return _gather_rows(pool, self._blocks[block_rows])


def _gather_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B, N, C]: rows `index` [B, N] of the pool's rows. As an embedding lookup it exports as one ONNX Gather;
    advanced indexing would export as GatherND with transposes and expands around it."""
    return F.embedding(index, pool.reshape(-1, pool.shape[2]))
