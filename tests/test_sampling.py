"""Lossless speculative sampling: with MTP drafting, sampled tokens follow the target's own distribution, whether
tokens are decided on the host (numpy, runtime/samplers.py HostSampler) or where a device session leaves its
logits (torch, DeviceSampler; here on the CPU through `device_pools=True`, the same path a GPU session takes)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState
from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams, accept_sampled, distribution
from v4engine.runtime.verify_schedule import StepCosts, VerifyPlanner

N = 3000
SHAPE = dict(temperature=1.0, top_k=6)
GREEDY_20 = SamplingParams(max_new_tokens=20, ignore_eos=True)


def test_accept_sampled_preserves_the_target_distribution_exactly():
    """Monte Carlo over the rejection sampler alone: P(next token) = p, whatever q is."""
    rng = np.random.default_rng(0)
    p = np.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    q = np.array([[0.1, 0.1, 0.1, 0.7]])
    counts = np.zeros(4)
    for _ in range(20000):
        drafted = int(rng.choice(4, p=q[0]))
        n, token = accept_sampled(p, q, [drafted], rng.random(2))
        counts[drafted if n == 1 else token] += 1
    assert np.abs(counts / counts.sum() - p[0]).sum() / 2 < 0.01


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_the_device_rule_preserves_the_target_distribution_exactly():
    """The device sampler's rejection rule alone, every row of a call at once: P(next token) = p, whatever q."""
    from types import SimpleNamespace

    from v4engine.runtime.samplers import DeviceSampler, Job

    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]], dtype=torch.float64)
    q = np.array([[0.1, 0.1, 0.1, 0.7]])
    rng, n = np.random.default_rng(0), 20000
    params = SamplingParams(temperature=1.0)
    jobs = []
    for _ in range(n):
        request = SimpleNamespace(params=params, rng=rng, penalty=None)
        jobs.append(Job(request, 0, 0, [int(rng.choice(4, p=q[0]))], q))
    logits = torch.log(p.clamp(min=1e-30))                      # finite: a probability of 0 is e^-69
    decisions = DeviceSampler("cpu").decide(jobs, logits[None].float())
    counts = np.zeros(4)
    for job, decision in zip(jobs, decisions):
        counts[job.drafts[0] if decision.accepted == 1 else decision.token] += 1
    assert np.abs(counts / n - p[0].numpy()).sum() / 2 < 0.01


def test_the_device_sampler_decides_the_host_samplers_greedy_tokens_and_logprobs(trained_engine):
    """Greedy rows (penalized too), their logprobs (float64 sums in another order: within 1e-6), and a seeded
    sampled row beside them: the same tokens on both paths (each draws its uniforms as the other does)."""
    greedy = [SamplingParams(max_new_tokens=24, logprobs=3), SamplingParams(
        max_new_tokens=24, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)]
    sampled = SamplingParams(max_new_tokens=24, temperature=0.9, top_k=40, top_p=0.9, seed=3)
    prompts = ["def fib(n):", "class Stack:", "import os"]
    results = {}
    for name, options in (("host", None), ("device", {"device_pools": True})):
        generator = Generator.from_engine_dir(trained_engine, mtp=3, backend_options=options)
        assert type(generator.scheduler.sampler).__name__ == f"{name.title()}Sampler"
        results[name] = generator.generate(prompts, greedy + [sampled])
    for host, device in zip(results["host"][:2], results["device"][:2]):
        assert host.token_ids == device.token_ids
    for host, device in zip(results["host"][0].logprobs, results["device"][0].logprobs):
        assert host.token == device.token and abs(host.logprob - device.logprob) < 1e-6
        assert [t for t, _ in host.top] == [t for t, _ in device.top]
    assert results["host"][2].token_ids == results["device"][2].token_ids


@pytest.mark.parametrize("drafter", ["mtp", "prompt_lookup", "dspark", "dspark-greedy-drafts", "dspark-scheduled",
                                     "mtp-device-sampler", "dspark-device-sampler"])
