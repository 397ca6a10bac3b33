"""DSpark, the drafter of the current V4 releases (V4-Flash-0731, V4-Pro-0813, the -DSpark repacks), in PyTorch.

As DeepSeek's reference `inference/model.py` of the 0731 release defines it (docs/model.md §4.2). The target
captures, at every position it runs, the mean over its hc streams of the residual after each of
`dspark_target_layer_ids` (`capture`). From those rows each stage keeps a ring of context keys: `main_x =
main_norm(main_proj(captured))`, then the stage's own kv_norm(wkv(main_x)) rotated at the row's position
(`context_keys`). A cycle then runs one block of N slots `[anchor, noise x (N - 1)]` at positions p+1 .. p+N
through the stages (V4 blocks whose attention sees the ring and the whole block: bidirectional, with the sink),
the last stage's hc head, norm and the target's head, and drafts left to right with the Markov head's correction
of each slot's logits by the previous token (`markov_drafts`), and a confidence logit per draft.

Parameter names are the checkpoint's (`mtp.0.main_proj.weight`, `mtp.2.markov_head.markov_w1.weight`); the
embedding and head are the target's (`embed.weight`, `head.weight`), shared.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from v4engine.contract.config import SLIDING, DSparkConfig, V4Config
from v4engine.plugins.attention import attend_with_sink

from .v4 import Attention, Block, ExportedModel, RMSNorm, Rotary, hyper_head, linear

# (logits [B, V], row index of this draft) -> (drafts [B], the distribution each was drawn from [B, V])
DraftSampler = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def capture(streams: list[torch.Tensor]) -> torch.Tensor:
    """The rows DSpark reads of the target [B,S,L*D]: each captured layer's output streams [B,S,hc,D] averaged over
    the streams (a plain mean, not the hc_pre collapse), concatenated in dspark_target_layer_ids order."""
    return torch.cat([x.float().mean(dim=2).to(x.dtype) for x in streams], dim=-1)


@dataclass
class BlockContext:
    """What a DSpark stage's attention reads beside the block: its ring's context keys [B,T,d] and which of them
    the block sees [B,T] (the last min(W, p + 1) committed positions)."""

    keys: torch.Tensor
    visible: torch.Tensor


class DSparkAttention(Attention):
    """V4's attention (one K=V head, per-head q norm, sink, grouped output) over the context keys and the block's
    own keys, bidirectional within the block; the block's keys are never kept."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: BlockContext) -> tuple[torch.Tensor, None]:
        cos, sin = self.rotary.at(positions)
        q, _ = self.queries(x, cos, sin)                                        # [B, N, H, d]
        keys = torch.cat([context.keys, self.keys(x, cos, sin)], dim=1)           # [B, T + N, d]
        block = torch.ones_like(positions, dtype=torch.bool)                      # [B, N]
        visible = torch.cat([context.visible, block], dim=1).unsqueeze(1).expand(-1, x.shape[1], -1)  # [B, N, T+N]
        o = attend_with_sink(q, keys.unsqueeze(1), visible, self.attn_sink, self.cfg.head_dim ** -0.5)
        return self.output(o, cos, sin), None


class MarkovHead(nn.Module):
    """A rank-r bigram correction: W1 embeds the previous token, W2 maps that to a bias on every logit."""

    def __init__(self, cfg: V4Config, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, rank)
        self.markov_w2 = linear(rank, cfg.vocab_size)


class ConfidenceHead(nn.Module):
    """One logit per draft from [y_i ; W1[prev_i]]: its chance of surviving, given the drafts before it survived."""

    def __init__(self, cfg: V4Config, rank: int):
        super().__init__()
        self.proj = linear(cfg.hidden_size + rank, 1)


class DSparkStage(Block):
    """One stage `mtp.s`: a V4 block (sliding kind, score routing) with DSpark's attention. The first stage also
    holds main_proj and main_norm; the last the hc head, norm, Markov and confidence heads."""

    def __init__(self, cfg: V4Config, dspark: DSparkConfig, first: bool, last: bool):
        super().__init__(cfg, SLIDING, hashed=False, attention=DSparkAttention)
        n, D = cfg.hc_mult, cfg.hidden_size
        if first:
            self.main_proj = linear(len(dspark.target_layer_ids) * D, D)
            self.main_norm = RMSNorm(D, cfg.rms_norm_eps)
        if last:
            self.norm = RMSNorm(D, cfg.rms_norm_eps)
            self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D))
            self.hc_head_base = nn.Parameter(torch.zeros(n))
            self.hc_head_scale = nn.Parameter(torch.ones(1))
            self.markov_head = MarkovHead(cfg, dspark.markov_rank)
            self.confidence_head = ConfidenceHead(cfg, dspark.markov_rank)


