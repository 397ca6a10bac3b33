"""Triton kernels for IndexerTopK, HcaCompress and CsaCompress against their PyTorch references.

Without a GPU the kernels run under the Triton interpreter (conftest.py) on tiny shapes;
test_kernels_aot.py compiles their launch plans ahead of time.
"""
from __future__ import annotations

import pytest
import torch

from symbolic import SymbolicDim

pytest.importorskip("triton")

from v4engine.plugins import compressor as compressor_ref  # noqa: E402
from v4engine.plugins import indexer as indexer_ref  # noqa: E402
from v4engine.plugins.kernels.compressor import (csa_compress, hca_compress, plan_csa_compress,  # noqa: E402
                                                 plan_hca_compress)
from v4engine.plugins.kernels.indexer import indexer_topk, plan_indexer_topk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- IndexerTopK
def indexer_inputs(gen, B, S, h, dI, R, *, quantised: bool):
    """Random indexer inputs. key_ids: a shuffled window per slot (slot order is not window order), with
    every 5th slot empty (-1); q_pos spread so that some queries see no row, some a few, some all.

    Quantised inputs are small integers (weights multiples of 1/2): every product and partial sum is
    then exact in fp32, so kernel and reference compute bit-identical scores whatever their summation
    order, ties are frequent, and the indices must agree exactly."""
    if quantised:
        q = torch.randint(-2, 3, (B, S, h, dI), generator=gen).float()
        weights = torch.randint(-2, 3, (B, S, h), generator=gen) / 2
        keys = torch.randint(-2, 3, (B, R, dI), generator=gen).float()
    else:
        q, weights, keys = (torch.randn(shape, generator=gen) for shape in ((B, S, h, dI), (B, S, h), (B, R, dI)))
    key_ids = torch.stack([torch.randperm(R, generator=gen) for _ in range(B)])
    key_ids[:, ::5] = -1
    q_pos = torch.randint(0, RATIO * (R + 2), (B, S), generator=gen)
    q_pos[:, 0] = 2                                   # (2+1)//4 = 0 rows closed: sees nothing
    return q, weights, keys, key_ids, q_pos


def run_indexer(inputs, dtype, **attrs):
    q, weights, keys, key_ids, q_pos = (t.to(DEVICE) for t in inputs)
    return indexer_topk(q.to(dtype), weights, keys.to(dtype), key_ids, q_pos, **attrs).cpu()


INDEXER_SHAPES = [  # B, S, h, dI, R, topk
    (2, 3, 3, 10, 40, 5),       # R > topk, odd head and key sizes (padded to 16)
    (1, 4, 2, 8, 9, 16),        # R < topk: every visible row, then -1
    (2, 2, 16, 16, 70, 32),     # topk > BLOCK_R: two sub-blocks per round, three rounds
    (3, 2, 5, 12, 64, 64),      # R a multiple of the buffer
]


@pytest.mark.parametrize("B, S, h, dI, R, topk", INDEXER_SHAPES)
def test_indexer_topk_indices_equal_the_reference_exactly(B, S, h, dI, R, topk):
    """Quantised fp32 inputs: same rows, same order, ties to the lowest slot, -1 for invisible picks."""
    inputs = indexer_inputs(_gen(R + topk), B, S, h, dI, R, quantised=True)
    attrs = dict(topk=topk, ratio=RATIO, scale=0.5)
    expected = indexer_ref._reference(*inputs, **attrs)
    got = run_indexer(inputs, torch.float32, **attrs)
    assert got.shape == (B, S, min(topk, R))
    assert torch.equal(got, expected)
    assert (expected == -1).any() and (expected >= 0).any()


def test_indexer_zero_scores_tie_to_the_lowest_visible_slot():
    """All q.k < 0: every score is exactly 0 (with either sign of weight), so the lowest visible slots win."""
    keys = torch.ones(1, 40, 8)
    key_ids = torch.arange(40).unsqueeze(0)
    key_ids[0, [1, 4]] = -1
    inputs = (-torch.ones(1, 2, 2, 8), torch.tensor([[[1.0, 1.0], [-1.0, -1.0]]]), keys, key_ids,
              torch.tensor([[35, 159]]))
    got = run_indexer(inputs, torch.float32, topk=4, ratio=RATIO, scale=0.5)
    assert got.tolist() == indexer_ref._reference(*inputs, 4, RATIO, 0.5).tolist() == [[[0, 2, 3, 5]] * 2]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("B, S, h, dI, R, topk", INDEXER_SHAPES)
