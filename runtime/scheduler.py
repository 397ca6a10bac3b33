"""Continuous batching with speculative decoding (docs/architecture.md §4).

Every request carries its phase; one step may hold rows in different phases (a prefill chunk beside
verify rows), each handled by its own phase and length, never by the shape of the batch.

Caches live in paged pools (runtime/cache.py) sized once from a memory budget (runtime/budget.py). One step:
1. admit waiting requests while the pools have the blocks their prompts need (a prompt that starts like an
   earlier one forks from its prefix, runtime/prefix_cache.py); then hold the blocks every running request needs
   for this step: when the pool runs out, unused prefix entries go first, then the most recently admitted
   requests are preempted (their caches freed; they wait at the front of the queue and recompute later, exactly);
2. DRAFT for decoding requests: the drafter proposes up to k tokens each (runtime/drafters/: MTP's or DSpark's draft
   graph, one engine call; prompt lookup, none), with the distributions they were drawn from; with confidence
   scheduling (runtime/verify_schedule.py) only when drafting pays, and only the prefixes that pay are verified;
3. the target's call over every active row: the next prefill chunk, or VERIFY [t, d1..dk] (chunks longer than a
   verify in a call of their own: beside them every verify row would be padded to the chunk);
4. COMMIT: prefill rows commit the chunk; verify rows accept j drafts + 1 token (greedy or lossless
   sampling, decided by the sampler where the logits are: runtime/samplers.py) and commit j+1 positions; the
   drafter observes what was committed; stop conditions end requests, whose caches are released.

The scheduler is not thread-safe: the Generator's lock guards it (runtime/generator.py).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from v4engine.contract.calls import Call
from v4engine.contract.engine import EngineManifest
from v4engine.contract.errors import V4EngineError
from v4engine.contract.stages import TARGET

from .budget import plan_pools, sequence_bytes
from .cache import SequenceCache
from .detokenize import IncrementalDetokenizer
from .drafters import Drafter, Proposal
from .engine_calls import EngineCalls, apart_by_length
from .metrics import RequestMetrics
from .pool_arrays import NUMPY_DTYPES, to_numpy
from .prefix_cache import PrefixCache, PrefixEntry
from .samplers import Decision, DeviceSampler, HostSampler, Job
from .sampling import PenaltyCounts, RequestError, SamplingParams, TokenLogprob, is_integer, token_logprob
from .sessions import EngineSession

if TYPE_CHECKING:
    from .verify_schedule import VerifyPlanner


class CapacityError(RequestError):
    """The request's caches can never fit the configured budget."""


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)                   # a request is itself: queues find it by identity
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    capacity: int
    metrics: RequestMetrics
    num_draft_tokens: int              # draft tokens per step for this request (<= the scheduler's k)
    rng: np.random.Generator
    stop_ids: frozenset[int]           # token ids that end it: its stop_token_ids, and eos unless ignored
    phase: Phase = Phase.WAITING
    tokens: list[int] = field(default_factory=list)
    target: SequenceCache | None = None
    draft_state: Any = None            # its drafter's state (runtime/drafters/), while it holds caches
    proposal: Proposal | None = None   # the drafts its next verify checks
    survival: np.ndarray | None = None # its drafts' predicted survival at its last draft (runtime/verify_schedule.py)
    finish_reason: str | None = None   # "stop", "length", "cancelled", or "error" (a failed step: see `error`)
    error: BaseException | None = None
    arrival: float = field(default_factory=time.perf_counter)   # submitted: time to first token counts queueing
    stop_text: IncrementalDetokenizer | None = None   # its text, for stop strings (set by the Generator)
    logprobs: list[TokenLogprob] = field(default_factory=list)          # per generated token, if asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # per prompt token after the first, if asked
    penalty: PenaltyCounts | None = None   # what its penalties read, if it has any (kept as it generates)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def context(self) -> list[int]:
        """The tokens its target cache holds before decoding: the prompt, or, for a request preempted after it
        generated, everything but the last token (the input of its next verify)."""
        return self.tokens[:-1] if self.generated else self.tokens


