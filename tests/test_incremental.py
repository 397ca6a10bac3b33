"""The incremental path (cache views + deltas, commit by length) equals a full recompute at every step."""
from __future__ import annotations

import pytest
import torch

from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState
from v4engine.builder.tiny import TINY_CONFIGS
from v4engine.contract.config import CSA, HCA

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def model(request, tiny_checkpoint):
    return load_model(tiny_checkpoint(request.param), mtp=False)


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    state = ModelState(model.cfg, ids.shape[0])
    with torch.no_grad():
        return model(ids, state.positions(ids.shape[1]), state.views()).logits


def step(model, state: ModelState, tokens: torch.Tensor, commit: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens, state.positions(tokens.shape[1]), state.views())
    state.commit(out.deltas, commit)
    return out.logits


def largest_ratio(cfg) -> int:
    return max(cfg.compress_rates[k] for k in (CSA, HCA) if k in cfg.layer_types)


def test_prefill_then_single_tokens(model):
    cfg = model.cfg
    n = 3 * largest_ratio(cfg) + cfg.sliding_window
    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    ref = full_logits(model, ids)
    state = ModelState(cfg, 1)
    prefill = 5
    got = [step(model, state, ids[:, :prefill], [prefill])]
    for t in range(prefill, n):
        got.append(step(model, state, ids[:, t:t + 1], [1]))
    assert (torch.cat(got, dim=1) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("q", [2, 3, 4])
def test_verify_steps_at_every_window_alignment_with_rejected_tails(model, q):
    """q-token verify steps starting at every residue modulo every compress ratio. Each carries wrong tokens
    after a random accepted prefix, committed away (rollback by length); a chunk of true tokens follows."""
    cfg = model.cfg
    m = largest_ratio(cfg)
    stride = q + 1 if (q + 1) % 2 else q + 2             # odd, so coprime with the power-of-two ratios
    starts = [3 + j * stride for j in range(m)]
    gen = torch.Generator().manual_seed(q)
    n = starts[-1] + stride
    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen)
    ref = full_logits(model, ids)
    state = ModelState(cfg, 1)
    for start in starts:
        t = state.lengths[0]
        step(model, state, ids[:, t:start], [start - t])   # true tokens up to the planned start
        accepted = int(torch.randint(1, q + 1, (1,), generator=gen))
        tokens = ids[:, start:start + q].clone()
        tokens[:, accepted:] = torch.randint(0, cfg.vocab_size, (1, q - accepted), generator=gen)
        logits = step(model, state, tokens, [accepted])
        assert (logits[:, :accepted] - ref[:, start:start + accepted]).abs().max().item() <= TOL, f"step at {start}"
    assert {s % m for s in starts} == set(range(m))


def test_rows_of_different_lengths_and_phases_in_one_batch(model):
    """Three sequences in one call: a prefill chunk beside verify-sized rows, padding at row ends."""
    cfg = model.cfg
    n = 2 * largest_ratio(cfg) + cfg.sliding_window + 8
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (3, n), generator=gen)
    refs = [full_logits(model, ids[b:b + 1]) for b in range(3)]
    state = ModelState(cfg, 3)
    plan = [[7, 1, 4, 3, 2], [3, 4, 4, 1, 9], [1, 2, 3, 4, 4]]      # tokens per row per call
    while any(plan):
        sizes = [row.pop(0) if row else 0 for row in plan]
        S = max(sizes)
        tokens = torch.zeros(3, S, dtype=torch.int64)
        for b, size in enumerate(sizes):
            t = state.lengths[b]
            tokens[b, :size] = ids[b, t:t + size]
            tokens[b, size:] = torch.randint(0, cfg.vocab_size, (S - size,), generator=gen)
        starts = list(state.lengths)
        logits = step(model, state, tokens, sizes)
        for b, size in enumerate(sizes):
            if size:
                diff = (logits[b, :size] - refs[b][0, starts[b]:starts[b] + size]).abs().max().item()
                assert diff <= TOL, f"row {b} at {starts[b]}"
