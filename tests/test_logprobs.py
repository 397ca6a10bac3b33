"""Logprobs are the target's: each generated token's log-probability is the log-softmax of the target's raw logits
at its position, as a full recompute of our PyTorch model gives it (within 1e-4), the same whether drafts were
verified or not; prompt logprobs score every prompt token after the first, computed whole even when the prefix
cache holds the prompt."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState
from v4engine.runtime import Generator, SamplingParams
from v4engine.runtime.sampling import MAX_LOGPROBS, RequestError, token_logprob

TOP = 5


def recomputed(model, ids: list[int]) -> np.ndarray:
    """log_softmax of the target's logits at every position of `ids` [len(ids), V], no caches."""
    state = ModelState(model.cfg, 1)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), state.positions(len(ids)), state.views()).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


@pytest.fixture(scope="module")
def mixed(tiny_engine):
    checkpoint, engine = tiny_engine("mixed", agree=0.05)
    return load_model(checkpoint, mtp=False), engine


@pytest.mark.parametrize("mtp, temperature", [(0, 0.0), (3, 0.0), (3, 1.0)])
def test_generated_and_prompt_logprobs_are_the_targets_log_softmax(mixed, mtp, temperature):
    model, engine = mixed
    generator = Generator.from_engine_dir(engine, mtp=mtp)
    prompt = torch.randint(0, model.cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=1, ignore_eos=True, logprobs=TOP,
                            prompt_logprobs=TOP)
    generator.generate([prompt], SamplingParams(max_new_tokens=2))          # the prompt is in the prefix cache now
    [result] = generator.generate([prompt], params)
    ids = prompt + result.token_ids
    expected = recomputed(model, ids)                                        # row p scores token p + 1
    assert [lp.token for lp in result.prompt_logprobs] == prompt[1:]
    assert [lp.token for lp in result.logprobs] == result.token_ids
    for p, lp in enumerate(result.prompt_logprobs + result.logprobs):
        assert abs(lp.logprob - expected[p, ids[p + 1]]) <= 1e-4
        best = np.argsort(-expected[p], kind="stable")[:TOP]
        assert [t for t, _ in lp.top] == best.tolist() or np.allclose(sorted(-expected[p][best]),
                                                                     sorted(-np.array([v for _, v in lp.top])),
                                                                     atol=1e-4)
        assert all(abs(v - expected[p, t]) <= 1e-4 for t, v in lp.top)
    if temperature == 0:
        assert all(lp.top[0][0] == lp.token for lp in result.logprobs)       # greedy: the best token


def test_logprobs_are_off_unless_asked_and_bounded(mixed):
    _, engine = mixed
    generator = Generator.from_engine_dir(engine, mtp=3)
    [plain] = generator.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert plain.logprobs is None and plain.prompt_logprobs is None
    for bad in (-1, MAX_LOGPROBS + 1, 2.0, True):
        with pytest.raises(RequestError, match=f"logprobs must be an integer from 0 to {MAX_LOGPROBS}"):
            generator.generate([[1, 2, 3]], SamplingParams(logprobs=bad))


def test_token_logprob_ranks_ties_by_lower_id():
    logits = np.array([0.0, 2.0, 2.0, -1.0], np.float32)
    lp = token_logprob(logits, 3, 3)
    assert [t for t, _ in lp.top] == [1, 2, 0]
    assert np.isclose(np.exp([v for _, v in lp.top]).sum() + np.exp(lp.logprob), 1.0)