@dataclass
class StepResult:
    """Tokens each request gained in one step (for streaming), and the requests that finished."""

    new_tokens: dict[int, list[int]]
    finished: list[Request]


class Scheduler:
    def __init__(self, manifest: EngineManifest, target: EngineSession, drafter: Drafter | None, max_batch: int,
                 max_seq_len: int, max_cache_bytes: int | None = None, max_prefill_chunk: int = 512,
                 prefix_cache: bool = True):
        """`drafter`: what proposes the drafts (None: no drafting), k = drafter.k tokens per step at most."""
        if manifest.dtype not in NUMPY_DTYPES:
            raise V4EngineError(f"engine dtype {manifest.dtype} cannot run in this runtime")
        self.manifest, self.cfg = manifest, manifest.model
        self.target_session, self.drafter = target, drafter
        self.mtp = drafter.k if drafter is not None else 0
        self.max_batch, self.max_seq_len, self.max_prefill_chunk = max_batch, max_seq_len, max_prefill_chunk
        parts = drafter.parts if drafter is not None else {}
        self.layouts = {TARGET: manifest.caches[TARGET]} | parts
        sessions = {TARGET: target} | {part: drafter.session for part in parts}
        # A prefix snapshot: the target's rings, and what the drafter needs to rebuild its state at a fork
        snapshot = self.layouts[TARGET].slot_bytes + (drafter.snapshot_bytes() if drafter is not None else 0)
        plan = plan_pools(self.layouts, sessions, manifest.dtype, max_batch, max_seq_len, max_cache_bytes,
                          snapshot if prefix_cache else 0)
        self.budget, self.pools = plan.budget - plan.snapshots, plan.pools     # what the requests' caches share
        self.prefix = PrefixCache(self.pools[TARGET], plan.snapshots) if prefix_cache else None
        self.calls = EngineCalls()
        # where tokens are decided: beside the logits (a session with its caches on a device keeps them there)
        self.sampler = DeviceSampler(target.pool_device) if target.pool_device is not None else HostSampler()
        self.planner: VerifyPlanner | None = None     # confidence scheduling, when on: whether to draft, what to verify
        if drafter is not None:
            drafter.bind({part: self.pools[part] for part in parts}, self.calls, self.prefix is not None)
        self.waiting: list[Request] = []
        self.active: list[Request] = []
        self._ids = itertools.count()

    @property
    def engine_steps(self) -> int:
        """Engine calls made so far (draft and target)."""
        return self.calls.steps

    @property
    def draft_session(self) -> EngineSession | None:
        """The draft graph's session, when the drafter calls one."""
        return self.drafter.session if self.drafter is not None else None

    # ------------------------------------------------------------------ requests
    def cache_bytes(self, capacity: int, num_draft_tokens: int | None = None) -> int:
        """Bytes of every cache group one sequence of `capacity` tokens needs (engine.json's figures, rows
        exactly); the drafter's only for a sequence that drafts (`num_draft_tokens` per step, default the
        scheduler's k)."""
        drafts = self.mtp if num_draft_tokens is None else num_draft_tokens
        return sequence_bytes({part: layout for part, layout in self.layouts.items() if part == TARGET or drafts},
                              capacity)

    def blocks_for(self, tokens: int) -> int:
        """Target blocks a sequence of `tokens` positions holds."""
        return self.layouts[TARGET].blocks_for(tokens)

    def num_draft_tokens(self, params: SamplingParams) -> int:
        """Draft tokens per step for a request: its num_draft_tokens, else the scheduler's k."""
        return self.mtp if params.num_draft_tokens is None else params.num_draft_tokens

    def caches(self, r: Request) -> list[SequenceCache]:
        """The cache sequences a request holds: its target's, and its drafter's."""
        drafts = self.drafter.caches(r) if self.drafter is not None else []
        return ([r.target] if r.target is not None else []) + drafts

    @property
    def used_bytes(self) -> int:
        """Cache bytes the running requests hold: their slots, and every block one of them reads (once)."""
        caches = [c for r in self.active for c in self.caches(r)]
        blocks = {b for c in caches for b in c.blocks}
        return sum(c.pool.slot_bytes for c in caches) + len(blocks) * self.pools[TARGET].block_bytes

    def validate(self, prompt: list[int], params: SamplingParams) -> int:
        """Raise RequestError (a one-line reason) if the request cannot be served; else its cache capacity."""
        params.validate()
        asked = params.num_draft_tokens
        if asked is not None and not (is_integer(asked) and 0 <= asked <= self.mtp):
            raise RequestError(f"num_draft_tokens must be an integer from 0 to {self.mtp}, the draft tokens per step "
                               f"this engine serves (got {asked!r})")
        if not prompt:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt if not (0 <= int(t) < self.cfg.vocab_size)]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        bad = [t for t in params.stop_token_ids if not (0 <= t < self.cfg.vocab_size)]
        if bad:
            raise RequestError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(prompt) >= self.max_seq_len:
            raise RequestError(f"the prompt has {len(prompt)} tokens; this engine serves at most "
                               f"{self.max_seq_len - 1} prompt tokens (max_seq_len {self.max_seq_len})")
        capacity = min(self.max_seq_len, len(prompt) + params.max_new_tokens + self.mtp + 1)
        need = self.cache_bytes(capacity, self.num_draft_tokens(params))
        blocks, pool_blocks = self.blocks_for(capacity), len(self.pools[TARGET].refs)
        if need > self.budget:
            raise CapacityError(f"the request needs {need} bytes of cache for {capacity} tokens, more than the "
                                f"{self.budget} bytes the cache budget leaves the requests")
        if blocks > pool_blocks:
            raise CapacityError(f"the request needs {blocks} cache blocks for {capacity} tokens, more than the "
                                f"{pool_blocks} the pool holds (within the {self.budget} bytes the cache budget "
                                "leaves the requests)")
        return capacity

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that end a request: its stop_token_ids, and the model's eos unless it ignores it."""
        eos = self.cfg.eos_token_id
        eos = [] if params.ignore_eos or eos is None else eos if isinstance(eos, list) else [eos]
        return frozenset(int(t) for t in (*params.stop_token_ids, *eos))

    def submit(self, prompt: list[int], params: SamplingParams) -> Request:
        """Validate and queue a request; a bad one raises RequestError and changes nothing."""
        capacity = self.validate(prompt, params)
        num_draft_tokens = self.num_draft_tokens(params)
        request = Request(id=next(self._ids), prompt=[int(t) for t in prompt], params=params, capacity=capacity,
                          metrics=RequestMetrics(mtp=num_draft_tokens),
                          num_draft_tokens=num_draft_tokens, rng=np.random.default_rng(params.seed),
                          stop_ids=self.stop_ids(params), tokens=[int(t) for t in prompt],
                          penalty=PenaltyCounts(self.cfg.vocab_size, prompt) if params.penalized else None)
        self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request now and release its caches (its batch slot frees at once). One that already ended
        keeps its finish reason. A request of another scheduler is refused: ending it here would free caches of
        pools that are not this one's."""
        self.check_owned(request)
        self._leave(request, "cancelled")

    def check_owned(self, request: Request) -> None:
        """RequestError unless `request` is this scheduler's or has ended."""
        if request.finish_reason is None and request not in self.waiting and request not in self.active:
            raise RequestError(f"request {request.id} is not one of this Generator's (cancel it through its own)")

    def _leave(self, request: Request, reason: str, error: BaseException | None = None) -> None:
        for queue in (self.waiting, self.active):
            if request in queue:
                queue.remove(request)
        if request.finish_reason is None:
            request.error = error
            self._finish(request, reason)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    # ------------------------------------------------------------------ the step
    def step(self) -> StepResult:
        """One step (the module's docstring). A step that raises first ends every request in flight (finish_reason
        "error", the exception in `error`): none is left half-stepped or holding its caches."""
        in_flight = self.waiting + self.active
        try:
            return self._step()
        except BaseException as e:
            for r in in_flight:
                self._leave(r, "error", e)
            raise

    def _step(self) -> StepResult:
        started = time.perf_counter()
        self._admit()
        self._hold_blocks()
        new_tokens: dict[int, list[int]] = {}
        finished: list[Request] = []
        engine, decoding, drafted = 0.0, [], False
        if self.drafter is not None:
            decoding = [r for r in self.active if r.phase == Phase.DECODE and r.num_draft_tokens]
            drafted = self.planner is None or self.planner.should_draft(decoding, len(self.waiting))
            if drafted:
                engine += self.drafter.propose(decoding)
                if self.planner is not None:
                    self.planner.trim(decoding)
        rows = [r for r in self.active if r.phase in (Phase.PREFILL, Phase.DECODE)]
        if rows:
            engine += self._target(rows, new_tokens)
        if self.planner is not None and decoding and len(decoding) == len(rows):   # a step the profile times
            self.planner.observe(len(rows), drafted, time.perf_counter() - started)
        for r in list(self.active):
            if r.phase == Phase.FINISHED:
                finished.append(r)
        self.active = [r for r in self.active if r.phase != Phase.FINISHED]
        elapsed = time.perf_counter() - started
        for r in rows:                      # share the step's time among the rows that took part
            r.metrics.seconds += elapsed / len(rows)
            r.metrics.engine_seconds += engine / len(rows)
        return StepResult(new_tokens, finished)

    # ------------------------------------------------------------------ caches
    def _admit(self) -> None:
        """Admit waiting requests in order while a batch row is free and the pool has (or can free from unused
        prefix entries) the blocks of the request's whole context, beside those promised to the requests admitted
        before it in this step: blocks actually needed, not max_seq_len's."""
        promised = 0
        while self.waiting and len(self.active) < self.max_batch:
            request = self.waiting[0]
            context = request.context
            entry = self.prefix.lookup(context, len(context) - 1, request.params.cache_salt or "") \
                if self.prefix is not None and request.params.prompt_logprobs is None else None
            shared = entry.length // self.prefix.block_tokens if entry is not None else 0   # full blocks only
            need = self.blocks_for(len(context) + 1) - shared
            if not self._free_blocks(promised + need, keep=entry):
                break
            promised += need
            self.waiting.pop(0)
            self._start(request, entry)
            self.active.append(request)

    def _start(self, r: Request, entry: PrefixEntry | None) -> None:
        """Give r its caches: empty, or forked from a prefix entry (its blocks shared, its rings copied, its
        drafter's state rebuilt from the entry's snapshot)."""
        if entry is None:
            r.target = SequenceCache(self.pools[TARGET])
        else:
            r.target = self.prefix.fork(entry)
            r.metrics.prefix_hit_tokens = max(r.metrics.prefix_hit_tokens, entry.length)
        if self.drafter is not None:
            self.drafter.start(r, entry.draft if entry is not None else None, r.target.length)
        r.phase = Phase.PREFILL

    def _free_blocks(self, need: int, keep: PrefixEntry | None = None) -> bool:
        """Whether the target pool has `need` free blocks, evicting prefix entries (other than `keep`) for them;
        none is evicted when evicting them all would not free enough."""
        pool = self.pools[TARGET]
        if pool.free_blocks >= need:
            return True
        if self.prefix is None or pool.free_blocks + self.prefix.freeable(keep) < need:
            return False
        while pool.free_blocks < need:
            self.prefix.evict_one(keep)
        return True

    def _hold_blocks(self) -> None:
        """Reserve the blocks each running request may commit this step (its prefill chunk, or k + 1 verified
        positions), oldest first. When the pool runs out even without prefix entries, the most recently admitted
        request is preempted, the asking one included: the oldest always progresses."""
        for r in list(self.active):
            if r.phase == Phase.WAITING:                       # preempted for an older one in this loop
                continue
            grow = len(self._prefill_chunk(r)) if r.phase == Phase.PREFILL else r.num_draft_tokens + 1
            end = min(r.capacity, r.target.length + grow)
            while not self._free_blocks(r.target.blocks_needed(end)):
                victim = self.active[-1]
                self._preempt(victim)
                if victim is r:
                    break
            else:
                r.target.reserve(end)

    def _preempt(self, r: Request) -> None:
        """Free a running request's caches and queue it first: admitted again, it recomputes its context and goes
        on with exactly the tokens it would have had (its random generator is untouched by the step it left)."""
        self.active.remove(r)
        self._release(r)
        r.phase = Phase.WAITING
        r.metrics.preemptions += 1
        self.waiting.insert(0, r)

    def _release(self, r: Request) -> None:
        if r.target is not None:
            r.target.release()
        if self.drafter is not None and r.draft_state is not None:
            self.drafter.release(r)
        r.target, r.proposal = None, None

    def _prefill_chunk(self, r: Request) -> list[int]:
        """r's next prefill tokens: up to max_prefill_chunk; with the prefix cache on (every chunk end is a snapshot
        point), the last chunk stops first at the context's last block boundary, for later prompts that share
        most of this one."""
        context, start = r.context, r.target.length
        end = min(len(context), start + self.max_prefill_chunk)
        if self.prefix is not None and end == len(context):
            aligned = end - end % self.prefix.block_tokens
            end = aligned if aligned > start else end
        return context[start:end]

    # ------------------------------------------------------------------ the target call
    def _target(self, rows: list[Request], new_tokens: dict[int, list[int]]) -> float:
        """The target's calls of a step: a prefill chunk or [t, d1..dk] per row (chunks longer than a verify in a
        call of their own, engine_calls.apart_by_length); then each row's commit by its phase."""
        inputs = [self._prefill_chunk(r) if r.phase == Phase.PREFILL else self._verify_input(r) for r in rows]
        return sum(self._target_call([rows[i] for i in group], [inputs[i] for i in group], new_tokens)
                   for group in apart_by_length([len(x) for x in inputs], self.mtp + 1))

    def _target_call(self, rows: list[Request], inputs: list[list[int]], new_tokens: dict[int, list[int]]) -> float:
        S = max(len(x) for x in inputs)
        ids = np.zeros((len(rows), S), np.int64)                                          # [B, S]
        for b, x in enumerate(inputs):
            ids[b, : len(x)] = x
        positions = np.array([r.target.length for r in rows])[:, None] + np.arange(S)     # [B, S]
        feeds = {"input_ids": ids, "positions": positions, **self.pools[TARGET].feeds([r.target for r in rows])}
        out, engine = self.calls.run(self.target_session, feeds, Call.VERIFY if S <= self.mtp + 1 else Call.PREFILL)
        jobs = {b: Job(r, b, len(x) - 1) if r.phase == Phase.PREFILL else Job(r, b, 0, r.proposal.tokens,
                                                                                r.proposal.probs)
                for b, (r, x) in enumerate(zip(rows, inputs))
                if r.phase == Phase.DECODE or self._first_token(r, len(x))}
        decisions = dict(zip(jobs, self.sampler.decide(list(jobs.values()), out["logits"])))
        for b, (r, x) in enumerate(zip(rows, inputs)):
            if r.phase == Phase.PREFILL:
                self._commit_prefill(r, out, b, len(x), new_tokens, decisions.get(b))
            else:
                self._verify(r, out, b, new_tokens, decisions[b])
        return engine

    @staticmethod
    def _first_token(r: Request, n: int) -> bool:
        """Whether a prefill chunk of n positions ends r's context and r has no token yet (a preempted request
        recomputing its context knows its next token already): its last position gives the first token."""
        return r.target.length + n == len(r.context) and not r.generated

    def _verify_input(self, r: Request) -> list[int]:
        """[t, d1..dj]: the last token and the drafts, trimmed so a verify never commits past the cache's capacity."""
        room = r.capacity - r.target.length - 1
        r.proposal = (r.proposal or Proposal([])).trimmed(room)
        return [r.tokens[-1]] + r.proposal.tokens

    def _commit_prefill(self, r: Request, out: dict[str, Any], b: int, n: int, new_tokens: dict[int, list[int]],
                        decision: Decision | None) -> None:
        """Commit a prefill chunk of n positions (and take a prefix snapshot there); after the last, emit the first
        token the sampler decided (`decision`; None for a preempted request recomputing: its next token is already
        known)."""
        if r.params.prompt_logprobs is not None:          # position p's logits score prompt token p + 1
            start = r.target.length
            scored = range(max(start, len(r.prompt_logprobs)), min(start + n, len(r.prompt) - 1))
            logits = to_numpy(out["logits"][b, scored.start - start: scored.stop - start]) if scored else None
            for p in scored:
                r.prompt_logprobs.append(token_logprob(logits[p - scored.start], r.prompt[p + 1],
                                                       r.params.prompt_logprobs))
        self._commit(r, out, b, n, prefill=True)
        if self.prefix is not None:
            self.prefix.insert(r.context, r.target, self.drafter.snapshot(r) if self.drafter is not None else None,
                               r.params.cache_salt or "")
        if r.target.length == len(r.context):
            r.phase = Phase.DECODE
            if decision is not None:
                r.metrics.time_to_first_token = time.perf_counter() - r.arrival
                self._emit(r, [decision.token], new_tokens, decision.logprobs)

    def _verify(self, r: Request, out: dict[str, Any], b: int, new_tokens: dict[int, list[int]],
                decision: Decision) -> None:
        """The sampler's decision: j of the drafts accepted and one more token (greedy, or lossless rejection
        sampling against the distributions the drafts were drawn from); commit the j + 1 positions whose inputs
        were right."""
        drafts, accepted, token = r.proposal.tokens, decision.accepted, decision.token
        if drafts:
            r.metrics.record_verify(len(drafts), accepted, r.proposal.confidence)
            if self.planner is not None and r.proposal.confidence is not None:
                self.planner.verified(r.params.greedy, r.proposal.confidence, accepted)
        self._commit(r, out, b, accepted + 1, prefill=False)
        r.proposal = None
        self._emit(r, drafts[:accepted] + [token], new_tokens, decision.logprobs)

    def _commit(self, r: Request, out: dict[str, Any], b: int, n: int, prefill: bool) -> None:
        """Write row b's first n new positions into r's target cache, and show them to the drafter."""
        r.target.commit({g.pool: out[g.new][b] for g in self.layouts[TARGET].groups}, n)
        if self.drafter is not None:
            self.drafter.observe(r, {name: out[name][b] for name in self.drafter.reads}, n, prefill)

    def _emit(self, r: Request, tokens: list[int], new_tokens: dict[int, list[int]],
              logprobs: tuple[TokenLogprob, ...]) -> None:
        """Append generated tokens up to a stop condition; finish the request when one is met. logprobs: each
        token's, if the request asks (the sampler's decision)."""
        emitted = new_tokens.setdefault(r.id, [])
        for i, token in enumerate(tokens):
            if token in r.stop_ids:
                self._finish(r, "stop")
                return
            if r.params.logprobs is not None:
                r.logprobs.append(logprobs[i])
            r.tokens.append(token)
            if r.penalty is not None:
                r.penalty.add(token)
            r.metrics.generated += 1
            emitted.append(token)
            if len(r.tokens) - len(r.prompt) >= r.params.max_new_tokens or len(r.tokens) >= self.max_seq_len:
                self._finish(r, "length")
                return
            if r.stop_text is not None:
                r.stop_text.add([token])
                if r.stop_text.stopped:
                    self._finish(r, "stop")
                    return

    def _finish(self, r: Request, reason: str) -> None:
        r.phase, r.finish_reason = Phase.FINISHED, reason
        self._release(r)
