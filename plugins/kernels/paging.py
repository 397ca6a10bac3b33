"""Reading rows through a block table: the paged form of the kernels' compressed rows and index keys.

The runtime keeps every growing cache group in a pool of blocks, PAGE_ROWS rows each (runtime/cache.py); a
sequence's row r lives in block table[r // PAGE_ROWS], at row r % PAGE_ROWS. A call also has the rows its own
positions closed, which no pool holds yet (the graphs never write pools). So a paged kernel sees, for batch row
b, the W * PAGE_ROWS rows its table addresses (`past`; past a sequence's own count they are masked by their ids)
and then its N new rows [B, N, width]: logical row r is pool row table[b, r // PAGE_ROWS] * PAGE_ROWS +
r % PAGE_ROWS when r < past, else new row r - past. That is the order of the dense rows the graph would
otherwise gather and concatenate, so the kernels read exactly the rows the dense kernels read, in the same
order, with one int64 table load per row from a table of a few KiB that stays in L1/L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def paged_row_tile(pool, table, new, rows, mask, past, dims, PAGE_ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Pointers [rows, dims] to the logical `rows` of one sequence: `table` its row of the block table, `new` its
    first new row, `past` = W * PAGE_ROWS. Rows where `mask` is off point somewhere harmless: they are never
    loaded.
    Each row starts on 16 bytes when a row is a multiple of 16 bytes (see attention._row_tile)."""
    in_pool = rows < past
    block = tl.load(table + rows // PAGE_ROWS, mask=mask & in_pool, other=0)
    pooled = (block * PAGE_ROWS + rows % PAGE_ROWS).to(tl.int64)
    fresh = tl.maximum(rows - past, 0).to(tl.int64)
    starts = tl.where(in_pool, pool + pooled * WIDTH, new + fresh * WIDTH)
    ptrs = starts[:, None] + dims[None, :]
    if (WIDTH * pool.dtype.element_ty.primitive_bitwidth) % 128 == 0:
        ptrs = tl.multiple_of(ptrs, [16, 16])
    return ptrs


def page(rows: torch.Tensor, page_rows: int, generator: torch.Generator | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool, block_table) holding dense rows [B, R, width] as a runtime pool would: each sequence's blocks in a
    shuffled order, one spare block, the last block's tail and the spare zero."""
    B, R, width = rows.shape
    per_row = -(-R // page_rows)
    order = torch.randperm(B * per_row + 1, generator=generator, device="cpu").to(rows.device)
    table = order[: B * per_row].view(B, per_row)
    pool = torch.zeros(B * per_row + 1, page_rows, width, dtype=rows.dtype, device=rows.device)
    padded = torch.zeros(B, per_row * page_rows, width, dtype=rows.dtype, device=rows.device)
    padded[:, :R] = rows
    pool[table.flatten()] = padded.view(B * per_row, page_rows, width)
    return pool, table


def split_paged(rows: torch.Tensor, page_rows: int, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pool, block_table, new rows) for dense rows [B, R, width] (R > 0): as many whole blocks of past rows as
    leave at least one new row, so that the paged kernel's logical rows are the dense ones, index for index. The
    tests' and the GPU check's way to give a paged kernel the rows a dense kernel reads."""
    past = page_rows * ((rows.shape[1] - 1) // page_rows)
    return *page(rows[:, :past], page_rows, generator), rows[:, past:].contiguous()
