"""Compressed rows and index keys as the graphs see them: in the runtime's block pools, then a call's new rows.

The runtime keeps the rows that grow (compressed rows, index keys) in pools of blocks (runtime/cache.py); a graph
reads a sequence's through its row of the block table, and appends the rows its own positions close, which no
pool holds yet (the graphs never write pools). `PagedRows` is that pair, and the attention and indexer ops take
it where they take dense rows: under export it becomes a paged node (`v4::HcaAttentionPaged`, ...) whose TensorRT
plugin reads the pool in place (plugins/kernels/paging.py) and whose ONNX function first gathers the dense rows
(`PagedRowsDense`), which is what ONNX Runtime and MIGraphX run; in eager code it is gathered the same way.

Logical row r of batch row b: block_table[b, r // page_rows] row r % page_rows for r < W * page_rows (past a
sequence's own count those rows are masked by their ids), then new row r - W * page_rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from onnxscript import FLOAT, INT64, script

from .common import V4, op


@dataclass(frozen=True)
class PagedRows:
    """A batch's rows in a block pool [blocks, page_rows, C] through block_table [B, W], then `new` [B, N, C]
    (None until a layer appends the rows of its call)."""

    pool: torch.Tensor
    block_table: torch.Tensor
    new: torch.Tensor | None = None

    @property
    def past(self) -> int | torch.SymInt:
        """Rows the table addresses: W * page_rows."""
        return self.block_table.shape[1] * self.pool.shape[1]

    def dense(self) -> torch.Tensor:
        """[B, W * page_rows + N, C]: the rows gathered (one Gather, as PagedRowsDense does)."""
        page = self.pool.shape[1]
        r = torch.arange(self.past, device=self.pool.device)
        rows = F.embedding(self.block_table[:, r // page] * page + r % page, self.pool.reshape(-1, self.pool.shape[2]))
        return rows if self.new is None else torch.cat([rows, self.new], dim=1)


def append_rows(past: torch.Tensor | PagedRows, new: torch.Tensor) -> torch.Tensor | PagedRows:
    """A layer's rows: the cached ones (dense, or paged) then those its call closed."""
    if isinstance(past, PagedRows):
        return replace(past, new=new)
    return torch.cat([past, new], dim=1)


def row_count(rows: torch.Tensor | PagedRows) -> int | torch.SymInt:
    """Rows of a batch row, dense or paged (the paged: table rows, then new ones)."""
    if isinstance(rows, PagedRows):
        return rows.past + (0 if rows.new is None else rows.new.shape[1])
    return rows.shape[1]


@script(V4, default_opset=op)
def PagedRowsDense(pool: FLOAT, block_table: INT64, new_rows: FLOAT) -> FLOAT:
    page = op.Shape(pool, start=1, end=2)
    past = op.Squeeze(op.Mul(op.Shape(block_table, start=1, end=2), page))
    r = op.Range(op.CastLike(0, past), past, op.CastLike(1, past))
    index = op.Gather(block_table, op.Div(r, page), axis=1) * page + op.Mod(r, page)                  # [B, W*page]
    flat = op.Reshape(pool, op.Concat(op.Constant(value_ints=[-1]), op.Shape(pool, start=2, end=3), axis=0))
    return op.Concat(op.Gather(flat, index, axis=0), new_rows, axis=1)


HELPER_FUNCTIONS = (PagedRowsDense,)
