"""The MTP layer's incremental path equals a plain full-sequence evaluation of its definition (docs/model.md §4).

Row i pairs the target's pre-head streams H_i (of token t_i) with emb(t_{i+1}) at position i and predicts
t_{i+2}; drafts beyond the prompt recurse on the MTP's own output streams and its own previous draft.
"""
from __future__ import annotations

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
