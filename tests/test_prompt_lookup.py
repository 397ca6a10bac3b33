"""Prompt lookup: a drafter without weights, on the drafter seam. It drafts what followed the latest earlier
occurrence of the request's last n-gram, on any engine, and is lossless like every drafter (test_drafters.py:
greedy, batches, prefix forks, preemption; test_sampling.py: the joint distribution at T = 1)."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from v4engine.contract.engine import EngineManifest
from v4engine.runtime.drafters.prompt_lookup import LookupState, PromptLookupDrafter
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import RequestError, SamplingParams

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def brute_force(tokens: list[int], k: int, ngrams: range) -> list[int]:
    """The definition: the longest n (ngrams, longest first) whose last n tokens occurred before, at their latest
    earlier occurrence; the up to k tokens that followed it."""
    for n in ngrams:
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if len(tokens) > n and tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


def test_lookup_equals_its_definition_as_the_sequence_grows():
    rng = random.Random(0)
    drafter = PromptLookupDrafter(k=4)
    for _ in range(50):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        state = LookupState({n: {} for n in drafter.ngrams})
        for _ in range(30):                        # one index, grown as tokens are committed
            assert drafter.lookup(state, tokens, 4) == brute_force(tokens, 4, drafter.ngrams)
            tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_the_latest_occurrence_of_the_longest_ngram_wins():
    drafter = PromptLookupDrafter(k=3)
    state = LookupState({n: {} for n in drafter.ngrams})
    #                  0  1  2  3  4  5  6  7  8  9 10 11
    assert drafter.lookup(state, [1, 2, 3, 9, 1, 2, 3, 8, 7, 2, 3], 3) == [8, 7, 2]      # "2 3" latest: before 8
    assert drafter.lookup(state, [1, 2, 3, 9, 1, 2, 3, 8, 7, 2, 3, 1, 2, 3], 3) == [8, 7, 2]   # "1 2 3" beats "2 3"
    assert drafter.lookup(LookupState({n: {} for n in drafter.ngrams}), [4, 5, 6], 3) == []


def test_an_engine_built_without_a_draft_graph_drafts_with_prompt_lookup(tiny_engine):
    _, engine = tiny_engine("mixed", mtp=0)
    assert EngineManifest.read(engine).drafter is None
    prompts = [[3, 4, 5, 6] * 6, [9, 10, 11, 9, 10], [7]]
    plain = Generator.from_engine_dir(engine).generate(prompts, GREEDY)
    lookup = Generator.from_engine_dir(engine, drafter="prompt_lookup")
    assert lookup.scheduler.mtp == 3, "k defaults to 3 on an engine without a draft graph"
    assert [r.token_ids for r in lookup.generate(prompts, GREEDY)] == [r.token_ids for r in plain]
    assert lookup.totals.drafted > 0


def test_refused_in_one_line(trained_engine, tiny_engine):
    _, plain = tiny_engine("mixed", mtp=0)
    with pytest.raises(RequestError, match="drafter must be one of mtp, dspark, prompt_lookup"):
        Generator.from_engine_dir(trained_engine, drafter="eagle")
    with pytest.raises(RequestError, match="has no mtp draft graph"):
        Generator.from_engine_dir(plain, drafter="mtp")
    with pytest.raises(RequestError, match="mtp must be an integer from 0 to 16"):
        Generator.from_engine_dir(plain, drafter="prompt_lookup", mtp=17)
    with pytest.raises(RequestError, match="mtp must be an integer from 0 to 3"):
        Generator.from_engine_dir(trained_engine, mtp=4)


def test_v4generate_and_the_triton_repository_take_the_drafter(trained_engine, tmp_path):
    run = subprocess.run([sys.executable, "-m", "v4engine.runtime.cli", str(trained_engine), "--drafter",
                          "prompt_lookup", "--mtp", "4", "--prompt", "for i in range(3):\n    print(i)\nfor i in",
                          "--max-new-tokens", "12", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["metrics"]["drafted"] > 0
    from v4engine.triton_repo import RenderError, render

    repo = render(trained_engine, tmp_path / "repo", drafter="prompt_lookup", mtp=4)
    config = (repo / "v4_generate" / "config.pbtxt").read_text()
    assert 'key: "drafter"' in config and 'string_value: "prompt_lookup"' in config and 'string_value: "4"' in config
    with pytest.raises(RenderError, match="mtp must be an integer from 0 to 3"):
        render(trained_engine, tmp_path / "bad", mtp=9)
    assert not (tmp_path / "bad").exists()
