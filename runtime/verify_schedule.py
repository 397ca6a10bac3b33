"""Confidence-scheduled verification: verify only the drafts that pay (DSpark's scheduler; vLLM's adaptive
verification).

A drafter that gives each draft a confidence c_j (DSpark's confidence head: the chance that draft j survives when
the ones before it did) predicts the survival of each prefix, S_j = c_1 ... c_j. A step that drafts for B decoding
rows and verifies width w + 1 commits, in expectation, the sum over rows of 1 + S_1 + ... + S_min(w, n), and costs
a draft cycle at batch B plus a target call of width w + 1. `VerifyPlanner` keeps the w that maximises expected
tokens per second, from costs measured on this machine (`StepCosts`, profiled once per engine, options and machine,
and recorded). It also decides whether to draft at all: from each row's survivals at its last draft, the best
expected rate of a step with a draft cycle against a plain decode step (B tokens per target call of width 1, timed
in steps without a draft cycle: after one, the same call costs more, 10.7 against 9.1 ms at batch 8 on tiny-v4,
the drafter's weights having pushed the target's out of the CPU's caches); when
drafting does not pay (a saturated batch whose drafts are rarely kept) the step makes no draft call, and now and
then (less often while it keeps not paying) a step drafts again to refresh the estimates. The drafter's rings lose
nothing by a skipped cycle: the next one feeds them every committed position it has not seen.

The profile is a prior: each step of decoding rows alone (no prefill beside them) is timed, and the running ratio
of its seconds to the profile's, kept apart for drafting steps and plain decodes, scales the profile's costs of
each kind. A profile recorded while the machine was busier (or quieter), in another state of the same machine
(tiny-v4's decode took 8.4 ms in one session here and 4.4-5.5 in the next, its verify of 6 1.3 and 1.9 decodes), or
on random prompts whose experts differ from real text's, is so brought back to what steps cost now.

Lossless by construction: a verify checks every draft it keeps exactly as before; only how many it keeps changes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from v4engine.contract.calls import Call

from .sampling import SamplingParams
from .scheduler import Phase, Request, Scheduler

CACHE_DIR = "V4ENGINE_CACHE_DIR"       # where profiles are recorded (default ~/.cache/v4engine)
REPEATS = 5                           # timings per (batch, width): the median is kept
SCALE_RATE = 0.05                     # weight of each step's measured-to-profiled ratio in its running mean
SCALE_CLIP = (0.25, 4.0)              # a step's ratio is clipped to this (a pause of the host is not a cost)
PROFILE_PROMPT = 64                   # prompt tokens of the profiling requests
PROFILE_METHOD = 2                    # how a profile is measured: a record made another way is measured again


@dataclass(frozen=True)
class StepCosts:
    """Seconds of the calls a step makes, at each profiled batch size (ascending `batches`): a plain decode step's
    target call (`decode[i]`), and in a step that drafts, the draft cycle (`draft[i]`) and the target call verifying
    width 1 .. k + 1 (`verify[i][w - 1]`); between and beyond the profiled sizes, linear interpolation (flat past
    the ends)."""

    batches: tuple[int, ...]
    decode: tuple[float, ...]
    draft: tuple[float, ...]
    verify: tuple[tuple[float, ...], ...]

    @property
    def widths(self) -> int:
        return len(self.verify[0])

    def decode_at(self, batch: int) -> float:
        return float(np.interp(batch, self.batches, self.decode))

    def draft_at(self, batch: int) -> float:
        return float(np.interp(batch, self.batches, self.draft))

    def verify_at(self, batch: int, width: int) -> float:
        return float(np.interp(batch, self.batches, [row[width - 1] for row in self.verify]))

    def to_json(self) -> dict[str, Any]:
        return {"batches": list(self.batches), "decode": list(self.decode), "draft": list(self.draft),
                "verify": [list(r) for r in self.verify]}

    @classmethod
    def from_json(cls, data: Any, widths: int) -> "StepCosts | None":
        """A recorded profile, or None when it is not one for `widths` verify widths (then it is measured again)."""
        try:
            batches, decode, draft = tuple(data["batches"]), tuple(data["decode"]), tuple(data["draft"])
            verify = tuple(tuple(row) for row in data["verify"])
            ok = (batches and len(decode) == len(draft) == len(batches) == len(verify)
                  and all(isinstance(b, int) and b > 0 for b in batches) and list(batches) == sorted(set(batches))
                  and all(len(row) == widths for row in verify)
                  and all(isinstance(s, float) and math.isfinite(s) and s > 0
                          for s in (*decode, *draft, *sum(verify, ()))))
        except (KeyError, TypeError):
            return None
        return cls(batches, decode, draft, verify) if ok else None


def survival(confidence: np.ndarray) -> np.ndarray:
    """Each prefix's chance to survive verification [n]: the running product of the drafts' confidences."""
    return np.cumprod(confidence.astype(np.float64))


class VerifyPlanner:
    """Chooses, each step, whether the batch drafts and how many drafts each row's verify keeps."""

    def __init__(self, costs: StepCosts, probe_every: int = 8, probe_at_most_every: int = 128):
        self.costs, self.probe_every, self.probe_at_most_every = costs, probe_every, probe_at_most_every
        self.since_draft = 0                 # steps without a draft call since the last
        self.interval = probe_every          # steps without drafting before a probe (doubled, halved: should_draft)
        self.typical: dict[bool, np.ndarray] = {}   # greedy or sampled: a new row's estimate (the note below)
        self.width = 0                       # the drafts per row the last drafting step verified
        self.scale = {True: 1.0, False: 1.0}     # measured / profiled seconds: drafting steps, plain decodes

    def profiled_seconds(self, batch: int, width: int | None) -> float:
        """The profile's seconds of a step of `batch` decoding rows verifying `width` drafts each (None: no draft
        call, a plain decode)."""
        if width is None:
            return self.costs.decode_at(batch)
        return self.costs.draft_at(batch) + self.costs.verify_at(batch, width + 1)

    def step_seconds(self, batch: int, width: int | None) -> float:
        """Expected seconds of such a step: the profile's, scaled by what steps of its kind measured."""
        return self.profiled_seconds(batch, width) * self.scale[width is not None]

    def expected_rate(self, survivals: Sequence[np.ndarray], width: int) -> float:
        """Expected tokens per second of a step that drafts for these rows and verifies `width` drafts of each."""
        B = len(survivals)
        tokens = B + sum(float(s[:width].sum()) for s in survivals)
        return tokens / self.step_seconds(B, width)

    def best_width(self, survivals: Sequence[np.ndarray]) -> int:
        """The drafts per row (0 .. the longest proposal) with the most expected tokens per second."""
        longest = min(max((len(s) for s in survivals), default=0), self.costs.widths - 1)
        return max(range(longest + 1), key=lambda w: (self.expected_rate(survivals, w), -w))

    def pays(self, survivals: Sequence[np.ndarray]) -> bool:
        """Whether a step that drafts for these rows beats a plain decode step (B tokens per decode call)."""
        B = len(survivals)
        return self.expected_rate(survivals, self.best_width(survivals)) > B / self.step_seconds(B, None)

    def should_draft(self, requests: Sequence[Request]) -> bool:
        """Whether this step's decoding rows draft: yes when drafting pays by each row's survivals at its last draft (a
        row never drafted: the last draft's mean over rows greedy or sampled as it is; before any such: yes); otherwise
        only to probe, after `interval` steps without (probe_every at first, doubled after each draft that did not pay,
        up to probe_at_most_every, halved after one that did, down to probe_every: a probe costs a draft cycle that
        catches up on the positions since the last, up to a ring's rows, and one that pays by chance at T = 1 should not
        bring back probes every probe_every steps; at batch 8, T = 1 on tiny-v4 halving rather than starting again at
        probe_every took DSpark 3 / 5 scheduled from 0.94 / 0.96x MTP 0 to 0.98 / 0.99x). The estimate of a row never
        drafted is kept apart for greedy and sampled rows: after a sampled phase (drafts that did not pay, the interval
        at its longest) a greedy request would otherwise not be drafted for up to probe_at_most_every steps."""
        if not requests:
            return False
        estimates = [r.survival if r.survival is not None else self.typical.get(r.params.greedy) for r in requests]
        if any(s is None for s in estimates) or self.pays(estimates):
            return True
        self.since_draft += 1
        return self.since_draft >= self.interval

    def trim(self, requests: Sequence[Request]) -> None:
        """After a draft cycle: keep each row's best prefix (its survivals recorded for the next decisions)."""
        survivals, kinds = [], []
        for r in requests:
            if r.proposal is not None and r.proposal.confidence is not None:
                r.survival = survival(r.proposal.confidence)
                survivals.append(r.survival)
                kinds.append(r.params.greedy)
        if survivals:
            longest = max(len(s) for s in survivals)
            padded = [np.pad(s, (0, longest - len(s))) for s in survivals]
            for greedy in set(kinds):
                self.typical[greedy] = np.mean([s for s, k in zip(padded, kinds) if k == greedy], axis=0)
            paid = self.pays(survivals)
            self.interval = max(self.probe_every, self.interval // 2) if paid else \
                min(2 * self.interval, self.probe_at_most_every)
        self.since_draft = 0
        self.width = self.best_width(survivals)
        for r in requests:
            if r.proposal is not None:
                r.proposal = r.proposal.trimmed(self.width)

    def observe(self, batch: int, drafted: bool, seconds: float) -> None:
        """A step of `batch` decoding rows and nothing else took `seconds` of engine time (drafting at the last
        width chosen, or not): move the running ratio of its kind toward measured / profiled."""
        ratio = seconds / self.profiled_seconds(batch, self.width if drafted else None)
        self.scale[drafted] += SCALE_RATE * (float(np.clip(ratio, *SCALE_CLIP)) - self.scale[drafted])


class FixedWidth(VerifyPlanner):
    """Always draft and verify `drafts` of each row, or (None) never draft: how the profile measures each call."""

    def __init__(self, drafts: int | None):
        self.drafts, self.since_draft = drafts, 0

    def should_draft(self, requests: Sequence[Request]) -> bool:
        return bool(requests) and self.drafts is not None

    def trim(self, requests: Sequence[Request]) -> None:
        for r in requests:
            if r.proposal is not None:
                r.proposal = r.proposal.trimmed(self.drafts)

    def observe(self, batch: int, drafted: bool, seconds: float) -> None:
        """The profile measures costs; it has none to correct."""


# ---------------------------------------------------------------------- profiling
def profile_batches(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch, and max_batch."""
    return sorted({min(2 ** i, max_batch) for i in range(max_batch.bit_length() + 1)})


def profile_step_costs(scheduler: Scheduler, repeats: int = REPEATS) -> StepCosts | None:
    """Measure a step's calls on the scheduler's own engine and pools: at each profile batch, that many requests of
    random prompts decode with no draft call (steps in a row) and with each fixed verify width in turn, each
    `repeats` times; the medians.
    Batches that do not
    fit its memory budget (or max_seq_len) are left to extrapolation; None when not even batch 1 fits. Leaves the
    scheduler as it found it: the requests cancelled, the prefix cache untouched."""
    k = scheduler.mtp
    prompt = min(PROFILE_PROMPT, scheduler.max_seq_len // 4)
    decoded = repeats * ((k + 1) * (k + 2) // 2 + 1) + 3     # tokens a request commits while every call is timed
    if scheduler.busy or prompt + decoded + k + 1 > scheduler.max_seq_len:
        return None
    rng = np.random.default_rng(0)
    saved = scheduler.planner, scheduler.prefix, scheduler.calls.on_call
    table: dict[int, tuple[float, list[float]]] = {}
    try:
        scheduler.prefix = None
        for batch in profile_batches(scheduler.max_batch):
            measured = _profile_batch(scheduler, batch, rng.integers(2, scheduler.cfg.vocab_size, (batch, prompt)),
                                      decoded, repeats)
            if measured is None:
                break
            table[batch] = measured
    finally:
        scheduler.planner, scheduler.prefix, scheduler.calls.on_call = saved
    if not table:
        return None
    batches = sorted(table)
    return StepCosts(tuple(batches), *(tuple(table[b][i] for b in batches) for i in range(2)),
                     tuple(tuple(table[b][2]) for b in batches))


def _profile_batch(scheduler: Scheduler, batch: int, prompts: np.ndarray, decoded: int, repeats: int
                   ) -> tuple[float, float, list[float]] | None:
    """(median plain decode, draft-cycle and verify seconds per width) at `batch` rows, or None if they do not
    fit."""
    params = SamplingParams(max_new_tokens=decoded, ignore_eos=True, temperature=0.0)
    requests = [scheduler.submit([int(t) for t in p], params) for p in prompts]
    decode: list[float] = []
    draft: list[float] = []
    verify: list[list[float]] = [[] for _ in range(scheduler.mtp + 1)]
    try:
        while any(r.phase != Phase.DECODE for r in requests):            # prefill every row
            scheduler.step()
            if scheduler.waiting or any(r.finish_reason is not None for r in requests):
                return None                                             # they do not all fit at once
        # plain decodes back to back (as a batch that does not draft runs them; the first, after the prefill, not
        # kept), then every width in turn
        plan = [None] * (repeats + 1) + [w for _ in range(repeats) for w in range(scheduler.mtp + 1)]
        for i, drafts in enumerate(plan):
            calls: list[tuple[Call, tuple[int, ...], float]] = []
            scheduler.planner = FixedWidth(drafts)
            scheduler.calls.on_call = lambda kind, shape, seconds: calls.append((kind, shape, seconds))
            scheduler.step()
            if len(scheduler.active) != batch or any(r.finish_reason is not None for r in requests):
                return None
            draft += [s for kind, shape, s in calls if kind == Call.CYCLE and shape[0] == batch]
            timed = [s for kind, shape, s in calls if kind == Call.VERIFY and shape == (batch, (drafts or 0) + 1)]
            if drafts is None:
                decode += timed if i else []
            else:
                verify[drafts] += timed
    finally:
        for r in requests:
            scheduler.cancel(r)
    if not decode or not draft or not all(verify):
        return None
    return float(np.median(decode)), float(np.median(draft)), [float(np.median(v)) for v in verify]


# ---------------------------------------------------------------------- the record
def profile_key(engine_dir: Path, options: Any, scheduler: Scheduler) -> str:
    """What a profile depends on: the engine (its engine.json), the session options, k, max_batch, the machine, and
    how it is measured."""
    digest = hashlib.sha256()
    digest.update((engine_dir / "engine.json").read_bytes())
    digest.update(repr((PROFILE_METHOD, options, scheduler.drafter.method, scheduler.mtp, scheduler.max_batch,
                        platform.node(), platform.machine(), os.cpu_count())).encode())
    return digest.hexdigest()[:32]


def recorded_costs(key: str, widths: int, measure: Callable[[], StepCosts | None], folder: Path | None = None
                   ) -> StepCosts | None:
    """The profile recorded under `key` in `folder` (default $V4ENGINE_CACHE_DIR or ~/.cache/v4engine, then
    step-costs/), or measure() now and record it there (atomically; a folder that cannot be written is skipped)."""
    folder = folder or Path(os.environ.get(CACHE_DIR) or Path.home() / ".cache" / "v4engine") / "step-costs"
    path = folder / f"{key}.json"
    try:
        costs = StepCosts.from_json(json.loads(path.read_text()), widths)
    except (OSError, ValueError):
        costs = None
    if costs is not None:
        return costs
    costs = measure()
    if costs is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as f:
                json.dump(costs.to_json(), f)
            os.replace(f.name, path)
        except OSError:
            pass
    return costs


__all__ = ["FixedWidth", "StepCosts", "VerifyPlanner", "profile_step_costs", "recorded_costs", "survival"]
