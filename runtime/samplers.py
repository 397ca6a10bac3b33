"""Where a step's tokens are decided: each row's next token after a prompt, and the drafts a verify accepts with the
token after them (greedy, or the lossless rejection rule of sampling.py, with temperature, top-k, top-p and
penalties), from the target's logits.

- `HostSampler`: numpy on the host (sampling.py), row by row, for sessions whose outputs are numpy arrays (the CPU).
- `DeviceSampler`: torch where the logits are, every row of a call at once, for sessions that keep their caches on
  a device (their logits and draft distributions stay there: sessions/onnxruntime.py, tensorrt.py, migraphx.py):
  only the accepted ids, and the logprobs a request asks for, come back to the host, a few bytes a row, where a
  batch-8 verify's logits at V4's vocabulary are 16.5 MB. Its random numbers come from each request's own generator
  on the host, drawn as the host path draws them (j + 1 for a verify of j drafts, one for a first token:
  sampling.accept_sampled), so a seed gives the same tokens on both paths but where their float sums round apart.
  Penalties read counts kept on
  the device, brought up to date with each step's new tokens only. It computes in float64 as sampling.py does.
  With `device_pools=True` on ONNX Runtime's CPU provider it runs on torch CPU tensors: the same path, tested here.
Both are held to the same distribution tests (tests/test_sampling.py) and give the same greedy tokens.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from v4engine.contract.errors import V4EngineError

from .pool_arrays import to_numpy
from .sampling import (TokenLogprob, accept_greedy, accept_sampled, distribution, draw, penalize, token_logprob)

if TYPE_CHECKING:
    from .scheduler import Request


@dataclass
class Job:
    """One row's decision in a target call: `request`, its row `b` of the logits, the first position read
    (`start`: a prompt's last position; 0 for a verify), the drafts the positions after it verify and the
    distributions they were drawn from (`q` [len(drafts), V]: numpy or torch; None: one-hot)."""

    request: Request
    b: int
    start: int
    drafts: list[int] = field(default_factory=list)
    q: Any = None


@dataclass(frozen=True)
class Decision:
    """How many drafts are accepted and the token after them; the logprobs of those tokens when asked."""

    accepted: int
    token: int
    logprobs: tuple[TokenLogprob, ...] = ()


def not_finite(r: Request) -> V4EngineError:
    """A step fails, naming the request, on NaN or inf logits (broken weights, an overflow), which would decode as
    token 0, or the last id, forever."""
    return V4EngineError(f"request {r.id}: the target's logits at position {r.target.length} are not finite (NaN "
                         "or inf); the engine's weights or its numerics are broken")


class HostSampler:
    """Decisions in numpy on the host, a row at a time (sampling.py)."""

    def decide(self, jobs: list[Job], logits: np.ndarray) -> list[Decision]:
        return [self._decide(job, to_numpy(logits)[job.b, job.start: job.start + len(job.drafts) + 1])
                for job in jobs]

    @staticmethod
    def _decide(job: Job, rows: np.ndarray) -> Decision:
        r = job.request
        if not np.isfinite(rows).all():
            raise not_finite(r)
        target = penalize(rows, r.params, r.penalty, job.drafts)                       # [j + 1, V]
        if r.params.greedy:
            accepted, token = accept_greedy(target, job.drafts)
        elif job.drafts:
            q = _one_hot(job.drafts, rows.shape[-1]) if job.q is None else to_numpy(job.q)
            accepted, token = accept_sampled(distribution(target, r.params), q, job.drafts,
                                             r.rng.random(len(job.drafts) + 1))
        else:
            accepted, token = 0, draw(distribution(target, r.params)[0], r.rng)
        logprobs = () if r.params.logprobs is None else tuple(
            token_logprob(rows[i], t, r.params.logprobs) for i, t in enumerate(job.drafts[:accepted] + [token]))
        return Decision(accepted, token, logprobs)


def _one_hot(tokens: list[int], vocab: int) -> np.ndarray:
    q = np.zeros((len(tokens), vocab))
    q[np.arange(len(tokens)), tokens] = 1.0
    return q


class DeviceSampler:
    """Decisions in torch where the logits are, every row of a call at once (the module doc)."""

    def __init__(self, device: str):
        import torch

        self.torch, self.device = torch, torch.device(device)
        self._penalties: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # request -> _DevicePenalty

    def decide(self, jobs: list[Job], logits: Any) -> list[Decision]:
        if not jobs:
            return []
        torch = self.torch
        if isinstance(logits, torch.Tensor):          # where the session left them: decided there
            self.device = logits.device
        logits = torch.as_tensor(logits, device=self.device)                          # [B, S, V] (no copy)
        width = max(len(job.drafts) for job in jobs) + 1
        rows = torch.stack([_window(torch, logits[job.b], job.start, width) for job in jobs]).double()  # [J, W, V]
        vocab = rows.shape[-1]
        counts = torch.tensor([len(job.drafts) for job in jobs], device=self.device)                  # [J]
        drafts = torch.zeros(len(jobs), max(width - 1, 1), dtype=torch.long)                          # [J, W - 1]
        for i, job in enumerate(jobs):
            drafts[i, : len(job.drafts)] = torch.tensor(job.drafts, dtype=torch.long)
        drafts = drafts.to(self.device)
        valid = torch.arange(width, device=self.device)[None, :] <= counts[:, None]                   # [J, W]
        finite = torch.where(valid[..., None], torch.isfinite(rows), True).all(-1).all(-1).cpu()      # [J]
        if not bool(finite.all()):
            raise not_finite(jobs[int((~finite).nonzero()[0])].request)
        target = self._penalized(jobs, rows, drafts)                                                  # [J, W, V]
        greedy = [job.request.params.greedy for job in jobs]
        accepted = torch.zeros(len(jobs), dtype=torch.long, device=self.device)
        tokens = torch.zeros(len(jobs), dtype=torch.long, device=self.device)
        picked = [i for i, g in enumerate(greedy) if g]
        if picked:
            index = torch.tensor(picked, device=self.device)
            a, t = _accept_greedy(torch, target[index], drafts[index], counts[index])
            accepted[index], tokens[index] = a, t
        sampled = [i for i, g in enumerate(greedy) if not g]
        if sampled:
            index = torch.tensor(sampled, device=self.device)
            a, t = self._accept_sampled([jobs[i] for i in sampled], target[index], drafts[index], counts[index],
                                        vocab)
            accepted[index], tokens[index] = a, t
        accepted, tokens = accepted.cpu().tolist(), tokens.cpu().tolist()
        logprobs = self._logprobs(jobs, rows, accepted, tokens)
        for job in jobs:                   # the counts on the device learn this step's tokens at the next use
            if job.request.penalty is not None:
                self._penalty(job.request)
        return [Decision(a, t, lp) for a, t, lp in zip(accepted, tokens, logprobs)]

    # ------------------------------------------------------------------ the rules, batched
    def _accept_sampled(self, jobs: list[Job], target: Any, drafts: Any, counts: Any, vocab: int) -> tuple[Any, Any]:
        """The rejection rule on every row (sampling.accept_sampled): a draft survives with probability
        min(1, p/q); at the first rejection the token is drawn from norm(max(p - q, 0)) (p where that is empty),
        after all of them from p at the next position."""
        torch = self.torch
        width = target.shape[1]
        temperature = torch.tensor([j.request.params.temperature for j in jobs], dtype=torch.float64,
                                   device=self.device)
        top_k = torch.tensor([min(j.request.params.top_k, vocab) for j in jobs], device=self.device)
        top_p = torch.tensor([j.request.params.top_p for j in jobs], dtype=torch.float64, device=self.device)
        p = _distribution(torch, target, temperature, top_k, top_p)                                   # [J, W, V]
        q = torch.zeros(len(jobs), max(width - 1, 1), vocab, dtype=torch.float64, device=self.device)
        uniforms = torch.zeros(len(jobs), width + 1, dtype=torch.float64)
        for i, job in enumerate(jobs):
            n = len(job.drafts)
            if n:
                q[i, :n] = torch.as_tensor(job.q[:n], device=self.device).double() if job.q is not None else \
                    torch.nn.functional.one_hot(torch.tensor(job.drafts, device=self.device), vocab).double()
            uniforms[i, : n + 1] = torch.from_numpy(job.request.rng.random(n + 1))
        uniforms = uniforms.to(self.device)
        slots = drafts.shape[1]                     # W - 1, or 1 (unused) when no row drafts
        steps = torch.arange(slots, device=self.device)[None, :]
        p_draft = p[:, :slots].gather(-1, drafts[..., None])[..., 0]                                 # [J, W - 1]
        q_draft = q.gather(-1, drafts[..., None])[..., 0]
        survives = (uniforms[:, :slots] * q_draft < p_draft) | (steps >= counts[:, None])
        accepted = torch.minimum(survives.long().cumprod(-1).sum(-1), counts)                       # [J]
        rows = torch.arange(len(jobs), device=self.device)
        at = p[rows, accepted]                                                                       # [J, V]
        rejected = accepted < counts
        q_at = torch.where(rejected[:, None], q[rows, accepted.clamp(max=q.shape[1] - 1)], 0.0)
        residual = (at - q_at).clamp(min=0)
        residual = torch.where((residual.sum(-1) > 0)[:, None], residual, at)
        return accepted, _draw(torch, residual, uniforms[rows, counts])

    def _penalized(self, jobs: list[Job], rows: Any, drafts: Any) -> Any:
        """The rows' logits with each request's penalties (sampling.penalize): position i reads the output so far
        and drafts[:i]."""
        penalized = [i for i, job in enumerate(jobs) if job.request.penalty is not None]
        if not penalized:
            return rows
        torch, out = self.torch, rows.clone()
        width = rows.shape[1]
        for i in penalized:
            job = jobs[i]
            params, state = job.request.params, self._penalty(job.request)
            occurrences = state.counts.expand(width, -1).clone()                                     # [W, V]
            for position, token in enumerate(job.drafts):
                occurrences[position + 1:, token] += 1
            seen = (occurrences > 0) | state.prompt[None, :]
            row = out[i]
            if params.repetition_penalty != 1:
                scaled = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
                row = torch.where(seen, scaled, row)
            out[i] = row - params.frequency_penalty * occurrences - params.presence_penalty * (occurrences > 0)
        return out

    def _penalty(self, r: Request) -> _DevicePenalty:
        """The request's penalty counts on the device, brought up to date with its output so far."""
        torch, state = self.torch, self._penalties.get(r)
        if state is None:
            vocab = len(r.penalty.counts)
            prompt = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            prompt[torch.tensor(r.prompt, device=self.device)] = True
            state = self._penalties[r] = _DevicePenalty(torch.zeros(vocab, dtype=torch.float64, device=self.device),
                                                        prompt, 0)
        new = r.generated[state.synced:]
        if new:
            state.counts.index_add_(0, self.torch.tensor(new, device=self.device),
                                    self.torch.ones(len(new), dtype=self.torch.float64, device=self.device))
            state.synced += len(new)
        return state

    def _logprobs(self, jobs: list[Job], rows: Any, accepted: list[int], tokens: list[int]
                  ) -> list[tuple[TokenLogprob, ...]]:
        """Each asking request's emitted tokens' log-probabilities under the raw logits, with its most likely
        alternatives (ties by lower id among those the device ranks first)."""
        asked = [i for i, job in enumerate(jobs) if job.request.params.logprobs is not None]
        out: list[tuple[TokenLogprob, ...]] = [()] * len(jobs)
        if not asked:
            return out
        torch = self.torch
        logp = torch.log_softmax(rows[torch.tensor(asked, device=self.device)], dim=-1)              # [A, W, V]
        most = max(jobs[i].request.params.logprobs for i in asked)
        values, ids = (logp.topk(most, dim=-1) if most else (logp[..., :0], logp[..., :0].long()))
        logp, values, ids = logp.cpu().numpy(), values.cpu().numpy(), ids.cpu().numpy()
        for n, i in enumerate(asked):
            job, top = jobs[i], jobs[i].request.params.logprobs
            emitted = job.drafts[: accepted[i]] + [tokens[i]]
            out[i] = tuple(TokenLogprob(t, float(logp[n, w, t]), tuple(sorted(
                ((int(k), float(v)) for k, v in zip(ids[n, w, :top], values[n, w, :top])),
                key=lambda kv: (-kv[1], kv[0])))) for w, t in enumerate(emitted))
        return out


@dataclass
class _DevicePenalty:
    counts: Any          # [V] float64: each token's occurrences in the output
    prompt: Any          # [V] bool: the prompt's tokens (repetition penalty reads prompt and output)
    synced: int          # output tokens counted so far


def _window(torch: Any, logits: Any, start: int, width: int) -> Any:
    """logits[start: start + width] of one row [S, V], padded to `width` positions by repeating the last."""
    part = logits[start: start + width]
    if part.shape[0] < width:
        part = torch.cat([part, part[-1:].expand(width - part.shape[0], -1)])
    return part


def _accept_greedy(torch: Any, target: Any, drafts: Any, counts: Any) -> tuple[Any, Any]:
    """sampling.accept_greedy on every row: drafts are accepted while they equal the argmax (first on ties)."""
    best = target.argmax(-1)                                                                         # [J, W]
    steps = torch.arange(drafts.shape[1], device=drafts.device)[None, :]
    matches = (best[:, : drafts.shape[1]] == drafts) & (steps < counts[:, None])
    accepted = matches.long().cumprod(-1).sum(-1)
    return accepted, best.gather(1, accepted[:, None])[:, 0]


def _distribution(torch: Any, logits: Any, temperature: Any, top_k: Any, top_p: Any) -> Any:
    """sampling.distribution, rows with their own settings: [J, W, V] float64 logits -> probabilities."""
    z = (logits - logits.amax(-1, keepdim=True)) / temperature[:, None, None]
    vocab = z.shape[-1]
    filtering = (top_k > 0) & (top_k < vocab)
    if bool(filtering.any()):
        ranked = z.sort(dim=-1, descending=True).values
        kth = ranked.gather(-1, (top_k.clamp(min=1) - 1)[:, None, None].expand(-1, z.shape[1], 1))
        z = torch.where(filtering[:, None, None] & (z < kth), float("-inf"), z)
    p = torch.softmax(z, dim=-1)
    if bool((top_p < 1).any()):
        sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p[:, None, None]
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        keep = keep | (top_p >= 1)[:, None, None]
        p = torch.where(keep, p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def _draw(torch: Any, p: Any, uniform: Any) -> Any:
    """sampling.draw on every row: the first index whose cumulative mass exceeds u * total."""
    cdf = p.cumsum(-1)
    index = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0]
    return index.clamp(max=p.shape[-1] - 1)


__all__ = ["Job", "Decision", "HostSampler", "DeviceSampler", "not_finite"]
