"""Continuous batching with MTP speculative decoding (docs/architecture.md §4).

Every request carries its phase; one engine call may hold rows in different phases (a prefill chunk beside
verify rows), each handled by its own phase and length, never by the shape of the batch.

Caches live in paged pools (runtime/cache.py) sized once from a memory budget. One scheduler step:
1. admit waiting requests while the pools have the blocks their prompts need (a prompt that starts like an
   earlier one forks from its prefix, runtime/prefix_cache.py); then hold the blocks every running request needs
   for this step: when the pool runs out, unused prefix entries go first, then the most recently admitted
   requests are preempted (their caches freed; they wait at the front of the queue and recompute later, exactly);
2. DRAFT for decoding requests, one engine call (builder/model/drafting.py): the MTP layer over the positions
   the target committed since the last draft (the whole prompt on the first cycle), fed (H_i, t_{i+1}); its last
   row gives d1, then k-1 single-row steps on its own streams give d2..dk, drawn inside the graph from the
   request's sampling settings; the draft cache keeps only the committed positions' rows;
3. one target call over every active row: the next prefill chunk, or VERIFY [t, d1..dk];
4. COMMIT: prefill rows commit the chunk; verify rows accept j drafts + 1 token (greedy or lossless
   sampling) and commit j+1 positions; stop conditions end requests, whose caches are released.

The scheduler is not thread-safe: the Generator's lock guards it (runtime/generator.py).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from .cache import CachePool, SequenceCache
from .detokenize import IncrementalDetokenizer
from .engine import EngineManifest
from .errors import V4EngineError
from .metrics import RequestMetrics
from .layout import CacheGroup
from .pool_arrays import NUMPY_DTYPES, PoolArrays, pool_arrays
from .prefix_cache import PrefixCache, PrefixEntry
from .sampling import RequestError, SamplingParams, accept_greedy, accept_sampled, distribution, draw, is_integer
from .sessions import EngineSession


def _memory_cap(storages: dict[str | None, PoolArrays], device_of: dict[str, str | None],
                groups: dict[str, list[CacheGroup]], seq_len: int) -> int:
    """The largest cache budget that takes at most half of each place's memory, given the share of a sequence's
    cache bytes each place holds (all of it, unless a pipeline spreads the pools over several GPUs). Host numpy
    pools and torch CPU pools share one place: the host's memory."""
    place = {device: "cpu" if device is None else device for device in storages}
    held = dict.fromkeys(place.values(), 0)
    for g in (g for part in groups.values() for g in part):
        held[place[device_of[g.pool]]] += g.bytes_for(seq_len)
    memory = {place[device]: storage.memory() for device, storage in storages.items()}
    total = sum(held.values())
    return min(memory[p] // 2 * total // max(1, held[p]) for p in held)


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
    num_draft_tokens: int              # draft tokens per step for this request (<= the scheduler's mtp)
    rng: np.random.Generator
    stop_ids: frozenset[int]           # token ids that end it: its stop_token_ids, and eos unless ignored
    phase: Phase = Phase.WAITING
    tokens: list[int] = field(default_factory=list)
    target: SequenceCache | None = None
    draft: SequenceCache | None = None
    pending_hidden: list[np.ndarray] = field(default_factory=list)   # streams of positions [draft.length, target.length)
    hidden_tail: np.ndarray | None = None   # prefill streams of the last W - 1 positions (prefix cache snapshots)
    drafts: list[int] = field(default_factory=list)
    draft_probs: list[np.ndarray] = field(default_factory=list)
    finish_reason: str | None = None   # "stop", "length", "cancelled", or "error" (a failed step: see `error`)
    error: BaseException | None = None
    arrival: float = field(default_factory=time.perf_counter)   # submitted: time to first token counts queueing
    stop_text: IncrementalDetokenizer | None = None   # its text, for stop strings (set by the Generator)

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
    def __init__(self, manifest: EngineManifest, target: EngineSession, draft: EngineSession | None, mtp: int,
                 max_batch: int, max_seq_len: int, max_cache_bytes: int | None = None, max_prefill_chunk: int = 512,
                 prefix_cache: bool = True):
        if mtp > manifest.mtp:
            raise V4EngineError(f"mtp {mtp} is more than the engine was built for ({manifest.mtp})")
        if mtp > 0 and draft is None:
            raise V4EngineError("mtp > 0 needs the engine's draft graph")
        self.manifest, self.cfg = manifest, manifest.model
        self.target_session, self.draft_session = target, draft
        self.mtp, self.max_batch, self.max_seq_len = mtp, max_batch, max_seq_len
        self.max_prefill_chunk = max_prefill_chunk
        if manifest.dtype not in NUMPY_DTYPES:
            raise V4EngineError(f"engine dtype {manifest.dtype} cannot run in this runtime")
        self.dtype = NUMPY_DTYPES[manifest.dtype]      # of host arrays: the draft's streams, prefix snapshots'
        self.groups = {part: manifest.cache_groups(part) for part in manifest.caches}
        # Each pool where the session that reads it keeps pools (a pipeline's stages: each on its own device; the
        # draft's beside the last stage)
        device_of = {g.pool: (draft if part == "draft" and draft is not None else target).pool_device_of(g.pool)
                     for part, groups in self.groups.items() for g in groups}
        storages = {device: pool_arrays(manifest.dtype, device) for device in dict.fromkeys(device_of.values())}
        storage = {pool: storages[device] for pool, device in device_of.items()}
        # By default: the caches of max_batch sequences of max_seq_len tokens, but never more than half of the
        # memory the pools live in: the host's, or what each GPU has free beside the weights (an engine.json cannot
        # make the runtime promise memory it does not have, and device pools are allocated whole). The budget
        # pays for a slot of every part per batch row first, then for as many blocks as it holds.
        cap = max_cache_bytes if max_cache_bytes is not None else \
            _memory_cap(storages, device_of, self.groups, max_seq_len)
        self.budget = min(max_batch * self.cache_bytes(max_seq_len), cap) if max_cache_bytes is None else cap
        # Never more blocks than max_batch sequences of max_seq_len can use (nor than a shape-specialized engine's
        # profiles take, which stop there), and at least one where there are growing groups.
        layout = manifest.caches["target"]
        blocks = min(max(1, (self.budget - max_batch * self.cache_bytes(0)) // layout.block_bytes),
                     max_batch * layout.table_blocks(max_seq_len)) if layout.block_bytes else 0
        # A session of static shapes (MIGraphX's programs) takes pools of its own sizes and no other: they must fit
        # the budget given, or half of the memory they live in, and are then the budget
        sessions = {"target": target, "draft": draft}
        fixed = {part: (sessions[part].pool_shape if sessions[part] is not None else None) or {}
                 for part in manifest.caches}
        fixed_bytes = sum(fixed[part].get("pool_slots", 0) * manifest.caches[part].slot_bytes
                          + fixed[part].get("pool_blocks", 0) * manifest.caches[part].block_bytes for part in fixed)
        if fixed_bytes > cap:
            raise V4EngineError(f"this engine's programs take cache pools of {fixed_bytes / 2**30:.2f} GiB "
                                f"(max_batch x max_seq_len as built), more than the cache budget of "
                                f"{cap / 2**30:.2f} GiB; "
                                "rebuild it with a smaller --max-batch or --max-seq-len")
        self.budget = fixed_bytes or self.budget
        self.pools = {part: CachePool(layout, fixed[part].get("pool_slots", max_batch),
                                      fixed[part].get("pool_blocks", blocks if part == "target" else 0), storage)
                      for part, layout in manifest.caches.items()}
        # Snapshots (rings, and the streams a drafting fork recomputes its window from) live beside the pools: an
        # eighth of the budget, but room for two per batch row at least (a wide model's rings are large against
        # a small budget: the slice's 3.4 MB snapshot against its 4.3 MB eighth kept one entry and never hit)
        cfg = self.cfg
        snapshot = PrefixEntry.bytes_for(manifest.caches["target"], (mtp > 0) * (cfg.sliding_window - 1),
                                         cfg.hc_mult * cfg.hidden_size * np.dtype(self.dtype).itemsize)
        self.prefix = PrefixCache(self.pools["target"], max(self.budget // 8, 2 * max_batch * snapshot)) \
            if prefix_cache else None
        self.waiting: list[Request] = []
        self.active: list[Request] = []
        self._ids = itertools.count()
        self.engine_steps = 0
        # Called after every engine call with (graph, its input_ids shape, seconds): benchmarks time calls by kind
        self.on_call: Callable[[str, tuple[int, ...], float], None] | None = None

    # ------------------------------------------------------------------ requests
    def cache_bytes(self, capacity: int, num_draft_tokens: int | None = None) -> int:
        """Bytes of every cache group one sequence of `capacity` tokens needs (engine.json's figures, rows
        exactly); the draft layer's only for a sequence that drafts (`num_draft_tokens` per step, default the
        scheduler's mtp)."""
        parts = ["target"] + (["draft"] if (self.mtp if num_draft_tokens is None else num_draft_tokens) else [])
        return sum(g.bytes_for(capacity) for part in parts for g in self.groups[part])

    def blocks_for(self, tokens: int) -> int:
        """Target blocks a sequence of `tokens` positions holds."""
        return self.manifest.caches["target"].blocks_for(tokens)

    def num_draft_tokens(self, params: SamplingParams) -> int:
        """Draft tokens per step for a request: its num_draft_tokens, else the scheduler's mtp."""
        return self.mtp if params.num_draft_tokens is None else params.num_draft_tokens

    @property
    def used_bytes(self) -> int:
        """Cache bytes the running requests hold: their slots, and every block one of them reads (once)."""
        pool = self.pools["target"]
        caches = [c for r in self.active for c in (r.target, r.draft) if c is not None]
        blocks = {b for c in caches for b in c.blocks}
        return sum(c.pool.slot_bytes for c in caches) + len(blocks) * pool.block_bytes

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
        blocks, pool_blocks = self.blocks_for(capacity), len(self.pools["target"].refs)
        if need > self.budget or blocks > pool_blocks:
            raise CapacityError(f"the request needs {need} bytes of cache ({blocks} blocks) for {capacity} tokens, "
                                f"more than the budget of {self.budget} bytes ({pool_blocks} blocks)")
        return capacity

    def submit(self, prompt: list[int], params: SamplingParams) -> Request:
        """Validate and queue a request; a bad one raises RequestError and changes nothing."""
        capacity = self.validate(prompt, params)
        num_draft_tokens = self.num_draft_tokens(params)
        eos = self.cfg.eos_token_id
        eos = [] if params.ignore_eos or eos is None else eos if isinstance(eos, list) else [eos]
        request = Request(id=next(self._ids), prompt=[int(t) for t in prompt], params=params, capacity=capacity,
                          metrics=RequestMetrics(mtp=num_draft_tokens),
                          num_draft_tokens=num_draft_tokens, rng=np.random.default_rng(params.seed),
                          stop_ids=frozenset(int(t) for t in (*params.stop_token_ids, *eos)),
                          tokens=[int(t) for t in prompt])
        self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request now and release its caches (its batch slot frees at once). One that already ended
        keeps its finish reason."""
        self._leave(request, "cancelled")

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
        engine = 0.0
        if self.mtp:
            engine += self._draft([r for r in self.active
                                   if r.phase == Phase.DECODE and r.num_draft_tokens and not r.drafts])
        rows = [r for r in self.active if r.phase in (Phase.PREFILL, Phase.DECODE)]
        if rows:
            engine += self._target(rows, new_tokens)
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
            entry = self.prefix.lookup(context, len(context) - 1) if self.prefix is not None else None
            shared = entry.length // self.prefix.block_tokens if entry is not None else 0   # full blocks only
            need = self.blocks_for(len(context) + 1) - shared
            if not self._free_blocks(promised + need, keep=entry):
                break
            promised += need
            self.waiting.pop(0)
            self._start(request, entry)
            self.active.append(request)

    def _start(self, r: Request, entry: PrefixEntry | None) -> None:
        """Give r its caches: empty, or forked from a prefix entry (its blocks shared, its rings copied, the draft
        to recompute its window from the entry's streams)."""
        if entry is None:
            r.target = SequenceCache(self.pools["target"])
        else:
            r.target = self.prefix.fork(entry)
            r.metrics.prefix_hit_tokens = max(r.metrics.prefix_hit_tokens, entry.length)
        r.hidden_tail = entry.hidden if entry is not None else None
        if r.num_draft_tokens:            # a request that does not draft needs no draft cache
            recompute = len(entry.hidden) if entry is not None else 0
            r.draft = SequenceCache(self.pools["draft"], length=r.target.length - recompute)
            r.pending_hidden = [entry.hidden] if entry is not None else []
        r.phase = Phase.PREFILL

    def _free_blocks(self, need: int, keep: PrefixEntry | None = None) -> bool:
        """Whether the target pool has `need` free blocks, evicting prefix entries (other than `keep`) for them;
        none is evicted when evicting them all would not free enough."""
        pool = self.pools["target"]
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
        for cache in (r.target, r.draft):
            if cache is not None:
                cache.release()
        r.target = r.draft = r.hidden_tail = None
        r.pending_hidden, r.drafts, r.draft_probs = [], [], []

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

    def _run(self, session: EngineSession, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        started = time.perf_counter()
        out = session.run(feeds)
        seconds = time.perf_counter() - started
        self.engine_steps += 1
        if self.on_call is not None:
            self.on_call("draft" if session is self.draft_session else "target", feeds["input_ids"].shape, seconds)
        return out, seconds

    def _draft_call(self, requests: list[Request], hidden: list[np.ndarray], ids: list[list[int]], drafting: list[bool]
                    ) -> tuple[dict[str, np.ndarray], float]:
        """One draft-cycle call: the extend rows of each request, and its k drafts. Sampling rows that draft in this
        call (`drafting`: the chunk is their last) get their uniform numbers from their own generator."""
        S, B, K = max(len(t) for t in ids), len(requests), self.manifest.mtp
        N, D = self.cfg.hc_mult, self.cfg.hidden_size
        h = np.zeros((B, S, N, D), self.dtype)
        tok = np.zeros((B, S), np.int64)
        uniforms = np.zeros((B, K), np.float32)
        for b, (r, rows, t, draws) in enumerate(zip(requests, hidden, ids, drafting)):
            h[b, : len(t)] = rows
            tok[b, : len(t)] = t
            if draws and not r.params.greedy:
                uniforms[b, : r.num_draft_tokens] = r.rng.random(r.num_draft_tokens)
        params = [r.params for r in requests]
        feeds = {"hidden": h, "input_ids": tok,
                 "positions": np.array([r.draft.length for r in requests])[:, None] + np.arange(S),
                 "lengths": np.array([len(t) for t in ids], np.int64),
                 "temperature": np.array([p.temperature for p in params], np.float32),
                 "top_k": np.array([min(p.top_k, self.cfg.vocab_size) for p in params], np.int64),
                 # in float32 a top_p as small as 1e-300 must not become 0 (which would keep no token)
                 "top_p": np.maximum(np.array([p.top_p for p in params], np.float32), np.finfo(np.float32).tiny),
                 "uniforms": uniforms,           # float32 may round u up to 1: the graph's draw takes u = 1 too
                 **self.pools["draft"].feeds([r.draft for r in requests])}
        return self._run(self.draft_session, feeds)

    def _deltas(self, out: dict[str, np.ndarray], part: str, b: int) -> dict[str, np.ndarray]:
        return {g.pool: out[g.new][b] for g in self.groups[part]}

    def _draft(self, requests: list[Request]) -> float:
        """One draft cycle per request: DRAFT-EXTEND over the newly committed positions and the recursive steps,
        in one engine call (more only when the extend is longer than a prefill chunk). Each request keeps its own
        num_draft_tokens of the engine's k drafts, and, when it samples, the distributions they were drawn from."""
        if not requests:
            return 0.0
        hidden = {r.id: np.concatenate(r.pending_hidden) for r in requests}
        ids = {r.id: r.tokens[r.draft.length + 1: r.target.length + 1] for r in requests}
        engine, chunk = 0.0, self.max_prefill_chunk
        for start in range(0, max(map(len, ids.values())), chunk):      # in chunks, as the target prefills
            rows = [r for r in requests if len(ids[r.id]) > start]
            last = [len(ids[r.id]) <= start + chunk for r in rows]
            out, t = self._draft_call(rows, [hidden[r.id][start: start + chunk] for r in rows],
                                      [ids[r.id][start: start + chunk] for r in rows], last)
            engine += t
            for b, (r, drafting) in enumerate(zip(rows, last)):
                r.draft.commit(self._deltas(out, "draft", b), len(ids[r.id][start: start + chunk]))
                if drafting:
                    r.drafts = [int(d) for d in out["drafts"][b, : r.num_draft_tokens]]
                    if not r.params.greedy:
                        r.draft_probs = list(out["draft_probs"][b, : r.num_draft_tokens])
        for r in requests:
            r.pending_hidden = []
        return engine

    def _target(self, rows: list[Request], new_tokens: dict[int, list[int]]) -> float:
        """One target call: a prefill chunk or [t, d1..dk] per row; then acceptance and commit."""
        inputs = []
        for r in rows:
            if r.phase == Phase.PREFILL:
                inputs.append(self._prefill_chunk(r))
            else:
                room = r.capacity - r.target.length - 1          # a verify never commits past the cache's capacity
                r.drafts, r.draft_probs = r.drafts[:room], r.draft_probs[:room]
                inputs.append([r.tokens[-1]] + r.drafts)
        S = max(len(x) for x in inputs)
        ids = np.zeros((len(rows), S), np.int64)
        for b, x in enumerate(inputs):
            ids[b, : len(x)] = x
        positions = np.array([r.target.length for r in rows])[:, None] + np.arange(S)
        feeds = {"input_ids": ids, "positions": positions, **self.pools["target"].feeds([r.target for r in rows])}
        out, engine = self._run(self.target_session, feeds)
        for b, (r, x) in enumerate(zip(rows, inputs)):
            deltas = self._deltas(out, "target", b)
            logits, hidden = out["logits"][b, : len(x)], out["hidden"][b, : len(x)]
            if r.phase == Phase.PREFILL:
                r.target.commit(deltas, len(x))
                if r.num_draft_tokens:                          # the draft layer reads these streams
                    r.pending_hidden.append(hidden)
                if self.prefix is not None:
                    if self.mtp:                                # a snapshot's streams for a drafting fork
                        window = self.cfg.sliding_window - 1
                        r.hidden_tail = hidden[-window:] if r.hidden_tail is None else \
                            np.concatenate([r.hidden_tail, hidden])[-window:]
                    self.prefix.insert(r.context, r.target, r.hidden_tail if self.mtp else hidden[:0])
                if r.target.length == len(r.context):
                    r.phase = Phase.DECODE
                    if not r.generated:                         # not a preempted request's recomputation
                        r.metrics.time_to_first_token = time.perf_counter() - r.arrival
                        self._emit(r, [self._sample(r, logits[-1])], new_tokens)
                continue
            drafts = r.drafts
            if r.params.greedy:
                accepted, token = accept_greedy(logits, drafts)
            else:
                q = np.array(r.draft_probs).reshape(len(drafts), logits.shape[-1])
                accepted, token = accept_sampled(distribution(logits, r.params), q, drafts, r.rng)
            if drafts:
                r.metrics.record_verify(len(drafts), accepted)
            r.target.commit(deltas, accepted + 1)
            if r.num_draft_tokens:
                r.pending_hidden.append(hidden[: accepted + 1])
            r.drafts, r.draft_probs = [], []
            self._emit(r, drafts[:accepted] + [token], new_tokens)
        return engine

    def _sample(self, r: Request, logits: np.ndarray) -> int:
        if r.params.greedy:
            return int(logits.argmax())
        return draw(distribution(logits, r.params), r.rng)

    def _emit(self, r: Request, tokens: list[int], new_tokens: dict[int, list[int]]) -> None:
        """Append generated tokens up to a stop condition; finish the request when one is met."""
        emitted = new_tokens.setdefault(r.id, [])
        for token in tokens:
            if token in r.stop_ids:
                self._finish(r, "stop")
                return
            r.tokens.append(token)
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
