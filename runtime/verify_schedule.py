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
the drafter's weights having pushed the target's out of the CPU's caches); when drafting does not pay (a saturated
batch whose drafts are rarely kept) the step makes no draft call, and now and then (less often while it keeps not
paying) a step drafts again to refresh the estimates. The drafter's rings lose nothing by a skipped cycle: the next
one feeds them every committed position it has not seen.

What a step's calls do not show, measured and counted:
- Turning drafting on costs more than a drafting step does once it runs: the first draft cycle after plain decodes
  catches up on the positions since the last, the drafter's weights and then the target's are cold in the CPU's
  caches, and the first plain decode after drafting is slower too. The profile times that switch
  (`StepCosts.switch`) and a step that would turn drafting on must pay it.
- Drafting costs some things once per request, spread over the tokens the rows have left (`once_per_token`): the
  drafter's catch-up on a new prompt (`StepCosts.catch_up`), and, for rows that decode in step (admitted together,
  with as many tokens left each) while requests queue behind them, their successors' prompts prefilled one by one:
  a verify of drafts moves rows out of step for good, and where eight successors shared one prefill call each is
  then prefilled alone (`StepCosts.prefill`; at batch 8 on tiny-v4 a 128-token prompt alone took 36-37 ms, eight
  together 28-30 ms each).
- A probe whose drafts turn out not to pay verifies none: it only refreshes the estimates, and rows in step stay in
  step. (A drafting step in a run of them verifies its best prefix even so: its cycle is paid.)
- The survivals are calibrated by what verifies kept (`verified`, one running ratio for greedy and one for sampled
  rows): the head is trained toward a sampled draft's chance to survive, and at T = 1, batch 8 on tiny-v4 it
  promised 10% more than verifies kept, which made drafting look 7% faster than plain decoding where it was 7%
  slower.
