"""The runtime: lossless MTP speculative decoding from an engine directory, with exact acceptance."""
from __future__ import annotations

import pytest
import torch

from oracle import load_transformers, transformers_logits
from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState
from v4engine.builder.model.v4 import hyper_head
from v4engine.builder.tiny import TINY_CONFIGS
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
# prompt lengths per config; the longest ends past index_topk compressed CSA rows
PROMPTS = {"mixed": (3, 30), "split_groups": (9, 40), "flash_like": (5, 60)}


def prompt(cfg, length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def oracle_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers, full recompute each step, indexer ties by lowest index."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(transformers_logits(hf, torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(ids):]


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
@torch.no_grad()
def oracle_accepted_counts(model, ids: list[int], k: int, new_tokens: int) -> list[int]:
    """The speculative loop by full recompute (no caches): per verify step, how many drafts greedy accepts."""
    cfg = model.cfg

    def target(seq):
        state = ModelState(cfg, 1)
        return model(torch.tensor([seq]), state.positions(len(seq)), state.views())

    def mtp_rows(hidden, next_ids):
        mtp = model.mtp[0]
        x = mtp.h_proj(mtp.hnorm(hidden)) + mtp.e_proj(mtp.enorm(model.embed(next_ids))).unsqueeze(2)
        empty = ModelState(cfg, 1, draft=True)
        x, _ = mtp(x, next_ids, torch.arange(hidden.shape[1]).unsqueeze(0), empty.views()[0])
        y = mtp.norm(hyper_head(x, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, cfg))
        return model.head(y).float(), x

    seq = list(ids) + [int(target(ids).logits[0, -1].argmax())]
    counts = []
    while len(seq) - len(ids) < new_tokens:
        hidden = target(seq[:-1]).hidden                                # H_0 .. H_{n-1}
        rows_h, rows_t, drafts = hidden, torch.tensor([seq[1:]]), []
        for _ in range(k):
            logits, streams = mtp_rows(rows_h, rows_t)
            drafts.append(int(logits[0, -1].argmax()))
            rows_h = torch.cat([rows_h, streams[:, -1:]], 1)
            rows_t = torch.cat([rows_t, torch.tensor([[drafts[-1]]])], 1)
        verify = target(seq + drafts).logits[0, len(seq) - 1:].argmax(-1).tolist()
        n = 0
        while n < k and verify[n] == drafts[n]:
            n += 1
        counts.append(n)
        seq += drafts[:n] + [verify[n]]
    return counts


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
