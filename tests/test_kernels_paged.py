"""The paged kernels (HCA and CSA attention, the indexer's top-k) read compressed rows and index keys from a block
pool through a block table, as the runtime lays them out, and compute exactly what the dense kernels compute on
the same rows: bit for bit (the same tiles in the same order), and so within the references' tolerance.

Without a GPU they run in Triton's interpreter (conftest.py); test_gpu_kernels.py judges them against the
references at V4-Flash sizes on a GPU, and test_kernels_aot.py compiles their plans for sm90/sm100.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from v4engine.plugins.kernels import catalog  # noqa: E402
from v4engine.plugins.kernels.paging import page, split_paged  # noqa: E402
from v4engine.plugins.paging import PagedRows  # noqa: E402
from v4engine.testkit.numerics import (PAGED, Draw, as_fp32, dense_inputs, judge, kernel,  # noqa: E402
                                               make_inputs, op_attrs, query_positions, reference)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TINY = catalog.SIZES["tiny"]


def test_a_paged_pool_holds_the_rows_in_shuffled_blocks_and_gives_them_back():
    rows = torch.randn(3, 13, 4)
    pool, table = page(rows, 5, torch.Generator().manual_seed(1))
    assert pool.shape == (3 * 3 + 1, 5, 4) and table.shape == (3, 3)
    assert len(set(table.flatten().tolist())) == 9                          # each block once, one spare
    assert torch.equal(PagedRows(pool, table).dense()[:, :13], rows)
    assert torch.equal(PagedRows(pool, table).dense()[:, 13:], torch.zeros(3, 2, 4))
    pool, table, new = split_paged(rows, 5)                                 # whole blocks, then new rows
    assert table.shape == (3, 2) and new.shape == (3, 3, 4)
    assert torch.equal(PagedRows(pool, table, new).dense(), rows)


@pytest.mark.parametrize("op", sorted(PAGED))
@pytest.mark.parametrize("B, S", [(3, 1), (2, 20)], ids=["decode", "prefill"])
def test_a_paged_kernel_computes_bit_for_bit_what_its_dense_kernel_computes(op, B, S):
    draw = Draw(DEVICE, seed=4)
    inputs = make_inputs(op, TINY, query_positions(TINY, B, S, draw), draw)
    attrs = op_attrs(op, TINY)
    got = kernel(op)(*inputs.values(), **attrs)
    dense = dense_inputs(op, inputs)
    assert torch.equal(got, kernel(PAGED[op])(*dense.values(), **attrs))
    verdict = judge(op, got, reference(op)(*as_fp32(inputs).values(), **attrs), inputs, attrs)
    assert verdict.ok, verdict


def test_the_block_table_is_what_is_read():
    """A wrong table (batch row 0 pointed at row 1's block) changes what row 0 sees, and only row 0."""
    op = "hca_attention_paged"
    draw = Draw(DEVICE, seed=6)
    inputs = make_inputs(op, TINY, query_positions(TINY, 2, 1, draw, at_end=True), draw, holes=False)
    attrs = op_attrs(op, TINY)
    right = kernel(op)(*inputs.values(), **attrs)
    table = inputs["block_table"].clone()
    table[0, 0] = table[1, 0]
    wrong = kernel(op)(*(inputs | {"block_table": table}).values(), **attrs)
    assert not torch.equal(right[0], wrong[0]) and torch.equal(right[1], wrong[1])


@pytest.mark.parametrize("op", sorted(PAGED))
@pytest.mark.parametrize("blocks, new", [(0, 4), (3, 0), (3, 2)], ids=["no-block-yet", "no-new-rows", "both"])
def test_a_paged_kernel_reads_the_runtime_layout_and_nothing_it_masks(op, blocks, new):
    """As the runtime lays a batch out: row 0's last block only partly filled, row 1's table one block shorter and
    padded with its own last block, no table at all before a block is full (W = 0), no new rows when no window
    closed (N = 0). What the ids mask (the partial block's tail, the padding) holds garbage: the paged kernel
    gives exactly what the dense kernel gives on the same rows with that garbage zeroed."""
    dense_op = PAGED[op]
    page_rows = catalog.page_rows(TINY, op)
    logical = blocks * page_rows + new
    rows_name = "keys" if dense_op == "indexer_topk" else "rows"
    z = SimpleNamespace(**vars(TINY) | {"hca_rows": logical, "csa_rows": logical, "topk": min(TINY.topk, logical)})
    draw = Draw(DEVICE, seed=9)
    inputs = make_inputs(dense_op, z, query_positions(z, 2, 1, draw, at_end=True), draw, holes=False)
    rows = inputs[rows_name]
    B = rows.shape[0]
    garbage = torch.zeros(B, logical, dtype=torch.bool, device=DEVICE)
    if blocks:
        garbage[0, blocks * page_rows - 2: blocks * page_rows] = True        # row 0: its last block's tail
        garbage[1, (blocks - 1) * page_rows: blocks * page_rows] = True      # row 1: padding
    pool, table, new_rows = split_paged_exactly(rows, blocks, page_rows)
    if blocks:
        table[1, -1] = table[1, -2]                                         # padded with its own last block
    ids_name = {"hca_attention": "row_ids", "csa_attention": "topk_idx", "indexer_topk": "key_ids"}[dense_op]
    ids = inputs[ids_name]
    if ids_name == "topk_idx":                                              # no pick of a masked row
        picked_garbage = torch.gather(garbage.unsqueeze(1).expand(-1, ids.shape[1], -1), 2, ids.clamp(min=0))
        ids = ids.masked_fill(picked_garbage & (ids >= 0), -1)
    else:
        ids = ids.masked_fill(garbage, -1)
    paged = {}
    for name, value in inputs.items():
        if name == rows_name:
            paged |= {"pool": pool, "block_table": table, "new_keys" if rows_name == "keys" else "new_rows": new_rows}
        else:
            paged[name] = ids if name == ids_name else value
    clean = inputs | {rows_name: rows.masked_fill(garbage.unsqueeze(-1), 0.0), ids_name: ids}
    attrs = op_attrs(op, z)
    assert torch.equal(kernel(op)(*paged.values(), **attrs), kernel(dense_op)(*clean.values(), **attrs))


def split_paged_exactly(rows: torch.Tensor, blocks: int, page_rows: int):
    """(pool, block_table, new rows): the first `blocks` blocks of rows paged (a shuffled pool of the batch's
    blocks and one spare, garbage-free), the rest new rows, whatever their count."""
    past = blocks * page_rows
    if blocks:
        pool, table = page(rows[:, :past], page_rows, torch.Generator().manual_seed(3))
    else:
        pool = torch.randn(1, page_rows, rows.shape[2], dtype=rows.dtype, device=rows.device)
        table = torch.zeros(rows.shape[0], 0, dtype=torch.int64, device=rows.device)
    return pool, table, rows[:, past:].contiguous()