def test_indexer_topk_picks_the_best_scores(B, S, h, dI, R, topk, dtype, tol):
    """Continuous inputs (bf16 ones compared with the reference on the same values upcast to fp32).

    Kernel and reference sum in different orders, so rows whose scores agree to rounding may swap.
    The test therefore checks what is order-independent: the same picks are -1, the picks are distinct
    visible rows, and the reference score of the i-th pick equals the i-th best reference score
    (relative to the largest score) — a swap of near-ties passes, any real mistake does not."""
    q, weights, keys, key_ids, q_pos = indexer_inputs(_gen(R * topk), B, S, h, dI, R, quantised=False)
    q, keys = q.to(dtype).float(), keys.to(dtype).float()
    attrs = dict(topk=topk, ratio=RATIO, scale=dI ** -0.5)
    expected = indexer_ref._reference(q, weights, keys, key_ids, q_pos, **attrs)
    got = run_indexer((q, weights, keys, key_ids, q_pos), dtype, **attrs)

    assert torch.equal(got == -1, expected == -1)
    scores = indexer_ref.visible_scores(q, weights, keys, key_ids, q_pos, RATIO, attrs["scale"])
    picked = got >= 0
    for b, s in zip(*torch.nonzero(picked.any(-1), as_tuple=True)):
        rows = got[b, s][picked[b, s]]
        assert len(set(rows.tolist())) == len(rows)
    got_scores = torch.gather(scores, -1, got.clamp(min=0))[picked]
    best_scores = torch.gather(scores, -1, expected.clamp(min=0))[picked]
    assert torch.isfinite(got_scores).all()
    assert (got_scores - best_scores).abs().max() <= tol * scores[torch.isfinite(scores)].abs().max()


def test_no_rows_give_empty_results():
    """R = 0 keys: [B,S,0] picks; a buffer holding only the kept state: E = 0 rows."""
    inputs = indexer_inputs(_gen(0), 2, 3, 2, 8, 0, quantised=True)
    assert run_indexer(inputs, torch.float32, topk=4, ratio=RATIO, scale=0.5).shape == (2, 3, 0)
    rows, row_ids = csa_compress(torch.ones(2, 3, 8), torch.ones(2, 3, 8), torch.zeros(2, dtype=torch.int64),
                                 ratio=4, state_tokens=3)
    assert rows.shape == (2, 0, 4) and row_ids.shape == (2, 0)


# --------------------------------------------------------------------------- HcaCompress / CsaCompress
COMPRESSORS = {"hca": (hca_compress, False), "csa": (csa_compress, True)}
COMPRESS_CASES = [  # ratio, state_tokens, new tokens, channels, first positions of the new tokens
    (4, 3, 1, 24, (0, 3, 7)),        # decode: one token, closing a window or not
    (4, 3, 9, 24, (0, 2, 13)),       # prefill chunk starting mid-window
    (3, 2, 7, 40, (0, 4, 5)),        # ratio not a power of two: padded slots
    (8, 7, 16, 320, (0, 1, 21)),     # > 128 output channels: several channel blocks
    (16, 15, 40, 16, (0, 17, 40)),   # long windows
    (4, 0, 6, 24, (0, 4, 9)),        # no state kept
]


def compress_inputs(gen, ratio, state, n_new, channels, starts):
    L = state + n_new
    kv = torch.randn(len(starts), L, channels, generator=gen)
    gate = 3 * torch.randn(len(starts), L, channels, generator=gen)
    first_pos = torch.tensor(starts) - state          # negative while the cache is not yet full
    return kv, gate, first_pos


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
@pytest.mark.parametrize("ratio, state, n_new, channels, starts", COMPRESS_CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_compressor_matches_the_reference(kind, ratio, state, n_new, channels, starts, dtype, tol):
    """Rows within 1e-4 (fp32) or 1e-2 relative (bf16, vs the reference on the upcast bf16 values);
    row_ids exactly, including the -1 of windows that do not close inside the buffer."""
    fn, overlap = COMPRESSORS[kind]
    kv, gate, first_pos = compress_inputs(_gen(ratio * channels + n_new), ratio, state, n_new, channels, starts)
    kv, gate = kv.to(dtype), gate.to(dtype)
    rows, row_ids = fn(kv.to(DEVICE), gate.to(DEVICE), first_pos.to(DEVICE), ratio=ratio, state_tokens=state)
    ref_rows, ref_ids = compressor_ref._reference(kv.float(), gate.float(), first_pos, ratio, state, overlap)
    assert rows.dtype == dtype and rows.shape == ref_rows.shape
    assert torch.equal(row_ids.cpu(), ref_ids)
    torch.testing.assert_close(rows.cpu().float(), ref_rows, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- launch plans
@pytest.mark.parametrize("plan_fn, dims, attrs", [
    (plan_indexer_topk, dict(B=SymbolicDim("B"), S=SymbolicDim("S"), h=64, dI=128, R=SymbolicDim("R")),
     dict(topk=512, ratio=4, scale=0.1)),
    (plan_hca_compress, dict(B=SymbolicDim("B"), L=SymbolicDim("L"), C=512), dict(ratio=128, state_tokens=127)),
    (plan_csa_compress, dict(B=SymbolicDim("B"), L=SymbolicDim("L"), C=1024), dict(ratio=4, state_tokens=3)),
])
def test_plans_take_symbolic_shapes(plan_fn, dims, attrs):
    """Grids and scalars are built with + * // only, so TensorRT's shape expressions work as dims."""
    plan = plan_fn(dims, torch.bfloat16, **attrs)
    assert any(isinstance(g, SymbolicDim) for g in plan.grid)
    assert all(isinstance(v, (int, SymbolicDim)) for v in (*plan.grid, *plan.scalars.values()))
