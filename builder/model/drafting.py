"""A whole draft cycle in one forward: the draft graph the engine exports (docs/architecture.md §4), for MTP and
for DSpark (`dspark_draft_outputs`, at the end), and the in-graph sampling both draw their drafts with.

One call runs DRAFT-EXTEND over the positions the target committed since the last cycle, takes each row's last
valid position, draws d1, then applies the MTP layer k - 1 more times on its own streams and its own previous
draft, drawing d2..dk: k drafts per row for one engine call instead of k. The layer's weights are the same
parameters each time (one set of initializers in the graph).

Drafts are drawn inside the graph, so the caller hands it each row's sampling settings and one uniform number
per draft. The distribution each draft was drawn from comes back with it (`probs`), which is what lossless
rejection sampling needs: the output is the target's distribution whatever q is, as long as the draft was drawn
from the q the acceptance test is given. The processing mirrors runtime/sampling.distribution (temperature after
subtracting the max, top-k keeping ties, then the smallest top-p prefix) in float32, so the acceptance rates are
the runtime's own (`draft_distribution` says where a filtering row can differ); greedy rows (temperature 0) take
the argmax, first on ties, as numpy does, and their `probs` are one-hot.

Two conditionals skip work no row needs (the distributions of an all-greedy batch, the ranking of a batch that
does not filter). `conditional=False` drops them for CUDA graphs, which cannot hold an If: the branch that
handles every row runs always, with the same results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from v4engine.contract.layout import CAPTURED, CacheGroup

from .dspark import BlockContext, DSpark
from .v4 import LayerCache, LayerDelta, Transformer

DRAFT_CANDIDATES = 2048        # the most likely tokens a filtering (top-k / top-p) row ranks, per draft


@dataclass
class DraftCycleOutput:
    drafts: torch.Tensor            # [B, k] int64: d1..dk of each row
    probs: torch.Tensor             # [B, k, V] float32: the distribution each draft was drawn from
    delta: LayerDelta               # the MTP layer's cache rows of the extend positions [B, S, d] (the drafts' own
                                    # rows are never kept: the next cycle rewrites them from the target's streams)


def draft_distribution(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       conditional: bool = True) -> torch.Tensor:
    """Probabilities [B, V] after temperature [B] (> 0), top-k [B] (0 = all) and top-p [B] (>= 1: all), every row
    with its own settings: sampling.distribution in float32. Rows are ranked only when one of them filters
    (a conditional: ranking costs more than the rest of a draft step), or always when not `conditional`."""
    vocab = logits.shape[-1]
    z = (logits - logits.amax(-1, keepdim=True)) / temperature.unsqueeze(-1)
    filters = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
    if not conditional:
        return _filtered(z, filters, top_k, top_p)
    return torch.cond(filters.any(), _filtered, _unfiltered, (z, filters, top_k, top_p))


def _unfiltered(z: torch.Tensor, filters: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    return torch.softmax(z, dim=-1)


def _filtered(z: torch.Tensor, filters: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """A filtering row ranks only its DRAFT_CANDIDATES most likely tokens (TensorRT's TopK takes k <= 3840, and
    V4's vocabulary is 129,280): top-k keeps ties at the k-th value, then the smallest prefix reaching top_p.
    When the filter would keep more than that, the row drafts from its DRAFT_CANDIDATES most likely tokens:
    still lossless (the distribution returned is the one drawn from), only its acceptance can drop."""
    # descending; ties by lower index in the exported graph (ONNX TopK), as the runtime ranks them (PyTorch eager
    # may order ties otherwise: only a top-p cut through a tie can differ, tests/test_draft_sampling.py)
    ranked, order = torch.topk(z, min(z.shape[-1], DRAFT_CANDIDATES), dim=-1)
    candidates = ranked.shape[-1]
    keep = torch.where((top_k > 0) & (top_k < candidates), top_k, torch.full_like(top_k, candidates))
    kth = ranked.gather(-1, (keep - 1).unsqueeze(-1))
    p = torch.softmax(torch.where(ranked < kth, torch.full_like(ranked, float("-inf")), ranked), dim=-1)
    kept = (torch.cumsum(p, dim=-1) - p < top_p.unsqueeze(-1)) | (top_p >= 1).unsqueeze(-1)
    p = torch.where(kept, p, torch.zeros_like(p))
    filtered = torch.zeros_like(z).scatter(-1, order, p / p.sum(-1, keepdim=True))
    return torch.where(filters.unsqueeze(-1), filtered, torch.softmax(z, dim=-1))


def draw(p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row from p [B, V] with uniform [B] in [0, 1): the first index whose cumulative mass exceeds
    u * total (sampling.draw). If u * total rounds up to the total, the first index reaching the total, which
    always has mass: a token of probability 0 is never drawn."""
    cdf = torch.cumsum(p, dim=-1)
    total = cdf[:, -1:]
    first = (cdf > uniform.unsqueeze(-1) * total) | (cdf >= total)
    return first.to(torch.int32).argmax(-1).to(torch.int64)


def draft_token(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                uniform: torch.Tensor, conditional: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], the distribution it was drawn from [B, V]) for one draft position of every row. A batch of
    greedy rows only takes the argmax (a conditional: it skips the distributions), unless not `conditional`."""
    if not conditional:
        return _sampled(logits, temperature, top_k, top_p, uniform, conditional=False)
    return torch.cond((temperature > 0).any(), _sampled, _greedy, (logits, temperature, top_k, top_p, uniform))


def _greedy(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    best = logits.argmax(-1)
    return best, torch.zeros_like(logits).scatter(-1, best.unsqueeze(-1), 1.0)


def _sampled(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             uniform: torch.Tensor, conditional: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    greedy = temperature == 0
    best, one_hot = _greedy(logits, temperature, top_k, top_p, uniform)
    p = draft_distribution(logits, torch.where(greedy, torch.ones_like(temperature), temperature), top_k, top_p,
                           conditional)
    return torch.where(greedy, best, draw(p, uniform)), torch.where(greedy.unsqueeze(-1), one_hot, p)


def draft_cycle(model: Transformer, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                lengths: torch.Tensor, cache: LayerCache, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, uniforms: torch.Tensor, conditional: bool = True) -> DraftCycleOutput:
    """The extend over hidden/next_ids/positions [B, S] (row b valid for its first lengths[b] >= 1 positions), then
    k = uniforms.shape[1] drafts per row, each draft step at the position after the previous one (`conditional`:
    see the module doc).

    The window a recursive step reads is the W - 1 rows before its position: the cache's window followed by the
    extend's rows, from the row's own length on (never its padding), then each step's own row."""
    layer = model.mtp[0]
    streams, delta = layer.streams(hidden, model.embed(next_ids), next_ids, positions, cache)
    last = (lengths - 1).unsqueeze(-1)                                            # [B, 1]
    rows = streams.gather(1, last.view(-1, 1, 1, 1).expand(-1, 1, *streams.shape[2:]))
    logits = model.head(layer.collapse(rows)).float()[:, 0]                      # heads only where drafts are drawn
    position = positions.gather(1, last)
    keys = torch.cat([cache.window_kv, delta.window_kv], dim=1)                   # positions p0-W+1 .. p0+S-1
    span = cache.window_kv.shape[1]
    index = (lengths.unsqueeze(-1) + torch.arange(span, device=lengths.device)).unsqueeze(-1)
    window = keys.gather(1, index.expand(-1, -1, keys.shape[-1]))                  # the W-1 rows before p_last + 1
    drafts, probs = [], []
    steps = uniforms.shape[1]
    for step in range(steps):
        token, p = draft_token(logits, temperature, top_k, top_p, uniforms[:, step], conditional)
        drafts.append(token)
        probs.append(p)
        if step + 1 == steps:
            break
        position = position + 1
        out = model.draft(rows, token.unsqueeze(-1), position, LayerCache(window_kv=window))
        window = torch.cat([window[:, 1:], out.deltas[0].window_kv], dim=1)
        rows, logits = out.hidden, out.logits[:, 0]
    return DraftCycleOutput(torch.stack(drafts, 1), torch.stack(probs, 1), delta)