def test_first_two_sampled_tokens_follow_the_target_joint_distribution(tiny_engine, drafter):
    checkpoint, engine = tiny_engine("mixed", agree=0.05) if not drafter.startswith("dspark") else \
        tiny_engine("mixed", mtp=7, drafter="dspark", agree=0.1)
    model = load_model(checkpoint, mtp=False)
    prompt = [5, 17, 99, 3, 42, 8, 61]
    options = {"mtp": 3, "confidence_scheduling": False} if drafter.startswith("dspark") else {"mtp": 3}
    drafts = {"draft_sample_method": "greedy"} if drafter == "dspark-greedy-drafts" else {}
    if drafter == "prompt_lookup":      # a prompt that repeats its n-grams: the target's own greedy cycle
        cycle = Generator.from_engine_dir(engine, mtp=0).generate([prompt[:3]], GREEDY_20)[0].token_ids
        prompt, options = prompt[:3] + cycle, {"drafter": "prompt_lookup", "mtp": 3}
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, **SHAPE)

    def target_probs(seq: list[int]) -> np.ndarray:
        state = ModelState(model.cfg, 1)
        with torch.no_grad():
            logits = model(torch.tensor([seq]), state.positions(len(seq)), state.views()).logits[0, -1].numpy()
        return distribution(logits, params)

    p1 = target_probs(prompt)
    exact = {(a, b): p1[a] * pb for a in np.flatnonzero(p1) for b, pb in enumerate(target_probs(prompt + [a]))
             if pb > 0}

    device = {"backend_options": {"device_pools": True}} if drafter.endswith("device-sampler") else {}
    generator = Generator.from_engine_dir(engine, limits=Limits(max_batch=64), **options, **device)
    if drafter == "dspark-scheduled":       # widths that vary with the drafts' confidence (runtime/verify_schedule.py)
        widths = (tuple(1e-3 + 2e-4 * w for w in range(1, 5)),)      # a draft pays where its survival beats ~0.3
        generator.scheduler.planner = VerifyPlanner(StepCosts((1,), (1.2e-3,), (1e-4,), widths, (0.0,), (1e-2,), (0.0,)))
    results = generator.generate([prompt] * N, [SamplingParams(max_new_tokens=2, ignore_eos=True, seed=s, **SHAPE,
                                                              **drafts) for s in range(N)])
    observed: dict[tuple[int, int], int] = {}
    for r in results:
        observed[tuple(r.token_ids)] = observed.get(tuple(r.token_ids), 0) + 1
    assert set(observed) <= set(exact), "only tokens the target can sample"
    assert generator.totals.accepted > 0 and generator.totals.accepted < generator.totals.drafted

    tv = 0.5 * sum(abs(observed.get(cell, 0) / N - prob) for cell, prob in exact.items())
    assert tv < 0.06, f"total variation {tv:.3f}"
    cells = [c for c, prob in exact.items() if prob * N >= 5]
    rest = 1 - sum(exact[c] for c in cells)
    stat = sum((observed.get(c, 0) - exact[c] * N) ** 2 / (exact[c] * N) for c in cells)
    if rest * N >= 5:
        other = N - sum(observed.get(c, 0) for c in cells)
        stat += (other - rest * N) ** 2 / (rest * N)
        cells.append(None)
    assert stat < chi2_critical(len(cells) - 1), f"chi-square {stat:.1f} over {len(cells)} cells"


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 0.9), (0.7, 0, 0.5), (1.3, 20, 0.95), (1.0, 5, 0.3),
                                                       (0.5, 0, 0.999), (1.0, 0, 1e-6)])
def test_temperature_top_k_and_top_p_shape_the_distribution_as_transformers_does(temperature, top_k, top_p):
    """The oracle: transformers' own logits warpers, applied in the same order (temperature, top-k, top-p)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = np.random.default_rng(7).normal(0, 3, size=(16, 512))
    scores = torch.from_numpy(logits)
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
    for warp in warpers + [TopPLogitsWarper(top_p)]:
        scores = warp(None, scores)
    want = torch.softmax(scores, dim=-1).numpy()
    got = distribution(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert np.array_equal(got > 0, want > 0), "the same tokens are kept"
    assert np.abs(got - want).max() < 1e-12
