"""Presence, frequency and repetition penalties are lossless under speculative decoding: drafts are verified
against the target's distribution penalized for the output before each position (accepted drafts included).

The oracle is a loop with no caches and no drafts: our PyTorch model recomputed over the whole sequence at every
step, its logits penalized by a plain-Python formulation written here (OpenAI's presence and frequency penalties
over the output, CTRL's repetition penalty over prompt and output, as transformers applies it)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState
from v4engine.runtime import Generator, SamplingParams
from v4engine.runtime.budget import Limits
from v4engine.runtime.sampling import RequestError, distribution

PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.3)
# negative penalties reward repeating the output: a draft that repeats a token drafted before it in the same
# block is then judged by a target that counts that earlier draft (the verify rows' own penalties)
REPEATING = dict(presence_penalty=-1.5, frequency_penalty=-0.5, repetition_penalty=0.8)


def penalized_by_hand(logits: np.ndarray, prompt: list[int], output: list[int], presence: float, frequency: float,
                      repetition: float) -> np.ndarray:
    logits = logits.astype(np.float64).copy()
    for token in set(prompt) | set(output):
        value = logits[token]
        logits[token] = value / repetition if value > 0 else value * repetition
    for token, count in Counter(output).items():
        logits[token] -= frequency * count + presence
    return logits


@pytest.fixture(scope="module")
def mixed(tiny_engine):
    checkpoint, engine = tiny_engine("mixed", agree=0.05)
    return load_model(checkpoint, mtp=False), engine


def last_logits(model, seq: list[int]) -> np.ndarray:
    state = ModelState(model.cfg, 1)
    with torch.no_grad():
        return model(torch.tensor([seq]), state.positions(len(seq)), state.views()).logits[0, -1].numpy()


@pytest.mark.parametrize("penalties", [PENALTIES, REPEATING], ids=["discouraging", "rewarding"])
def test_penalized_greedy_tokens_are_the_full_recompute_oracles_at_every_draft_length(mixed, penalties):
    model, engine = mixed
    prompt = torch.randint(0, model.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(11)).tolist()
    output: list[int] = []
    for _ in range(16):
        logits = penalized_by_hand(last_logits(model, prompt + output), prompt, output, *penalties.values())
        output.append(int(logits.argmax()))
    plain = Generator.from_engine_dir(engine, mtp=0).generate([prompt], SamplingParams(max_new_tokens=16,
                                                                                       ignore_eos=True))[0]
    assert plain.token_ids != output, "the penalties change what greedy decoding writes"
    for mtp in (0, 1, 3):
        [result] = Generator.from_engine_dir(engine, mtp=mtp).generate(
            [prompt], SamplingParams(max_new_tokens=16, ignore_eos=True, **penalties))
        assert result.token_ids == output, f"mtp {mtp}"
        if mtp:
            assert result.metrics["drafted"] > 0


def test_penalized_sampling_follows_the_penalized_target_joint_distribution(mixed):
    """The first two sampled tokens at T = 1, MTP 3, against the penalized target's exact joint distribution."""
    model, engine = mixed
    prompt, n = [5, 17, 99, 3, 42, 8, 61], 2000
    shape = dict(temperature=1.0, top_k=6, **PENALTIES)
    params = SamplingParams(**shape)

    def probs(output: list[int]) -> np.ndarray:
        logits = penalized_by_hand(last_logits(model, prompt + output), prompt, output, 1.5, 0.7, 1.3)
        return distribution(logits, params)

    p1 = probs([])
    exact = {(a, b): p1[a] * pb for a in np.flatnonzero(p1) for b, pb in enumerate(probs([int(a)])) if pb > 0}
    generator = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_batch=64))
    results = generator.generate([prompt] * n, [SamplingParams(max_new_tokens=2, ignore_eos=True, seed=s, **shape)
                                                for s in range(n)])
    observed = Counter(tuple(r.token_ids) for r in results)
    assert set(observed) <= set(exact), "only tokens the penalized target can sample"
    assert 0 < generator.totals.accepted < generator.totals.drafted
    tv = 0.5 * sum(abs(observed.get(cell, 0) / n - prob) for cell, prob in exact.items())
    assert tv < 0.06, f"total variation {tv:.3f}"


@pytest.mark.parametrize("field, value, words", [
    ("presence_penalty", 2.5, "presence_penalty must be a number from -2 to 2"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be a number from -2 to 2"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a number in (0, 10]"),
    ("repetition_penalty", True, "repetition_penalty must be a number in (0, 10]"),
])
def test_penalties_out_of_range_are_refused_naming_the_field(mixed, field, value, words):
    _, engine = mixed
    with pytest.raises(RequestError, match=words.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        Generator.from_engine_dir(engine, mtp=0).generate([[1, 2]], SamplingParams(**{field: value}))