@dataclass
class DSparkOutput:
    drafts: torch.Tensor            # [B, N] int64
    probs: torch.Tensor             # [B, N, V] float32: the distribution each draft was drawn from
    logits: torch.Tensor            # [B, N, V] float32: the corrected logits U_i (before temperature)
    confidence: torch.Tensor        # [B, N] float32: the confidence head's logits


class DSpark(ExportedModel):
    """The DSpark drafter with the target's embedding and head (the module its draft graph is exported from)."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        if cfg.dspark is None:
            raise ValueError(f"{cfg.source}: no dspark_* fields, so no DSpark drafter")
        self.cfg, self.dspark = cfg, cfg.dspark
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.head = linear(cfg.hidden_size, cfg.vocab_size)
        stages = cfg.dspark.stages
        self.mtp = nn.ModuleList(DSparkStage(cfg, cfg.dspark, s == 0, s == stages - 1) for s in range(stages))
        self.rotary = Rotary(cfg, SLIDING)        # theta rope_theta, no YaRN: DSpark's attention is sliding-only

    def context_keys(self, captured: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Each stage's context keys [B,S,d] of the captured rows [B,S,L*D] at positions [B,S]: the rows its ring
        keeps. main_x enters the stages only as their keys, never their streams."""
        first = self.mtp[0]
        main_x = first.main_norm(first.main_proj(captured))                      # [B, S, D]
        cos, sin = self.rotary.at(positions)
        return [stage.attn.keys(main_x, cos, sin) for stage in self.mtp]

    def block(self, anchor: torch.Tensor, position: torch.Tensor, contexts: list[BlockContext], n: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block [anchor, noise x (n - 1)] at positions position .. position + n - 1 (anchor, position: [B])
        through the stages: (y [B,n,D], the last stage's hc head output; logits [B,n,V] float32, before Markov)."""
        noise = torch.full((anchor.shape[0], n - 1), self.dspark.noise_token_id, dtype=anchor.dtype,
                           device=anchor.device)
        ids = torch.cat([anchor.unsqueeze(1), noise], dim=1)                       # [B, n]
        positions = position.unsqueeze(1) + torch.arange(n, device=anchor.device)  # [B, n]
        x = self.embed(ids).unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1)      # [B, n, hc, D]
        for stage, context in zip(self.mtp, contexts):
            x, _ = stage(x, ids, positions, context)
        last = self.mtp[-1]
        y = hyper_head(x, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, self.cfg)
        return y, self.head(last.norm(y)).float()

    def markov_drafts(self, y: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, sample: DraftSampler
                      ) -> DSparkOutput:
        """Left to right from prev_0 = the anchor: U_i = logits_i + W2 . W1[prev_i], d_{i+1} = sample(U_i),
        confidence_i = proj([y_i ; W1[prev_i]])."""
        last = self.mtp[-1]
        markov, proj = last.markov_head, last.confidence_head.proj
        prev, drafts, probs, corrected, confidence = anchor, [], [], [], []
        for i in range(logits.shape[1]):
            e = markov.markov_w1(prev)                                             # [B, r]
            u = logits[:, i] + markov.markov_w2(e).float()                         # [B, V]
            token, p = sample(u, i)
            confidence.append(proj(torch.cat([y[:, i], e], dim=-1)).float()[:, 0])
            drafts.append(token)
            probs.append(p)
            corrected.append(u)
            prev = token
        return DSparkOutput(torch.stack(drafts, 1), torch.stack(probs, 1), torch.stack(corrected, 1),
                            torch.stack(confidence, 1))


def greedy_sampler(logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax (first on ties) and its one-hot distribution."""
    best = logits.argmax(-1)
    return best, torch.zeros_like(logits).scatter(-1, best.unsqueeze(-1), 1.0)


__all__ = ["BlockContext", "DSpark", "DSparkAttention", "DSparkOutput", "DSparkStage", "capture", "greedy_sampler"]
