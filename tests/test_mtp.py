"""The MTP layer's incremental path equals a plain full-sequence evaluation of its definition (docs/model.md §4).

Row i pairs the target's pre-head streams H_i (of token t_i) with emb(t_{i+1}) at position i and predicts
t_{i+2}; drafts beyond the prompt recurse on the MTP's own output streams and its own previous draft.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState
from v4engine.builder.model.v4 import hyper_head
from v4engine.builder.tiny import TINY_CONFIGS

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def model(request, tiny_checkpoint):
    return load_model(tiny_checkpoint(request.param), mtp=True)


@torch.no_grad()
def mtp_by_definition(model, hidden: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All rows at once, no cache: e_proj(enorm(emb)) + h_proj(hnorm(H)) per stream, block, own hc head + norm,
    shared head. Returns (logits, output streams)."""
    mtp = model.mtp[0]
    n = hidden.shape[1]
    x = mtp.h_proj(mtp.hnorm(hidden)) + mtp.e_proj(mtp.enorm(model.embed(next_ids))).unsqueeze(2)
    empty = ModelState(model.cfg, 1, draft=True)
    x, _ = mtp(x, next_ids, torch.arange(n).unsqueeze(0), empty.views()[0])
    y = mtp.norm(hyper_head(x, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, model.cfg))
    return model.head(y).float(), x


