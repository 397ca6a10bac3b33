"""Attack: degenerate sampling values.

Every value the runtime cannot serve exactly is refused before anything is queued, with one line naming the
field (RequestError; v4generate: that line and exit status 1). Extreme values it can serve are served exactly:
a temperature of 1e-320 is the T -> 0 limit (the greedy tokens), not NaN, and not token V-1 forever.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from hostile import assert_one_line, v4generate
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import RequestError, SamplingParams, distribution

PROMPT = [5, 17, 99, 3, 42, 8, 61]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine("mixed", agree=0.05)[1]


@pytest.fixture(scope="module")
def generator(engine) -> Generator:
    return Generator.from_engine_dir(engine, mtp=3)


def tokens(generator: Generator, **settings) -> list[int]:
    return generator.generate([PROMPT], SamplingParams(max_new_tokens=24, ignore_eos=True, **settings))[0].token_ids


@pytest.mark.parametrize("field, settings", [
    ("max_new_tokens", dict(max_new_tokens=True)),
    ("max_new_tokens", dict(max_new_tokens=8.0)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=-1e-320)),
    ("temperature", dict(temperature=10**400)),
    ("temperature", dict(temperature="0.7")),
    ("temperature", dict(temperature=True)),
    ("top_p", dict(top_p=math.nan)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=None)),
    ("top_k", dict(top_k=True)),
    ("top_k", dict(top_k=2.5)),
    ("top_k", dict(top_k=-1)),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=2**64)),
    ("seed", dict(seed=1.5)),
    ("seed", dict(seed=False)),
    ("stop_token_ids", dict(stop_token_ids=5)),
    ("stop_token_ids", dict(stop_token_ids=("5",))),
    ("stop_token_ids", dict(stop_token_ids=(-1,))),
    ("stop_token_ids", dict(stop_token_ids=(128,))),
    ("ignore_eos", dict(ignore_eos="false")),
    ("num_draft_tokens", dict(num_draft_tokens=True)),
    ("num_draft_tokens", dict(num_draft_tokens=-1)),
])
def test_a_value_that_cannot_be_served_exactly_is_refused_in_one_line_naming_its_field(generator, field, settings):
    with pytest.raises(RequestError) as refused:
        generator.generate([PROMPT], SamplingParams(**settings))
    assert field in str(refused.value) and "\n" not in str(refused.value)
    assert not generator.scheduler.busy, "nothing was queued"


def test_a_prompt_of_other_things_than_token_ids_is_refused(generator):
    with pytest.raises(RequestError, match="4.0 is not a token id"):
        generator.generate([[3, 4.0, 5]], GREEDY)


@pytest.mark.parametrize("temperature", [1e-320, 5e-324])
def test_a_tiny_temperature_samples_the_greedy_limit_exactly(generator, temperature):
    assert tokens(generator, temperature=temperature, seed=0) == tokens(generator)


def test_the_distribution_of_a_tiny_temperature_is_uniform_over_exact_ties():
    logits = np.array([1.0, 3.0, -np.inf, 3.0, 2.999999], np.float32)
    p = distribution(logits, SamplingParams(temperature=1e-320))
    assert p.tolist() == [0.0, 0.5, 0.0, 0.5, 0.0]


def test_extreme_values_that_can_be_served_are_served_exactly(generator):
    logits = np.array([0.5, 2.0, -1.0, 1.5])
    assert distribution(logits, SamplingParams(temperature=1e300)).tolist() == [0.25] * 4
    assert distribution(logits, SamplingParams(temperature=1.0, top_p=5e-324)).tolist() == [0.0, 1.0, 0.0, 0.0]
    sampled = dict(temperature=0.8, seed=2**64 - 1)
    assert tokens(generator, **sampled) == tokens(generator, **sampled)
    assert tokens(generator, top_k=10**30, **sampled) == tokens(generator, top_k=0, **sampled)
    # a top_p below float32's range still keeps the most likely token, in the draft graph too: greedy, drafts accepted
    nucleus = generator.generate([PROMPT], SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0,
                                                          top_p=5e-324, seed=1))[0]
    assert nucleus.token_ids == tokens(generator) and nucleus.metrics["acceptance_rate"] > 0


def test_numpy_scalars_are_the_numbers_they_hold(generator):
    as_numpy = dict(temperature=np.float32(0.75), top_k=np.int32(9), seed=np.int64(3))
    assert tokens(generator, **as_numpy) == tokens(generator, temperature=0.75, top_k=9, seed=3)


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--top-p", "nan"], "top_p"),
    (["--top-k", "-3"], "top_k"),
])
def test_v4generate_refuses_them_in_one_line(engine, args, needle):
    assert_one_line(v4generate(engine, "--prompt-ids", "3,4,5", *args), needle, status=1)
