"""The paged kernels (HCA and CSA attention, the indexer's top-k) read compressed rows and index keys from a block
pool through a block table, as the runtime lays them out, and compute exactly what the dense kernels compute on
the same rows: bit for bit (the same tiles in the same order), and so within the references' tolerance.

Without a GPU they run in Triton's interpreter (conftest.py); test_gpu_kernels.py judges them against the
references at V4-Flash sizes on a GPU, and test_kernels_aot.py compiles their plans for sm90/sm100.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from v4engine.plugins.kernels import catalog  # noqa: E402
from v4engine.plugins.kernels.numerics import (PAGED, Draw, as_fp32, dense_inputs, judge, kernel,  # noqa: E402
                                               make_inputs, op_attrs, query_positions, reference)
from v4engine.plugins.kernels.paging import page, split_paged, unpage  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TINY = catalog.SIZES["tiny"]


def test_a_paged_pool_holds_the_rows_in_shuffled_blocks_and_gives_them_back():
    rows = torch.randn(3, 13, 4)
    pool, table = page(rows, 5, torch.Generator().manual_seed(1))
    assert pool.shape == (3 * 3 + 1, 5, 4) and table.shape == (3, 3)
    assert len(set(table.flatten().tolist())) == 9                          # each block once, one spare
    assert torch.equal(unpage(pool, table)[:, :13], rows)
    assert torch.equal(unpage(pool, table)[:, 13:], torch.zeros(3, 2, 4))
    pool, table, new = split_paged(rows, 5)                                 # whole blocks, then new rows
    assert table.shape == (3, 2) and new.shape == (3, 3, 4)
    assert torch.equal(torch.cat([unpage(pool, table), new], 1), rows)


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