@pytest.mark.parametrize("prompt_len", [1, 6, 29])
def test_draft_extend_over_the_prompt_then_recursive_drafts(model, prompt_len):
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    target = ModelState(cfg, 1)
    with torch.no_grad():
        out = model(ids, target.positions(prompt_len), target.views())
    first = out.logits[:, -1].argmax(-1, keepdim=True)                      # t_n, the target's next token
    hidden = out.hidden
    tokens = torch.cat([ids[:, 1:], first], dim=1)                           # t_{i+1} for rows 0..n-1

    # incremental: the prompt rows in two chunks (DRAFT-EXTEND), then recursive single-row steps (DRAFT)
    draft = ModelState(cfg, 1, draft=True)
    logits, streams = [], []
    for lo, hi in ((0, prompt_len // 2), (prompt_len // 2, prompt_len)):
        if hi > lo:
            with torch.no_grad():
                o = model.draft(hidden[:, lo:hi], tokens[:, lo:hi], draft.positions(hi - lo), draft.views()[0])
            draft.commit(o.deltas, [hi - lo])
            logits.append(o.logits)
            streams.append(o.hidden)
    incremental = torch.cat(logits, dim=1)
    ref_logits, ref_streams = mtp_by_definition(model, hidden, tokens)
    assert (incremental - ref_logits).abs().max().item() <= TOL

    rows_h, rows_t = hidden, tokens
    last_h, last_logits = torch.cat(streams, 1)[:, -1:], incremental[:, -1:]
    for _ in range(3):                                                         # d2, d3, d4
        d = last_logits.argmax(-1)
        with torch.no_grad():
            o = model.draft(last_h, d, draft.positions(1), draft.views()[0])
        draft.commit(o.deltas, [1])
        rows_h, rows_t = torch.cat([rows_h, last_h], 1), torch.cat([rows_t, d], 1)
        ref_logits, ref_streams = mtp_by_definition(model, rows_h, rows_t)
        assert (o.logits - ref_logits[:, -1:]).abs().max().item() <= TOL
        assert (o.hidden - ref_streams[:, -1:]).abs().max().item() <= TOL
        last_h, last_logits = o.hidden, o.logits


def test_training_mode_routes_only_chosen_tokens_to_experts_with_the_same_result(model):
    """The sparse expert path (training) and the dense one (eval, export) are the same sum."""
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(9))
    state = ModelState(cfg, 2)
    with torch.no_grad():
        dense = model(ids, state.positions(17), state.views()).logits
        model.train()
        try:
            sparse = model(ids, state.positions(17), state.views()).logits
        finally:
            model.eval()
    assert (dense - sparse).abs().max().item() <= 1e-5


@pytest.mark.parametrize("lengths", [[5], [9, 2, 4]])
def test_a_draft_cycle_is_the_extend_then_recursive_steps_on_the_cache(model, lengths):
    """draft_cycle (the draft graph) equals calling the layer step by step on a cache that commits each step:
    the extend over each row's own positions (a shorter row's padding never read), then k - 1 recursive steps.
    Greedy rows draft the argmax; a sampling row's distribution is sampling.distribution's (float32)."""
    from v4engine.builder.model.drafting import draft_cycle
    from v4engine.runtime.sampling import SamplingParams, distribution

    cfg, k, B = model.cfg, 3, len(lengths)
    gen = torch.Generator().manual_seed(sum(lengths))
    S = max(lengths)
    hidden = torch.randn(B, S, cfg.hc_mult, cfg.hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    state = ModelState(cfg, B, draft=True)
    history = torch.randn(B, 70, cfg.hc_mult, cfg.hidden_size, generator=gen)      # a past longer than the window
    with torch.no_grad():
        past = model.draft(history, torch.randint(0, cfg.vocab_size, (B, 70), generator=gen), state.positions(70),
                           state.views()[0])
    state.commit(past.deltas, [70] * B)
    params = [SamplingParams(temperature=0.0)] + [SamplingParams(temperature=0.8, top_k=30, top_p=0.95)] * (B - 1)
    settings = {"temperature": torch.tensor([p.temperature for p in params]),
                "top_k": torch.tensor([p.top_k for p in params]), "top_p": torch.tensor([p.top_p for p in params])}
    with torch.no_grad():
        cycle = draft_cycle(model, hidden, ids, state.positions(S), torch.tensor(lengths), state.views()[0],
                            uniforms=torch.rand(B, k, generator=gen), **settings)
        for b, n in enumerate(lengths):                        # each row alone, one call per step
            row = ModelState(cfg, 1, draft=True)
            row.commit([type(past.deltas[0])(window_kv=past.deltas[0].window_kv[b:b + 1])], [70])
            o = model.draft(hidden[b:b + 1, :n], ids[b:b + 1, :n], row.positions(n), row.views()[0])
            assert (cycle.delta.window_kv[b, :n] - o.deltas[0].window_kv[0]).abs().max().item() <= TOL
            row.commit(o.deltas, [n])
            logits = o.logits[:, -1]
            for step in range(k):
                if params[b].greedy:
                    assert cycle.drafts[b, step].item() == int(logits.argmax())
                else:
                    p = distribution(logits[0].numpy(), params[b])
                    assert np.abs(cycle.probs[b, step].numpy() - p).max() <= 1e-5
                d = cycle.drafts[b, step:step + 1].unsqueeze(0)
                o = model.draft(o.hidden[:, -1:], d, row.positions(1), row.views()[0])
                row.commit(o.deltas, [1])
                logits = o.logits[:, -1]


@pytest.mark.parametrize("temperatures, top_k", [([0.0, 0.0], 0), ([0.0, 0.9], 0), ([0.7, 1.0], 40)])
def test_a_draft_cycle_without_conditionals_is_the_same_cycle(model, temperatures, top_k):
    """For CUDA graphs the draft graph has no If: the branch handling every row runs always (conditional=False).
    Drafts, distributions and cache rows are exactly those of the conditional cycle, for an all-greedy batch (the
    skipped distributions), a greedy row beside a sampled one, and filtering rows (the skipped ranking)."""
    from v4engine.builder.model.drafting import draft_cycle

    cfg, B, S = model.cfg, len(temperatures), 4
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(B, S, cfg.hc_mult, cfg.hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    state = ModelState(cfg, B, draft=True)
    args = dict(temperature=torch.tensor(temperatures), top_k=torch.tensor([top_k] * B),
                top_p=torch.tensor([1.0] * B), uniforms=torch.rand(B, 3, generator=gen))
    with torch.no_grad():
        cycles = [draft_cycle(model, hidden, ids, state.positions(S), torch.tensor([S, S - 1]), state.views()[0],
                              **args, conditional=conditional) for conditional in (True, False)]
    assert torch.equal(cycles[0].drafts, cycles[1].drafts)
    assert torch.equal(cycles[0].probs, cycles[1].probs)
    assert torch.equal(cycles[0].delta.window_kv, cycles[1].delta.window_kv)
