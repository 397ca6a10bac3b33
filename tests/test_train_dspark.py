"""examples/train_dspark.py: a second run may widen a shipped drafter's Markov head without changing its drafts, and
draw as much of the target's own text at T = 1 as it asks for."""
from __future__ import annotations

import importlib
import json
import sys
from types import ModuleType

import numpy as np
import torch
from conftest import TRAINED, TRAINED_DSPARK

from v4engine.builder.load import load_dspark, load_model
from v4engine.builder.tiny import dspark_config


def example_script(name: str) -> ModuleType:
    """An example script imported from its folder, which leaves sys.path as it was (examples/triton must not
    shadow anything for the rest of the worker)."""
    sys.path.insert(0, str(TRAINED.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(TRAINED.parent))


train_dspark = example_script("train_dspark")


def test_a_drafter_widened_to_a_higher_markov_rank_drafts_exactly_as_before():
    target = load_model(TRAINED, mtp=True).requires_grad_(False)
    shipped = load_dspark(TRAINED_DSPARK)
    rank = shipped.dspark.markov_rank
    wide = train_dspark.dspark_for(target, dspark_config(json.loads((TRAINED / "config.json").read_text()),
                                                         4 * rank), seed=0)
    with torch.no_grad():                       # whatever the fresh drafter holds, the new columns add nothing
        wide.mtp[-1].markov_head.markov_w2.weight.normal_()
        wide.mtp[-1].confidence_head.proj.weight.normal_()
    weights = {k: v for k, v in shipped.state_dict().items() if k.startswith("mtp.")}
    wide.load_state_dict(train_dspark.widened_markov(weights, wide), strict=False)
    assert wide.mtp[-1].markov_head.markov_w2.weight.shape[-1] == 4 * rank

    batch = torch.randint(0, target.embed.weight.shape[0], (2, 64))
    with torch.no_grad():
        before = train_dspark.block_losses(target, shipped, batch, 4, np.random.default_rng(0))
        after = train_dspark.block_losses(target, wide, batch, 4, np.random.default_rng(0))
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-6, msg=name)


def test_the_distillation_pool_holds_the_share_of_sampled_continuations_asked_for(tmp_path, monkeypatch):
    """A greedy continuation is the target's argmax path, so it comes out the same whatever seeds the draws; a drawn
    one does not (12 tokens of a 4,096-token vocabulary). The pool's first int((1 - sampled) x count) rows are
    greedy, at either end of the range too."""
    target = load_model(TRAINED, mtp=False).requires_grad_(False)
    data = np.random.default_rng(0).integers(2, target.embed.weight.shape[0], 4096).astype(np.uint16)
    draws = train_dspark.continuations

    def pool_of(sampled: float, seed_of_draws: int) -> np.ndarray:        # the same prompts, other draws
        monkeypatch.setattr(train_dspark, "continuations", lambda *a: draws(*a[:4], seed_of_draws))
        return train_dspark.generated_pool(target, data, 4, 20, 8, 0, tmp_path / f"{sampled}-{seed_of_draws}.npy",
                                           sampled)

    for sampled, greedy in ((0.75, 1), (1.0, 0), (0.0, 4)):              # int(4 x (1 - sampled)) greedy rows
        first, second = pool_of(sampled, 1), pool_of(sampled, 2)
        assert first.shape == (4, 20) and (first[:, :8] == second[:, :8]).all()
        assert (first[:greedy] == second[:greedy]).all()
        assert all((first[i] != second[i]).any() for i in range(greedy, 4))
