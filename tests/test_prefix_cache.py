"""Prefix caching: a prompt that starts like an earlier one forks from that prefix's cache state and gets exactly
the tokens, and the acceptance, of a cold run; shared blocks are counted, evicted and never written."""
from __future__ import annotations

import pytest
import torch

from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine("mixed", agree=0.05)[1]          # drafts partly accepted: rejections on both sides


def same_as_cold(engine, chunk: int, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    """Generate `prompts` one after another with the prefix cache and without; assert equal tokens and acceptance;
    the warm runs' metrics."""
    cold = Generator.from_engine_dir(engine, mtp=3, prefix_cache=False, limits=Limits(max_prefill_chunk=chunk))
    warm = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_prefill_chunk=chunk))
    metrics = []
    for i, p in enumerate(prompts):
        want, got = cold.generate([p], params)[0], warm.generate([p], params)[0]
        assert got.token_ids == want.token_ids, f"prompt {i}"
        assert got.metrics["accepted_per_step"] == want.metrics["accepted_per_step"], f"prompt {i}"
        metrics.append(got.metrics)
    return metrics


def test_forks_at_every_residue_of_the_largest_ratio_run_the_tokens_of_a_cold_run(engine):
    gen = Generator.from_engine_dir(engine)
    cfg, layout = gen.manifest.model, gen.manifest.caches["target"]
    ratio = max(cfg.compress_rates.values())
    for fork in range(layout.block_tokens + 1, layout.block_tokens + ratio + 1):     # every residue, past a block
        prefix = tokens(fork, seed=fork)
        # the first prompt's first chunk ends at the fork: a snapshot there; the second forks from it
        metrics = same_as_cold(engine, fork, [prefix + tokens(9, 1), prefix + tokens(fork % 5 + 2, 2)], GREEDY)
        assert [m["prefix_hit_tokens"] for m in metrics] == [0, fork]
        assert all(min(m["accepted_per_step"]) < 3 for m in metrics), "rejected drafts on both sides of the fork"


def test_sampled_requests_fork_exactly_too(engine):
    prefix = tokens(50, seed=7)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=1.0, seed=5)
    block_tokens = Generator.from_engine_dir(engine).manifest.caches["target"].block_tokens
    boundary = 50 // block_tokens * block_tokens
    # one chunk would do each prompt; the first stops first at its last block boundary, which the others share
    metrics = same_as_cold(engine, 512, [prefix + tokens(12, 3), prefix + tokens(4, 4), prefix[: boundary + 1]],
                           params)
    assert [m["prefix_hit_tokens"] for m in metrics] == [0, boundary, boundary]


def test_a_prompt_equal_to_an_earlier_one_recomputes_at_least_its_last_token(engine):
    prompt = tokens(32, seed=9)
    metrics = same_as_cold(engine, 16, [prompt, prompt], GREEDY)
    assert metrics[1]["prefix_hit_tokens"] == 16                   # the snapshot at 32 would leave nothing to run


def test_entries_share_blocks_until_evicted_and_then_free_them(engine):
    gen = Generator.from_engine_dir(engine, mtp=3)
    scheduler = gen.scheduler
    pool, prefix = scheduler.pools["target"], scheduler.prefix
    gen.generate([tokens(40, seed=1)], GREEDY)
    assert scheduler.used_bytes == 0 and prefix.entries, "no request runs; the prefix entries hold blocks"
    held = int((pool.refs > 0).sum())
    assert held > 0 and pool.free_blocks == len(pool.refs) - held
    prefix.clear()
    assert pool.free_blocks == len(pool.refs) and prefix.nbytes == 0 and not prefix.by_blocks


def test_only_blocks_no_running_request_holds_count_as_freeable(engine):
    gen = Generator.from_engine_dir(engine, mtp=3)
    scheduler = gen.scheduler
    prefix = tokens(40, seed=3)
    gen.generate([prefix + [1]], GREEDY)
    entries = list(scheduler.prefix.entries.values())
    assert scheduler.prefix.freeable() == len({b for e in entries for b in e.blocks})
    forked = scheduler.submit(prefix + [2, 3], GREEDY)
    scheduler.step()                    # admitted: a fork at the first prompt's last block boundary, 32
    assert forked.metrics.prefix_hit_tokens == 32
    shared = set(forked.target.blocks) & {b for e in entries for b in e.blocks}
    assert shared and scheduler.prefix.freeable() == len({b for e in entries for b in e.blocks} - shared)
    while scheduler.busy:
        scheduler.step()


def test_a_huge_budget_gets_no_more_blocks_than_max_batch_rows_of_max_seq_len(engine):
    gen = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_batch=2, max_seq_len=256, max_cache_bytes=1 << 40))
    layout = gen.manifest.caches["target"]
    assert len(gen.scheduler.pools["target"].refs) == 2 * (layout.blocks_for(256) + 1)


def test_turning_it_off_keeps_no_entries(engine):
    gen = Generator.from_engine_dir(engine, mtp=3, prefix_cache=False)
    prompt = tokens(40, seed=1)
    first, second = gen.generate([prompt], GREEDY)[0], gen.generate([prompt], GREEDY)[0]
    assert gen.scheduler.prefix is None and second.metrics["prefix_hit_tokens"] == 0
    assert first.token_ids == second.token_ids


def test_the_default_budget_holds_the_snapshots_share_beside_full_pools(engine):
    """Unless a budget is given, the snapshots' share (two per batch row at least) comes on top of pools for
    max_batch sequences of max_seq_len: none of it is cut to make room, and the pools are those of an engine opened
    without a prefix cache. (Short sequences of a wide model are where the floor dominates: here 64 tokens.)"""
    limits = Limits(max_batch=2, max_seq_len=64)
    cached = Generator.from_engine_dir(engine, mtp=3, limits=limits).scheduler
    plain = Generator.from_engine_dir(engine, mtp=3, limits=limits, prefix_cache=False).scheduler
    snapshot = cached.layouts["target"].slot_bytes + cached.drafter.snapshot_bytes()
    assert cached.prefix.max_bytes >= 2 * 2 * snapshot
    assert {part: len(pool.refs) for part, pool in cached.pools.items()} == \
        {part: len(pool.refs) for part, pool in plain.pools.items()}


def test_a_small_budget_still_keeps_two_snapshots_per_batch_row(engine):
    """An eighth of a small budget may hold less than two snapshots per batch row (a wide model's rings): that
    floor keeps the snapshots of a shared prefix, and a later prompt forks from them. (The snapshots are paid from
    the budget, at most half of what the slots leave: here the caches of two sequences of 160 tokens and twice
    the floor.)"""
    probe = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_batch=2)).scheduler
    floor = 2 * 2 * (probe.layouts["target"].slot_bytes + probe.drafter.snapshot_bytes())
    budget = 2 * probe.cache_bytes(160) + 2 * floor
    gen = Generator.from_engine_dir(engine, mtp=3,
                                    limits=Limits(max_batch=2, max_prefill_chunk=32, max_cache_bytes=budget))
    prefix = tokens(96, seed=11)
    first = gen.generate([prefix + tokens(7, 1)], GREEDY)[0]
    entry = next(iter(gen.scheduler.prefix.entries.values()))
    assert budget // 8 < 2 * entry.nbytes <= gen.scheduler.prefix.max_bytes / 2
    second = gen.generate([prefix + tokens(5, 2)], GREEDY)[0]
    assert first.metrics["prefix_hit_tokens"] == 0 and second.metrics["prefix_hit_tokens"] == 96
