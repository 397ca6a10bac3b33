"""Sampling parameters, the distributions they define, and lossless acceptance of drafted tokens.

Greedy (temperature 0): a draft is accepted while it equals the target's argmax; the first mismatch (or the
position after the last draft) gives the bonus token. Sampling: standard speculative sampling (Leviathan et
al.): accept d with probability min(1, p(d)/q(d)); on rejection draw from norm(max(p - q, 0)); after k
acceptances draw the bonus from p. Top-k / top-p shape both p (target) and q (draft) alike, so the output is
distributed exactly as sampling the target alone with the same settings.
"""
from __future__ import annotations

import math
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from v4engine.contract.errors import V4EngineError

MAX_STOP_STRINGS = 16            # stop strings per request
MAX_STOP_LENGTH = 256            # characters per stop string
MAX_SEED = 2**64 - 1
MAX_CACHE_SALT = 256             # characters of a cache_salt
MAX_LOGPROBS = 20                # most likely alternatives reported per position
MAX_PENALTY = 2.0                # presence and frequency penalties, as OpenAI bounds them
MAX_REPETITION_PENALTY = 10.0


class RequestError(V4EngineError):
    """A request that cannot be served as given (empty prompt, bad token id, bad sampling value, too long)."""


def is_integer(value) -> bool:
    """An int or a numpy integer; never a bool (True would pass for 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_finite(value) -> bool:
    """A finite int, float or numpy number (an int beyond the floats' range is not); never a bool."""
    if not (is_integer(value) or isinstance(value, (float, np.floating))):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_sequence(value) -> bool:
    """A list or a tuple (a string is a sequence too, of characters: never what a caller means here)."""
    return isinstance(value, (list, tuple))


DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. `validate` refuses, in one line naming the field, every value that cannot be
    served exactly; nothing is clamped or reinterpreted.

    max_new_tokens    an integer >= 1 (the engine's max_seq_len may end a request sooner: finish_reason "length")
    temperature       a finite number >= 0; 0 is greedy. However tiny (1e-320 too) it samples exactly the T -> 0
                      limit of the distribution: the argmax, uniform over exact ties
    top_p             a number in (0, 1]; the smallest set of most likely tokens whose mass reaches it
    top_k             an integer >= 0; 0 (or k >= the vocabulary) keeps every token
    seed              None (fresh entropy) or an integer from 0 to 2**64 - 1
    stop              at most MAX_STOP_STRINGS (16) non-empty strings of at most MAX_STOP_LENGTH (256) characters:
                      generation stops once the text holds one, and the text ends where it begins. Bounded
                      because the scheduler's thread checks them after every token of every request
    stop_token_ids    token ids (the scheduler checks them against the vocabulary)
    ignore_eos        a bool: do not stop at the end-of-sequence token
    num_draft_tokens  None (the scheduler's mtp) or an integer from 0 to it (checked by the scheduler)
    draft_sample_method  how a drafter with a graph draws its drafts when the request samples: "probabilistic"
                      (from the draft model's distribution at the request's settings) or "greedy" (its argmax, a
                      one-hot distribution; vLLM's option of the same name); None: the Generator's default
                      (probabilistic unless opened with another). Acceptance is lossless either way
    cache_salt        None or a string of at most MAX_CACHE_SALT (256) characters that keys the prefix cache
                      (vLLM's field): requests of different salts never share an entry, so a tenant cannot learn
                      from timing whether another one sent a prompt. Not a sampling setting, but per request
    logprobs          None, or from 0 to MAX_LOGPROBS (20): each generated token's log-probability under the
                      target (the log-softmax of its raw logits, before temperature, top-k and top-p, as vLLM
                      reports them) and that many most likely alternatives (Request.logprobs)
    prompt_logprobs   the same for every prompt token after the first (Request.prompt_logprobs); the prompt is
                      then computed whole, not taken from the prefix cache
    presence_penalty  from -2 to 2: subtracted from the logit of every token the output already holds (OpenAI's)
    frequency_penalty from -2 to 2: subtracted once per time the output holds the token (OpenAI's)
    repetition_penalty  in (0, 10]: the logit of every token of the prompt or the output is divided by it if
                      positive, multiplied if not (CTRL's, as transformers and vLLM apply it); 1 is none
                      Penalties shape the target's distribution at each position from the output before it
                      (accepted drafts included), so drafts are verified against the penalized target: lossless

    Refused: inf or NaN anywhere, bools for numbers, numbers given as text, a single string for `stop`.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    num_draft_tokens: int | None = None
    draft_sample_method: str | None = None
    cache_salt: str | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def validate(self) -> None:
        if not is_integer(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise RequestError(f"max_new_tokens must be a positive integer (got {reprlib.repr(self.max_new_tokens)})")
        if not (is_finite(self.temperature) and self.temperature >= 0):
            raise RequestError(f"temperature must be a finite number >= 0 (got {reprlib.repr(self.temperature)})")
        if not (is_finite(self.top_p) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p must be a number in (0, 1] (got {reprlib.repr(self.top_p)})")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (got {reprlib.repr(self.top_k)})")
        if self.seed is not None and not (is_integer(self.seed) and 0 <= self.seed <= MAX_SEED):
            raise RequestError(f"seed must be an integer from 0 to 2**64 - 1 (got {reprlib.repr(self.seed)})")
        check_stop(self.stop)
        if not is_sequence(self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be a list of token ids (got {reprlib.repr(self.stop_token_ids)})")
        for i, t in enumerate(self.stop_token_ids):
            if not is_integer(t):
                raise RequestError(f"stop_token_ids[{i}] must be a token id (got {reprlib.repr(t)})")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise RequestError(f"ignore_eos must be true or false (got {reprlib.repr(self.ignore_eos)})")
        if self.draft_sample_method is not None and self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise RequestError(f"draft_sample_method must be one of {', '.join(DRAFT_SAMPLE_METHODS)} "
                               f"(got {reprlib.repr(self.draft_sample_method)})")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str)
                                                and len(self.cache_salt) <= MAX_CACHE_SALT):
            raise RequestError(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters "
                               f"(got {reprlib.repr(self.cache_salt)})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (is_finite(getattr(self, name)) and -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY):
                raise RequestError(f"{name} must be a number from -2 to 2 (got {reprlib.repr(getattr(self, name))})")
        if not (is_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise RequestError(f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (got "
                               f"{reprlib.repr(self.repetition_penalty)})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (is_integer(value) and 0 <= value <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer from 0 to {MAX_LOGPROBS} (got {reprlib.repr(value)})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def check_stop(stop: Sequence[str]) -> None:
    """Refuse stop strings that are not a bounded sequence of non-empty strings, naming the one at fault."""
    if not is_sequence(stop):
        raise RequestError(f"stop must be a list of strings (got {reprlib.repr(stop)})")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are served")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise RequestError(f"stop[{i}] must be a non-empty string (got {reprlib.repr(s)})")
        if len(s) > MAX_STOP_LENGTH:
            raise RequestError(f"stop[{i}] has {len(s)} characters; at most {MAX_STOP_LENGTH} are served")


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target's raw logits, and the `top` most likely tokens' (id, logprob),
    most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """log_softmax(logits) [V] at `token`, in float64, and its `top` largest (ties by lower id). Only the tokens at
    or above the top-th value are sorted: a full sort of V = 129,280 per generated token would cost milliseconds."""
    x = logits.astype(np.float64)
    shifted = x - x.max()
    logp = shifted - np.log(np.exp(shifted).sum())                          # [V]
    best = ()
    if top:
        top = min(top, len(logp))
        candidates = np.flatnonzero(logp >= np.partition(logp, len(logp) - top)[len(logp) - top])
        best = candidates[np.lexsort((candidates, -logp[candidates]))][:top]
    return TokenLogprob(int(token), float(logp[token]), tuple((int(i), float(logp[i])) for i in best))


class PenaltyCounts:
    """What a penalized request's penalties read, kept as it generates: how often each token occurs in its output,
    and which tokens its prompt or output hold. A verify then penalizes in O(V), not in the length of its prompt and
    output (recounting them took 1.5 of a verify's 14.1 ms at 32K prompt and 32K output tokens, V = 129,280)."""

    def __init__(self, vocab_size: int, prompt: Sequence[int]):
        self.counts = np.zeros(vocab_size, np.float64)                                         # [V]
        self.seen = np.zeros(vocab_size, bool)                                                 # [V]
        self.seen[np.asarray(prompt, np.int64)] = True

    def add(self, token: int) -> None:
        """One more output token."""
        self.counts[token] += 1
        self.seen[token] = True


def penalize(logits: np.ndarray, params: SamplingParams, counts: PenaltyCounts | None, drafts: Sequence[int] = ()
             ) -> np.ndarray:
    """logits [n, V] with row i penalized for the output before its position: the output `counts` hold, then
    drafts[:i] (SamplingParams says how each penalty acts). The logits as they are for a request without
    penalties (counts None)."""
    if counts is None:
        return logits
    occurrences, seen = counts.counts.copy(), counts.seen.copy()                               # [V], [V]
    out = logits.astype(np.float64)                                                            # [n, V]
    for i in range(len(out)):
        if i:
            occurrences[drafts[i - 1]] += 1
            seen[drafts[i - 1]] = True
        row = out[i]
        if params.repetition_penalty != 1:
            row[seen] = np.where(row[seen] > 0, row[seen] / params.repetition_penalty,
                                 row[seen] * params.repetition_penalty)
        row -= params.frequency_penalty * occurrences + params.presence_penalty * (occurrences > 0)
    return out


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities [..., V] (float64) after temperature, top-k and top-p, renormalised.

    The max is subtracted before dividing by the temperature: with a tiny one, every logit below the max then
    overflows to -inf (probability 0) and the max stays 0 (probability 1, shared by exact ties), which is exactly
    the T -> 0 limit; dividing first would give inf - inf = NaN."""
    logits = logits.astype(np.float64)
    with np.errstate(over="ignore"):
        z = (logits - logits.max(axis=-1, keepdims=True)) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k, axis=-1)[..., -params.top_k, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)
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
    return draw_with(p, rng.random())


def draw_with(p: np.ndarray, uniform: float) -> int:
    """The token of p [V] at `uniform` in [0, 1): the first whose cumulative mass exceeds uniform * total."""
    return int(min(np.searchsorted(np.cumsum(p), uniform * p.sum(), side="right"), p.shape[-1] - 1))


def accept_greedy(target_logits: np.ndarray, drafts: list[int]) -> tuple[int, int]:
    """(accepted drafts, next token) from the verify logits [k+1, V] of [t, d1..dk]."""
    best = target_logits.argmax(axis=-1)
    n = 0
    while n < len(drafts) and best[n] == drafts[n]:
        n += 1
    return n, int(best[n])


def accept_sampled(p: np.ndarray, q: np.ndarray, drafts: list[int], uniforms: np.ndarray) -> tuple[int, int]:
    """(accepted drafts, next token). p [k+1, V] target distributions, q [k, V] the draft's; uniforms [k + 1] in
    [0, 1): draft i survives when uniforms[i] * q(d_i) < p(d_i), and the token is drawn with uniforms[k]. A request
    draws all k + 1 at once from its generator, those of the drafts after a rejection unused: the device sampler
    (samplers.py) draws them so too, so a seed gives the same tokens on both paths."""
    for i, d in enumerate(drafts):
        if uniforms[i] * q[i, d] < p[i, d]:           # accept with probability min(1, p/q)
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        return i, draw_with(residual if residual.sum() > 0 else p[i], uniforms[len(drafts)])
    return len(drafts), draw_with(p[len(drafts)], uniforms[len(drafts)])
