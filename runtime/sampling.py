"""Sampling parameters, the distributions they define, and lossless acceptance of drafted tokens.

Greedy (temperature 0): a draft is accepted while it equals the target's argmax; the first mismatch (or the
position after the last draft) gives the bonus token. Sampling: standard speculative sampling (Leviathan et
al.): accept d with probability min(1, p(d)/q(d)); on rejection draw from norm(max(p - q, 0)); after k
acceptances draw the bonus from p. Top-k / top-p shape both p (target) and q (draft) alike, so the output is
distributed exactly as sampling the target alone with the same settings.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import V4EngineError


class RequestError(V4EngineError):
    """A request that cannot be served as given (empty prompt, bad token id, bad sampling value, too long)."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    num_draft_tokens: int | None = None      # drafts per step for this request (0..the scheduler's mtp; None: mtp)

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise RequestError(f"max_new_tokens must be a positive integer (got {self.max_new_tokens!r})")
        if not (self.temperature >= 0):
            raise RequestError(f"temperature must be >= 0 (got {self.temperature!r})")
        if not (0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (got {self.top_k!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities [..., V] (float64) after temperature, top-k and top-p, renormalised."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k, axis=-1)[..., -params.top_k, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        keep_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p < params.top_p     # smallest prefix reaching top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(min(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"), p.shape[-1] - 1))


def accept_greedy(target_logits: np.ndarray, drafts: list[int]) -> tuple[int, int]:
    """(accepted drafts, next token) from the verify logits [k+1, V] of [t, d1..dk]."""
    best = target_logits.argmax(axis=-1)
    n = 0
    while n < len(drafts) and best[n] == drafts[n]:
        n += 1
    return n, int(best[n])


def accept_sampled(p: np.ndarray, q: np.ndarray, drafts: list[int], rng: np.random.Generator) -> tuple[int, int]:
    """(accepted drafts, next token). p [k+1, V] target distributions, q [k, V] the draft's."""
    for i, d in enumerate(drafts):
        if rng.random() * q[i, d] < p[i, d]:          # accept with probability min(1, p/q)
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        return i, draw(residual if residual.sum() > 0 else p[i], rng)
    return len(drafts), draw(p[len(drafts)], rng)