def mtp_draft_outputs(model: Transformer, feeds: dict[str, torch.Tensor], caches: list[LayerCache],
                      groups: list[CacheGroup], conditional: bool = True) -> dict[str, torch.Tensor]:
    """The MTP draft graph (contract/drafting.py MtpSpec): its inputs by name -> its outputs by name."""
    cycle = draft_cycle(model, feeds["hidden"], feeds["input_ids"], feeds["positions"], feeds["lengths"], caches[0],
                        feeds["temperature"], feeds["top_k"], feeds["top_p"], feeds["uniforms"], conditional)
    return {"drafts": cycle.drafts, "draft_probs": cycle.probs} | {g.new: getattr(cycle.delta, g.name) for g in groups}


def dspark_draft_outputs(model: DSpark, feeds: dict[str, torch.Tensor], caches: list[LayerCache],
                         groups: list[CacheGroup], conditional: bool = True) -> dict[str, torch.Tensor]:
    """The DSpark draft graph (contract/drafting.py DSparkSpec): one cycle per call.

    The context keys of the newly committed positions (captured/positions [B, S], row b valid for its first
    lengths[b]), then the block at the anchor's position p + 1 = start + length, which sees each stage's ring and
    those new keys over the last min(W, p + 1) positions, then the Markov loop drawing k = uniforms.shape[1]
    drafts. The new keys come back as the rings' rows (`new.*`), committed by length."""
    positions, lengths, uniforms = feeds["positions"], feeds["lengths"], feeds["uniforms"]
    new = model.context_keys(feeds[CAPTURED], positions)                           # per stage [B, S, d]
    W = model.cfg.sliding_window
    start = positions[:, :1]                                                        # [B, 1]
    ring = start - W + torch.arange(W, device=positions.device)                     # [B, W] the rings' positions
    key_pos = torch.cat([ring, positions], dim=1)                                   # [B, W + S]
    end = start + lengths.unsqueeze(1)                                              # [B, 1] p + 1
    visible = (key_pos >= 0) & (key_pos < end) & (key_pos >= end - W)
    contexts = [BlockContext(torch.cat([cache.window_kv, keys], dim=1), visible) for cache, keys in zip(caches, new)]
    anchor = feeds["anchor"]
    y, logits = model.block(anchor, end[:, 0], contexts, uniforms.shape[1])

    def sample(u: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return draft_token(u, feeds["temperature"], feeds["top_k"], feeds["top_p"], uniforms[:, i], conditional)

    out = model.markov_drafts(y, logits, anchor, sample)
    stage = {layer: i for i, layer in enumerate(sorted({g.layer for g in groups}))}
    return {"drafts": out.drafts, "draft_probs": out.probs, "confidence": out.confidence} | \
        {g.new: new[stage[g.layer]] for g in groups}
