"""(a) of the GPU check: every op of plugins/kernels through its torch launcher against its fp32 PyTorch reference,
on inputs shaped like the model's caches, with the verdict of v4engine.testkit.numerics.

Sizes from catalog.SIZES: "tiny" (fp32, odd dims: masks and padding) runs everywhere, in Triton's interpreter
without a GPU; "v4-flash" (bf16, 512-d heads, 64 query heads on one key head, top-k 512 of 16384 CSA rows) needs a
CUDA GPU and is skipped without one. Each size is checked at decode (S = 1) and at a prefill chunk, attention with
and without key splits. These checks are marked gpu: scripts/gpu_check.sh runs them on the GPU machine, and its
table shows each one's error and limit (recorded as test properties). The last test checks the verdict itself.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from v4engine.plugins.kernels import catalog  # noqa: E402
from v4engine.testkit.numerics import (ATTENTION, EXACT_INDEXER_SCALE, OPS, Draw, Verdict,  # noqa: E402
                                               as_fp32, judge, kernel, make_inputs, op_attrs, query_positions,
                                               reference)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: V4-Flash sizes need one")
SHAPES = {"tiny": [("decode", 3, 1), ("prefill", 2, 20)], "v4-flash": [("decode", 8, 1), ("prefill", 2, 64)]}


def cases():
    """(size, B, S, op, splits) for every op at every shape of every size; attention also split in N."""
    for size, shapes in SHAPES.items():
        z = catalog.SIZES[size]
        for kind, B, S in shapes:
            for op in OPS:
                for splits in (1, z.splits) if op in ATTENTION else (None,):
                    name = f"{size}-{kind}-B{B}-S{S}-{op}" + (f"-split{splits}" if (splits or 1) > 1 else "")
                    yield pytest.param(size, B, S, op, splits, id=name, marks=NEEDS_CUDA if size == "v4-flash" else ())


def check(op: str, z: SimpleNamespace, inputs: dict[str, torch.Tensor], record_property, splits: int | None = None,
          exact: bool = False) -> Verdict:
    """Run the op's launcher and its fp32 reference on `inputs`, judge, and record error and limit for the table.
    exact: the indexer's integer inputs, scored with the scale that keeps every sum exact."""
    attrs = op_attrs(op, z) | (dict(scale=EXACT_INDEXER_SCALE) if exact else {})
    got = kernel(op)(*inputs.values(), **attrs, **({} if splits is None else dict(splits=splits)))
    verdict = judge(op, got, reference(op)(*as_fp32(inputs).values(), **attrs), inputs, attrs, exact)
    record_property("error", verdict.error)
    record_property("limit", verdict.limit)
    return verdict


@pytest.mark.gpu
@pytest.mark.parametrize("size, B, S, op, splits", list(cases()))
def test_kernel_matches_its_reference(size, B, S, op, splits, record_property):
    z = catalog.SIZES[size]
    draw = Draw(DEVICE, seed=1)
    verdict = check(op, z, make_inputs(op, z, query_positions(z, B, S, draw), draw), record_property, splits)
    assert verdict.ok, verdict


@pytest.mark.gpu
@pytest.mark.parametrize("B, S", [(3, 1), (2, 20)], ids=["tiny-decode-B3-S1-exact", "tiny-prefill-B2-S20-exact"])
def test_indexer_picks_exactly_the_references_rows_when_sums_are_exact(B, S, record_property):
    """Integer-valued fp32 inputs make every score exact whatever the summation order: the indices must agree."""
    z = catalog.SIZES["tiny"]
    draw = Draw(DEVICE, seed=2)
    inputs = make_inputs("indexer_topk", z, query_positions(z, B, S, draw), draw, integers=True)
    verdict = check("indexer_topk", z, inputs, record_property, exact=True)
    assert verdict.ok, verdict


def test_wrong_results_fail():
    """The verdict itself: an attention output off by more than the tolerance fails, and so does an indexer pick
    swapped for a worse row."""
    z = catalog.SIZES["tiny"]
    draw = Draw(DEVICE, seed=0)
    q_pos = query_positions(z, z.B, z.S, draw)
    inputs = make_inputs("sliding_attention", z, q_pos, draw)
    attrs = op_attrs("sliding_attention", z)
    want = reference("sliding_attention")(*inputs.values(), **attrs)
    verdict = judge("sliding_attention", want + 1e-3, want, inputs, attrs)
    assert not verdict.ok and verdict.error == pytest.approx(1e-3, rel=1e-3)

    inputs = make_inputs("indexer_topk", z, q_pos, draw)
    attrs = op_attrs("indexer_topk", z)
    want = reference("indexer_topk")(*inputs.values(), **attrs)
    assert judge("indexer_topk", want, want, inputs, attrs).ok
    b, s = (want[..., 1] >= 0).nonzero()[0].tolist()          # a query with at least two picks
    worse = want.clone()
    worse[b, s, 0] = want[b, s, 1]                            # the second best twice, and the best lost
    verdict = judge("indexer_topk", worse, want, inputs, attrs)
    assert not verdict.ok and "a row picked twice" in verdict.problems
