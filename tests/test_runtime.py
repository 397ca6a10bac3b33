"""The runtime: lossless MTP speculative decoding from an engine directory, with exact acceptance."""
from __future__ import annotations

import pytest
import torch

from v4engine.builder.load import load_model
from v4engine.builder.tiny import TINY_CONFIGS
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
from v4engine.testkit.oracle import load_transformers, oracle_accepted_counts, oracle_greedy

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
# prompt lengths per config; the longest ends past index_topk compressed CSA rows
PROMPTS = {"mixed": (3, 30), "split_groups": (9, 40), "flash_like": (5, 60)}


def prompt(cfg, length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("config", sorted(TINY_CONFIGS))
def test_greedy_with_mtp_k_is_identical_to_greedy_without_and_to_the_oracle(tiny_engine, config):
    checkpoint, engine = tiny_engine(config)
    hf = load_transformers(checkpoint)
    outputs = {}
    for k in range(4):
        generator = Generator.from_engine_dir(engine, mtp=k)
        prompts = [prompt(hf.config, n, seed=n) for n in PROMPTS[config]]
        outputs[k] = [r.token_ids for r in generator.generate(prompts, GREEDY)]
    assert outputs[0] == outputs[1] == outputs[2] == outputs[3]
    for ids, got in zip(prompts, outputs[0]):
        assert got == oracle_greedy(hf, ids, GREEDY.max_new_tokens)
    cfg = load_model(checkpoint, mtp=False).cfg
    assert (PROMPTS[config][-1] + GREEDY.max_new_tokens) // cfg.compress_rates["compressed_sparse_attention"] \
        > cfg.index_topk


# --------------------------------------------------------------------------- exact acceptance
@pytest.mark.parametrize("agree", [None, 0.05])
def test_accepted_counts_equal_the_full_recompute_oracle_step_by_step(tiny_engine, agree):
    options = {} if agree is None else {"agree": agree}
    checkpoint, engine = tiny_engine("mixed", **options)
    model = load_model(checkpoint, mtp=True)
    generator = Generator.from_engine_dir(engine, mtp=3)
    ids = prompt(model.cfg, 26, seed=5)
    [result] = generator.generate([ids], SamplingParams(max_new_tokens=30, ignore_eos=True))
    expected = oracle_accepted_counts(model, ids, 3, 30)
    got = result.metrics["accepted_per_step"]
    assert got == expected[: len(got)]
    if agree:
        assert result.metrics["mean_acceptance_length"] > 2.0, "the agreeing draft is accepted often"
        assert 0 < result.metrics["per_position_acceptance"][-1] < 1 or min(got) < 3, "rejections happen too"
