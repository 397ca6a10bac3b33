"""The Triton attention kernels (plugins/kernels/attention.py) give what the PyTorch references give.

Without a GPU the kernels run in Triton's interpreter (conftest.py) on tiny shapes; test_kernels_aot.py
compiles their launch plans ahead of time.
"""
from __future__ import annotations

import pytest
import torch

from symbolic import SymbolicDim

pytest.importorskip("triton")

from v4engine.plugins import attention as reference                    # noqa: E402
from v4engine.plugins.kernels import attention as kernels              # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WINDOW, RATIO, SCALE = 8, 4, 0.3


# --------------------------------------------------------------------------- inputs shaped like the model's
def make_case(B: int, S: int, H: int, d: int, starts: list[int], R: int = 12, k: int = 5, dtype=torch.float32,
              seed: int = 0) -> dict[str, torch.Tensor]:
    """Window keys laid out as the model does (the W-1 cached positions, then the S new ones), -1 for slots
    before position 0; rows with ids 0..R-1, the last two slots empty; topk picks with some -1 entries."""
    gen = torch.Generator().manual_seed(seed)
    q_pos = torch.tensor(starts).unsqueeze(1) + torch.arange(S)
    T = WINDOW - 1 + S
    kv_pos = q_pos[:, :1] - (WINDOW - 1) + torch.arange(T)
    row_ids = torch.arange(R).repeat(B, 1)
    row_ids[:, R - 2:] = -1
    case = dict(q=torch.randn(B, S, H, d, generator=gen).to(dtype), q_pos=q_pos,
                kv=torch.randn(B, T, d, generator=gen).to(dtype), kv_pos=kv_pos.clamp(min=-1),
                rows=torch.randn(B, R, d, generator=gen).to(dtype), row_ids=row_ids,
                topk_idx=torch.randint(-1, R, (B, S, k), generator=gen), sink=torch.randn(H, generator=gen))
    return {name: t.to(DEVICE) for name, t in case.items()}


def blind_first_row(case: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Batch row 0 sees nothing at all: every window slot, row id and pick is empty."""
    for name in ("kv_pos", "row_ids", "topk_idx"):
        case[name][0] = -1
    return case


OPS = {
    "sliding": (["q", "q_pos", "kv", "kv_pos", "sink"], dict(window=WINDOW, scale=SCALE)),
    "hca": (["q", "q_pos", "kv", "kv_pos", "rows", "row_ids", "sink"], dict(window=WINDOW, ratio=RATIO, scale=SCALE)),
    "csa": (["q", "q_pos", "kv", "kv_pos", "rows", "topk_idx", "sink"], dict(window=WINDOW, scale=SCALE)),
}

CASES = {
    "decode-d24": dict(B=2, S=1, H=4, d=24, starts=[3, 40]),
    "prefill-from-0-two-key-tiles": dict(B=1, S=20, H=2, d=16, starts=[0]),
    "prefill-chunk-17-heads": dict(B=2, S=3, H=17, d=16, starts=[9, 30]),
}


def run_both(op: str, case: dict[str, torch.Tensor], **options) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, fp32 reference on the same inputs)."""
    names, attrs = OPS[op]
    inputs = [case[n] for n in names]
    got = getattr(kernels, f"{op}_attention")(*inputs, **attrs, **options)
    want = getattr(reference, f"{op}_attention")(*[t.float() if t.is_floating_point() else t for t in inputs],
                                                 **attrs)
    return got, want


# --------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("op", OPS)
def test_fp32_matches_reference(op, case):
    got, want = run_both(op, make_case(**CASES[case]))
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", OPS)
def test_16_bit_matches_fp32_reference_of_the_same_inputs(op, dtype):
    got, want = run_both(op, make_case(**CASES["prefill-chunk-17-heads"], dtype=dtype))
    assert got.dtype == dtype
    assert (got.float() - want).abs().max().item() <= 1e-2 * want.abs().max().item()


@pytest.mark.parametrize("op", OPS)
def test_a_query_that_sees_nothing_gives_zero(op):
    got, want = run_both(op, blind_first_row(make_case(**CASES["decode-d24"])))
    assert torch.equal(got[0], torch.zeros_like(got[0])) and torch.equal(want[0], torch.zeros_like(want[0]))
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("op", OPS)
def test_split_keys_then_combine_is_the_same_attention(op):
    """Flash-decoding: the key span cut into 3 partials (the sink counted once) merged by the combine kernel."""
    case = blind_first_row(make_case(B=2, S=12, H=2, d=16, starts=[0, 5]))
    got, want = run_both(op, case, splits=3)
    assert (got - want).abs().max().item() <= 1e-4


# --------------------------------------------------------------------------- launch plans
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("op", OPS)
def test_plans_take_symbolic_shapes(op, splits):
    """Grids and scalars are built from the shape values with + * // only; the head size must be an int."""
    dims = {name: SymbolicDim(name) for name in ("B", "S", "H", "T", "R", "k")} | {"d": 512}
    plans = getattr(kernels, f"plan_{op}_attention")(dims, torch.bfloat16, splits=splits, **OPS[op][1])
    grid = plans[0].grid
    assert (grid[0].text, grid[1].text, grid[2]) == ("(B * S)", f"((H + {kernels.BLOCK_H - 1}) // {kernels.BLOCK_H})",
                                                     splits)
    assert all(isinstance(v, SymbolicDim) for v in plans[0].scalars.values())
    assert list(plans[0].inputs) == OPS[op][0] and list(plans[-1].outputs) == ["out"]
