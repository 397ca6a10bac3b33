"""Reading rows through a block table: the paged form of the kernels' compressed rows and index keys.

The runtime keeps every growing cache group in a pool of blocks, PAGE_ROWS rows each (runtime/cache.py); a
sequence's logical row r lives in block table[r // PAGE_ROWS], at row r % PAGE_ROWS. A paged kernel takes the
pool [blocks, PAGE_ROWS, width] and the sequence's row of the table [B, W] where a dense one takes the rows
[B, R, width], and maps each logical row it loads to its pool row here: one int64 table load per row, from a
table of a few KiB that stays in L1/L2, so the rows themselves move exactly as in the dense kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def pool_rows(table, rows, mask, PAGE_ROWS: tl.constexpr):
    """Pool row indices (int64) of the logical `rows` of one sequence, `table` its row of the block table;
    0 where `mask` is off (never loaded)."""
    block = tl.load(table + rows // PAGE_ROWS, mask=mask, other=0)
    return block * PAGE_ROWS + rows % PAGE_ROWS


def page(rows: torch.Tensor, page_rows: int, generator: torch.Generator | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool, block_table) holding dense rows [B, R, width] as a runtime pool would: each sequence's blocks in a
    shuffled order, one spare block, the last block's tail and the spare zero. The tests' and the GPU check's way
    to give a paged kernel the rows a dense kernel reads."""
    B, R, width = rows.shape
    per_row = -(-R // page_rows)
    order = torch.randperm(B * per_row + 1, generator=generator, device="cpu").to(rows.device)
    table = order[: B * per_row].view(B, per_row)
    pool = torch.zeros(B * per_row + 1, page_rows, width, dtype=rows.dtype, device=rows.device)
    padded = torch.zeros(B, per_row * page_rows, width, dtype=rows.dtype, device=rows.device)
    padded[:, :R] = rows
    pool[table.flatten()] = padded.view(B * per_row, page_rows, width)
    return pool, table


def unpage(pool: torch.Tensor, block_table: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """The dense rows [B, R, width] a block table addresses in a pool (all its blocks' rows when `rows` is None):
    what a paged kernel reads, for its reference."""
    dense = pool[block_table].flatten(1, 2)
    return dense if rows is None else dense[:, :rows]