- Drafting must promise MARGIN times plain decoding's tokens per second, not merely more: what is left (a request's
  tail, the cache state a cost was profiled in) is not in the model, and a close call lost more than it won (1.05
  kept greedy batch 1 where drafting every step is; 1.1 lost 12-64% of its gain there; chosen on tiny-v4 only,
  where the other costs are each engine's own profile).
At batch 8 on tiny-v4 they took scheduled DSpark 5 from 0.92x MTP 0 at T = 1 to 0.98x (benchmarks/RESULTS.md).

The profile is a prior: each step of decoding rows alone is timed, its calls and the host's work around them
(sampling, verifying, committing: 1-2 ms a plain step at batch 8 on tiny-v4, 3-4 ms a drafting one), and the running
ratio of its seconds to the profile's, kept apart for drafting steps and plain decodes, scales the profile's costs of
each kind. A profile recorded while the machine was busier (or quieter), in another state of the same machine
(tiny-v4's decode took 8.4 ms in one session here and 4.4-5.5 in the next, its verify of 6 1.3 and 1.9 decodes), or
on random prompts whose experts differ from real text's, is so brought back to what steps cost now. (One ratio per
graph instead, the target's measured by every verify, was tried: a decode among drafting steps costs more against
its profile than a verify does, 1.39 against 1.1-1.2 at batch 1, and T = 1 at batch 1 drafted too little.)

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
PROFILE_METHOD = 4                    # how a profile is measured: a record made another way is measured again
MARGIN = 1.05                         # drafting must promise this many times plain decoding's tokens/s (the docstring)
SWITCH_AFTER = 32                     # plain decode steps before each drafting step the profile times as a switch
SWITCHES = 3                          # switches timed per batch (the median kept)
CALIBRATION_MEMORY = 0.99             # weight of the verifies before each new one in the confidences' calibration
CALIBRATION_PRIOR = 8.0               # predicted survivals the calibration starts from, as if observed exactly


@dataclass(frozen=True)
class StepCosts:
    """Seconds of the calls a step makes, at each profiled batch size (ascending `batches`): a plain decode step's
    target call (`decode[i]`), and in a step that drafts, the draft cycle (`draft[i]`) and the target call verifying
    width 1 .. k + 1 (`verify[i][w - 1]`); what turning drafting on adds (`switch[i]`: the first drafting step
    after plain decodes and the first plain decode after drafting, beyond those of steps in a run of their kind);
    what drafting costs once per request: the prefill of `batch` prompts of PROFILE_PROMPT tokens in one call
    (`prefill[i]`: prompts prefilled one by one cost more than together) and the drafter's catch-up on them
    (`catch_up[i]`, all rows in one call). Between and beyond the profiled sizes, linear interpolation (flat past
    the ends)."""

    batches: tuple[int, ...]
    decode: tuple[float, ...]
    draft: tuple[float, ...]
    verify: tuple[tuple[float, ...], ...]
    switch: tuple[float, ...]
    prefill: tuple[float, ...]
    catch_up: tuple[float, ...]

    @property
    def widths(self) -> int:
        return len(self.verify[0])

    def at(self, field: str, batch: int) -> float:
        """`field` (decode, draft, switch, prefill, catch_up) at `batch` rows."""
        return float(np.interp(batch, self.batches, getattr(self, field)))

    def verify_at(self, batch: int, width: int) -> float:
        return float(np.interp(batch, self.batches, [row[width - 1] for row in self.verify]))

    def to_json(self) -> dict[str, Any]:
        return {name: [list(r) for r in value] if name == "verify" else list(value)
                for name, value in vars(self).items()}

    @classmethod
    def from_json(cls, data: Any, widths: int) -> "StepCosts | None":
        """A recorded profile, or None when it is not one for `widths` verify widths (then it is measured again):
        seconds finite, positive (a switch or a catch-up may be 0), one of each per batch, batches ascending."""
        def seconds(values: Sequence[Any], least_is_zero: bool) -> bool:
            return all(isinstance(x, float) and math.isfinite(x) and (x >= 0 if least_is_zero else x > 0)
                       for x in values)

        try:
            batches = tuple(data["batches"])
            per_batch = {name: tuple(data[name]) for name in ("decode", "draft", "switch", "prefill", "catch_up")}
            verify = tuple(tuple(row) for row in data["verify"])
            ok = (batches and all(len(v) == len(batches) for v in (*per_batch.values(), verify))
                  and all(isinstance(b, int) and b > 0 for b in batches) and list(batches) == sorted(set(batches))
                  and all(len(row) == widths for row in verify)
                  and seconds((*per_batch["decode"], *per_batch["draft"], *per_batch["prefill"], *sum(verify, ())),
                              False)
                  and seconds((*per_batch["switch"], *per_batch["catch_up"]), True))
        except (KeyError, TypeError):
            return None
        return cls(batches, per_batch["decode"], per_batch["draft"], verify, per_batch["switch"],
                   per_batch["prefill"], per_batch["catch_up"]) if ok else None


def survival(confidence: np.ndarray) -> np.ndarray:
    """Each prefix's chance to survive verification [n]: the running product of the drafts' confidences."""
    return np.cumprod(confidence.astype(np.float64))


class VerifyPlanner:
    """Chooses, each step, whether the batch drafts and how many drafts each row's verify keeps."""

    def __init__(self, costs: StepCosts, probe_every: int = 8, probe_at_most_every: int = 128,
                 margin: float = MARGIN):
        self.costs, self.probe_every, self.probe_at_most_every = costs, probe_every, probe_at_most_every
        self.margin = margin                 # how much faster than plain decoding a drafting step must promise to be
        self.since_draft = 0                 # steps without a draft call since the last
        self.interval = probe_every          # steps without drafting before a probe (doubled, halved: should_draft)
        self.typical: dict[bool, np.ndarray] = {}   # greedy or sampled: a new row's estimate (the note below)
        self.width = 0                       # the drafts per row the last drafting step verified
        self.switching = False               # whether the last drafting step turned drafting on (after plain steps)
        self.once = 0.0                      # its once_per_token
        self._profiled: dict[tuple[int, int | None, bool], float] = {}     # profiled_seconds, by its arguments
        self.scale = {True: 1.0, False: 1.0}     # measured / profiled seconds: drafting steps, plain decodes
        self.accepted = {True: CALIBRATION_PRIOR, False: CALIBRATION_PRIOR}    # greedy or sampled: drafts accepted
        self.predicted = {True: CALIBRATION_PRIOR, False: CALIBRATION_PRIOR}   # and their predicted survivals, running

    def profiled_seconds(self, batch: int, width: int | None, switching: bool = False) -> float:
        """The profile's seconds of a step of `batch` decoding rows verifying `width` drafts each (None: no draft
        call, a plain decode), turning drafting on or not. Kept once computed: a decision asks for them every step."""
        key = (batch, width, switching)
        if key not in self._profiled:
            if width is None:
                seconds = self.costs.at("decode", batch)
            else:
                switch = self.costs.at("switch", batch) if switching else 0.0
                seconds = self.costs.at("draft", batch) + switch + self.costs.verify_at(batch, width + 1)
            self._profiled[key] = seconds
        return self._profiled[key]

    def step_seconds(self, batch: int, width: int | None, switching: bool = False) -> float:
        """Expected seconds of such a step: the profile's, scaled by what steps of its kind measured."""
        return self.profiled_seconds(batch, width, switching) * self.scale[width is not None]

    def expected_rates(self, survivals: Sequence[np.ndarray], switching: bool = False, once: float = 0.0
                       ) -> np.ndarray:
        """Expected tokens per second of a step that drafts for these rows and verifies w drafts of each, for w = 0
        .. the longest proposal [w] (`once`: seconds per token of what drafting costs once, `once_per_token`)."""
        B = len(survivals)
        longest = min(max((len(s) for s in survivals), default=0), self.costs.widths - 1)
        kept = np.zeros((B, longest))                                                   # [B, longest]
        for row, s in zip(kept, survivals):
            row[: min(len(s), longest)] = s[:longest]
        tokens = B + np.concatenate([[0.0], kept.sum(axis=0).cumsum()])                  # [longest + 1]
        seconds = np.array([self.step_seconds(B, w, switching) for w in range(longest + 1)])
        return tokens / (seconds + tokens * once)

    def expected_rate(self, survivals: Sequence[np.ndarray], width: int, switching: bool = False,
                      once: float = 0.0) -> float:
        """Expected tokens per second of a step that drafts for these rows and verifies `width` drafts of each."""
        rates = self.expected_rates(survivals, switching, once)
        return float(rates[min(width, len(rates) - 1)])

    def best_width(self, survivals: Sequence[np.ndarray], switching: bool = False, once: float = 0.0) -> int:
        """The drafts per row (0 .. the longest proposal) with the most expected tokens per second (the fewest
        where two tie)."""
        return int(np.argmax(self.expected_rates(survivals, switching, once)))

    def pays(self, survivals: Sequence[np.ndarray], switching: bool = False, once: float = 0.0) -> bool:
        """Whether a step that drafts for these rows (turning drafting on, or not) beats a plain decode step (B
        tokens per decode call) by the margin."""
        B = len(survivals)
        best = float(self.expected_rates(survivals, switching, once).max())
        return best > self.margin * B / self.step_seconds(B, None)

    def once_per_token(self, requests: Sequence[Request], queued: int) -> float:
        """Seconds per token, over the rows' tokens still to come, of what drafting now costs once: the drafter's
        catch-up on the prompts of rows never drafted (in one call); and where the rows decode in step (as many
        tokens left each: admitted together, they end together) with requests queued behind them, their successors'
        prompts prefilled one by one instead of in one call, for drafts move the rows out of step for good."""
        fresh = sum(r.survival is None for r in requests)
        once = self.costs.at("catch_up", fresh) * self.scale[True] if fresh else 0.0
        left = [max(1, r.params.max_new_tokens - len(r.generated)) for r in requests]
        successors = min(len(requests), queued)
        if successors > 1 and len(set(left)) == 1:
            apart = successors * self.costs.at("prefill", 1) - self.costs.at("prefill", successors)
            once += max(apart, 0.0) * self.scale[False]
        return once / sum(left)

    def should_draft(self, requests: Sequence[Request], queued: int = 0) -> bool:
        """Whether this step's decoding rows (with `queued` requests waiting for a row) draft: yes when drafting pays
        by each row's survivals at its last draft (a row never drafted: the last draft's mean over rows greedy or
        sampled as it is; before any such: yes), counting what it costs once (`once_per_token`); otherwise only to
        probe, after `interval` steps without (probe_every at first, doubled after each draft that did not pay, up to
        probe_at_most_every, halved after one that did, down to probe_every: a probe costs a draft cycle that
        catches up on the positions since the last, up to a ring's rows, and one that pays by chance at T = 1 should not
        bring back probes every probe_every steps; at batch 8, T = 1 on tiny-v4 halving rather than starting again at
        probe_every took DSpark 3 / 5 scheduled from 0.94 / 0.96x MTP 0 to 0.98 / 0.99x). The estimate of a row never
        drafted is kept apart for greedy and sampled rows: after a sampled phase (drafts that did not pay, the interval
        at its longest) a greedy request would otherwise not be drafted for up to probe_at_most_every steps. After
        plain steps, drafting must pay its switch too (the module's docstring)."""
        if not requests:
            return False
        estimates = [r.survival if r.survival is not None else self.typical.get(r.params.greedy) for r in requests]
        switching = self.since_draft > 0                 # the last step made no draft call
        self.once = self.once_per_token(requests, queued)
        drafting = any(s is None for s in estimates) or self.pays(estimates, switching, self.once)
        if not drafting:
            self.since_draft += 1
            drafting = self.since_draft >= self.interval
        self.switching = drafting and self.since_draft > 0
        return drafting

    def trim(self, requests: Sequence[Request]) -> None:
        """After a draft cycle: keep each row's best prefix (its survivals recorded for the next decisions), or none
        when the step turned drafting on (a probe, most often) and does not pay by them: it only refreshes the
        estimates, and rows in step stay in step."""
        survivals, kinds, paid = [], [], False
        for r in requests:
            if r.proposal is not None and r.proposal.confidence is not None:
                r.survival = np.minimum(survival(r.proposal.confidence) * self.calibration(r.params.greedy), 1.0)
                survivals.append(r.survival)
                kinds.append(r.params.greedy)
        if survivals:
            longest = max(len(s) for s in survivals)
            padded = [np.pad(s, (0, longest - len(s))) for s in survivals]
            for greedy in set(kinds):
                self.typical[greedy] = np.mean([s for s, k in zip(padded, kinds) if k == greedy], axis=0)
            paid = self.pays(survivals, self.switching, self.once)
            self.interval = max(self.probe_every, self.interval // 2) if paid else \
                min(2 * self.interval, self.probe_at_most_every)
        self.since_draft = 0
        self.width = self.best_width(survivals, self.switching, self.once) if paid or not self.switching else 0
        for r in requests:
            if r.proposal is not None:
                r.proposal = r.proposal.trimmed(self.width)

    def calibration(self, greedy: bool) -> float:
        """Drafts accepted over the survivals the confidences predicted for them, running, for greedy or sampled rows:
        what the survivals are multiplied by (`verified`)."""
        return self.accepted[greedy] / self.predicted[greedy]

    def verified(self, greedy: bool, confidence: np.ndarray, accepted: int) -> None:
        """A row verified drafts of these confidences and accepted `accepted` of them. The confidence head is trained
        toward a sampled draft's chance to survive, and its survivals miss by a share that the rate model must not
        believe: at batch 8 on tiny-v4 a T = 1 drafting step was predicted 15.0 drafts kept per 8 rows and kept 13.5,
        a greedy one 19.7 and kept 20.4, and at T = 1 that 10% made drafting look 7% faster than plain decoding
        where it was 7% slower. One ratio for each kind of row, not one per position: a position corrected down is
        no longer verified, and its correction would never recover."""
        memory = CALIBRATION_MEMORY
        self.accepted[greedy] = memory * self.accepted[greedy] + accepted
        self.predicted[greedy] = memory * self.predicted[greedy] + float(survival(confidence).sum())

    def observe(self, batch: int, drafted: bool, seconds: float) -> None:
        """A step of `batch` decoding rows and nothing else took `seconds` (its calls and the host's work around
        them: sampling, verifying, committing; drafting at the last width chosen, turning drafting on or not, or a
        plain decode): move the running ratio of its kind toward measured / profiled. The first plain decode after
        drafting is not weighed: its extra is the switch's."""
        if not drafted and self.since_draft == 1:
            return
        ratio = seconds / self.profiled_seconds(batch, self.width if drafted else None, drafted and self.switching)
        self.scale[drafted] += SCALE_RATE * (float(np.clip(ratio, *SCALE_CLIP)) - self.scale[drafted])


class FixedWidth(VerifyPlanner):
    """Always draft and verify `drafts` of each row, or (None) never draft: how the profile measures each call."""

    def __init__(self, drafts: int | None):
        self.drafts, self.since_draft = drafts, 0

    def should_draft(self, requests: Sequence[Request], queued: int = 0) -> bool:
        return bool(requests) and self.drafts is not None

    def trim(self, requests: Sequence[Request]) -> None:
        for r in requests:
            if r.proposal is not None:
                r.proposal = r.proposal.trimmed(self.drafts)

    def observe(self, batch: int, drafted: bool, seconds: float) -> None:
        """The profile measures costs; it has none to correct."""

    def verified(self, greedy: bool, confidence: np.ndarray, accepted: int) -> None:
        """Nor confidences to calibrate."""


# ---------------------------------------------------------------------- profiling
def profile_batches(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch, and max_batch."""
    return sorted({min(2 ** i, max_batch) for i in range(max_batch.bit_length() + 1)})


def profile_step_costs(scheduler: Scheduler, repeats: int = REPEATS) -> StepCosts | None:
    """Measure a step's calls on the scheduler's own engine and pools: at each profile batch, that many requests of
    random prompts are prefilled together, decode with no draft call (steps in a row), then with each fixed verify
    width in turn (the first drafting step catches the drafter up on the prompts), each `repeats` times, and with all
    k drafts after SWITCH_AFTER plain steps (the switch), SWITCHES times; the medians. Batches that do not fit its
    memory budget (or max_seq_len) are left to extrapolation; None when not even batch 1 fits. Leaves the scheduler
    as it found it: the requests cancelled, the prefix cache untouched."""
    k = scheduler.mtp
    prompt = min(PROFILE_PROMPT, scheduler.max_seq_len // 4)
    # the most tokens a request commits while every step is timed (at most w + 1 a step): the first, the plain
    # decodes, each width, the switches, the last plain decode; and room to spare (none may end in the profile)
    decoded = 1 + (repeats + 1) + repeats * (k + 1) * (k + 2) // 2 + SWITCHES * (SWITCH_AFTER + k + 1) + 1 + 4
    if scheduler.busy or prompt + decoded + k + 1 > scheduler.max_seq_len:
        return None
    rng = np.random.default_rng(0)
    saved = scheduler.planner, scheduler.prefix, scheduler.calls.on_call
    table: dict[int, dict[str, Any]] = {}
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
    column = {name: tuple(table[b][name] for b in batches) for name in table[batches[0]]}
    return StepCosts(tuple(batches), column["decode"], column["draft"], tuple(tuple(v) for v in column["verify"]),
                     column["switch"], column["prefill"], column["catch_up"])


def _profile_batch(scheduler: Scheduler, batch: int, prompts: np.ndarray, decoded: int, repeats: int
                   ) -> dict[str, Any] | None:
    """StepCosts' figures at `batch` rows, by field, or None if they do not fit."""
    k = scheduler.mtp
    params = SamplingParams(max_new_tokens=decoded, ignore_eos=True, temperature=0.0)
    requests = [scheduler.submit([int(t) for t in p], params) for p in prompts]
    calls: list[tuple[Call, tuple[int, ...], float]] = []
    scheduler.calls.on_call = lambda kind, shape, seconds: calls.append((kind, shape, seconds))
    decode, draft, verify = [], [], [[] for _ in range(k + 1)]
    catch_up = 0.0                      # the first draft cycle's seconds: the drafter catching up on the prompts
    switch_on: list[float] = []         # whole drafting steps (all k) after SWITCH_AFTER plain ones
    switch_back: list[float] = []       # plain decodes right after a drafting step
    try:
        while any(r.phase != Phase.DECODE for r in requests):            # prefill every row
            scheduler.step()
            if scheduler.waiting or any(r.finish_reason is not None for r in requests):
                return None                                             # they do not all fit at once
        prefill = sum(s for kind, _, s in calls if kind == Call.PREFILL)
        # plain decodes back to back (as a batch that does not draft runs them; the first, after the prefill, not
        # kept), every width in turn, then switches: plain steps and a drafting step, and a plain step to end
        plan = [None] * (repeats + 1) + [w for _ in range(repeats) for w in range(k + 1)] + \
            [w for _ in range(SWITCHES) for w in [None] * SWITCH_AFTER + [k]] + [None]
        for i, drafts in enumerate(plan):
            calls.clear()
            scheduler.planner = FixedWidth(drafts)
            scheduler.step()
            if len(scheduler.active) != batch or any(r.finish_reason is not None for r in requests):
                return None
            timed = [s for kind, shape, s in calls if kind == Call.VERIFY and shape == (batch, (drafts or 0) + 1)]
            if i == repeats + 1:                                        # the first draft cycle: the prompts' catch-up
                catch_up = sum(s for kind, _, s in calls if kind in (Call.EXTEND, Call.CYCLE))
            elif drafts is not None and plan[i - 1] is None:
                switch_on.append(sum(s for _, _, s in calls))
            elif drafts is None and i > 0 and plan[i - 1] is not None:
                switch_back += timed
            elif drafts is None:
                decode += timed if i else []
            else:
                draft += [s for kind, shape, s in calls if kind == Call.CYCLE and shape[0] == batch]
                verify[drafts] += timed
    finally:
        for r in requests:
            scheduler.cancel(r)
    if not decode or not draft or not all(verify) or not switch_on or not switch_back or not prefill > 0:
        return None
    figures = {"decode": float(np.median(decode)), "draft": float(np.median(draft)),
               "verify": [float(np.median(v)) for v in verify], "prefill": prefill}
    switch = np.median(switch_on) - figures["draft"] - figures["verify"][k] + np.median(switch_back) - figures["decode"]
    figures["switch"] = max(float(switch), 0.0)
    figures["catch_up"] = max(catch_up - figures["draft"], 0.0)
    return figures


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
