"""Drafters that run a draft graph of the engine's (MTP, DSpark): one draft cycle per engine call.

What they share: the graph reads one output of the target (`source`: MTP the streams, DSpark its captured rows)
at every committed position, and keeps rings of its own (the `draft` part). Each cycle feeds it the rows of the
positions the target committed since the last (the whole prompt on the first, in chunks of max_prefill_chunk as
the target prefills); the graph commits their ring rows (by length: only committed positions ever enter a ring)
and, in the last chunk, draws the drafts inside the graph from each request's sampling settings with uniform
numbers from the request's own generator, returning the distributions they were drawn from. A request that
samples may ask for greedy drafts (`draft_sample_method="greedy"`, vLLM's option): the graph then takes the
argmax and its one-hot distribution, and acceptance stays lossless.

Per request it keeps the rows it has not fed yet (`pending`; of those a cycle feeds only as many as its rings
hold) and, while prefix snapshots are taken, the rows of
the last `snapshot_rows` prefill positions: a fork recomputes exactly the rings it reads from those
(runtime/prefix_cache.py).
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from v4engine.contract.calls import Call
from v4engine.contract.drafting import DraftSpec
from v4engine.contract.engine import EngineManifest

from ..cache import SequenceCache
from ..engine_calls import apart_by_length
from ..pool_arrays import NUMPY_DTYPES
from ..sessions import EngineSession
from .base import Drafter, Proposal


@dataclass
class GraphDraftState:
    cache: SequenceCache | None             # the graph's rings (None: the request does not draft)
    pending: list[np.ndarray] = field(default_factory=list)   # source rows of positions [cache.length, target length)
    tail: np.ndarray | None = None          # source rows of the last snapshot_rows prefill positions


class GraphDrafter(Drafter):
    """A drafting method with a draft graph (its DraftSpec `spec`), reading the target's output `source`."""

    spec: DraftSpec
    has_graph = True
    source: str                                  # the target output it reads at every committed position

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A method's name and what it reads follow from its spec and source."""
        super().__init_subclass__(**kwargs)
        cls.method, cls.reads = cls.spec.method, (cls.source,)

    @classmethod
    def most_tokens(cls, manifest: EngineManifest, max_prefill_chunk: int) -> int:
        """Its graph drafts the engine's k per call: an engine built with another drafter (or none) has none."""
        return manifest.mtp if manifest.drafter == cls.spec.method else 0

    @classmethod
    def open(cls, manifest: EngineManifest, k: int, max_prefill_chunk: int,
             open_graph: Callable[[str], EngineSession]) -> "GraphDrafter":
        return cls(manifest, open_graph(cls.spec.graph), k, max_prefill_chunk)

    def __init__(self, manifest: EngineManifest, session: EngineSession, k: int, max_prefill_chunk: int):
        super().__init__(k)
        self.cfg, self.session, self.chunk = manifest.model, session, max_prefill_chunk
        self.graph_k = manifest.mtp                  # drafts per call of the graph (a request keeps its first k)
        self.parts = {self.spec.graph: manifest.caches[self.spec.graph]}
        self.dtype = NUMPY_DTYPES[manifest.dtype]     # of the source rows: what the target returns
        layout = self.parts[self.spec.graph]
        # Pending rows a cycle can still read (None: all, for a paged layout): the last R + 1 for rings of R rows. A
        # ring of R rows holds the R positions before the one a row is computed at, and a ring row is its own
        # position's: fed the last R + 1 rows, the cycle's last row reads only rows computed in it, and its commit
        # (which writes only the last R positions of a call anyway, cache.py) leaves the rings exactly as if every
        # row were fed.
        self.rows_read = None if layout.paged else max(g.rows_fixed for g in layout.groups) + 1

    @property
    @abstractmethod
    def source_width(self) -> int:
        """Values of `source` per position."""

    @property
    @abstractmethod
    def snapshot_rows(self) -> int:
        """Positions of source rows a fork needs to rebuild the rings exactly."""

    @abstractmethod
    def method_feeds(self, requests: list[Any], rows: np.ndarray, lengths: list[int]) -> dict[str, np.ndarray]:
        """Its graph's own inputs for these requests: the source rows padded [B, S, ...], each row's valid length."""

    def proposal(self, request: Any, out: dict[str, np.ndarray], b: int) -> Proposal:
        """Request `request`'s drafts from row b of the graph's outputs."""
        n = request.num_draft_tokens
        return Proposal([int(d) for d in out["drafts"][b, :n]],
                        None if request.params.greedy else out["draft_probs"][b, :n])

    def snapshot_bytes(self) -> int:
        return self.snapshot_rows * self.source_width * np.dtype(self.dtype).itemsize

    # ------------------------------------------------------------------ state
    def start(self, request: Any, snapshot: np.ndarray | None, length: int) -> None:
        """A fork recomputes its rings from the snapshot's rows: its cache starts that many positions back."""
        recompute = len(snapshot) if snapshot is not None else 0
        cache = SequenceCache(self.pools[self.spec.graph], length=length - recompute) \
            if request.num_draft_tokens else None
        request.draft_state = GraphDraftState(cache, [snapshot] if snapshot is not None and cache is not None else [],
                                              snapshot)

    def observe(self, request: Any, rows: dict[str, Any], n: int, prefill: bool) -> None:
        state: GraphDraftState = request.draft_state
        new = rows[self.source][:n]
        if state.cache is not None:                 # the graph reads these rows
            state.pending.append(new)
            if self.rows_read is not None and sum(len(p) for p in state.pending) > 2 * self.rows_read:
                self._drop_unread(state)                # amortized: one copy per R + 1 rows
        if prefill and self.snapshots:
            keep = self.snapshot_rows
            state.tail = new[-keep:] if state.tail is None else np.concatenate([state.tail, new])[-keep:]

    def snapshot(self, request: Any) -> np.ndarray:
        return request.draft_state.tail

    def caches(self, request: Any) -> list[SequenceCache]:
        state = request.draft_state
        return [state.cache] if state is not None and state.cache is not None else []

    # ------------------------------------------------------------------ the draft cycle
    def propose(self, requests: list[Any]) -> float:
        """One draft cycle per request: its newly committed positions and its drafts in one engine call (more only
        when those are longer than a prefill chunk; long catch-ups in calls apart from the others',
        engine_calls.apart_by_length). Each request keeps its own num_draft_tokens of the graph's k."""
        if not requests:
            return 0.0
        rows = [self._catch_up(r) for r in requests]
        engine = sum(self._cycle([requests[i] for i in group], [rows[i] for i in group])
                     for group in apart_by_length([len(x) for x in rows], self.graph_k + 1))
        for r in requests:
            r.draft_state.pending = []
        return engine

    def _cycle(self, requests: list[Any], rows: list[np.ndarray]) -> float:
        """The draft cycle of these requests, whose catch-ups are `rows`, in prefill-chunk pieces as the target."""
        engine, chunk = 0.0, self.chunk
        groups = self.parts[self.spec.graph].groups
        for start in range(0, max(len(x) for x in rows), chunk):
            batch = [b for b, x in enumerate(rows) if len(x) > start]
            parts = [rows[b][start: start + chunk] for b in batch]
            drafting = [len(rows[b]) <= start + chunk for b in batch]
            out, seconds = self._call([requests[b] for b in batch], parts, drafting)
            engine += seconds
            for i, (b, part, last) in enumerate(zip(batch, parts, drafting)):
                r = requests[b]
                r.draft_state.cache.commit({g.pool: out[g.new][i] for g in groups}, len(part))
                if last:
                    r.proposal = self.proposal(r, out, i)
        return engine

    def _catch_up(self, request: Any) -> np.ndarray:
        """The rows of the positions this cycle feeds: those pending, less those no draft reads again."""
        state: GraphDraftState = request.draft_state
        self._drop_unread(state)
        return state.pending[0]

    def _drop_unread(self, state: GraphDraftState) -> None:
        """Drop the pending rows no cycle reads again, the cache's length moving past them, and copy the rest out of
        the target's outputs they came from. Done as rows arrive (so at most 2(R + 1) and one call's rows are
        joined here), not at the next cycle: after a prompt of 32K positions that was the streams of all 32K (128
        MiB on tiny-v4, 21 ms to join at its first draft cycle)."""
        rows = np.concatenate(state.pending)
        if self.rows_read is None or len(rows) <= self.rows_read:
            state.pending = [rows]
            return
        state.cache.length += len(rows) - self.rows_read
        state.pending = [rows[-self.rows_read:].copy()]

    def _call(self, requests: list[Any], parts: list[np.ndarray], drafting: list[bool]
              ) -> tuple[dict[str, np.ndarray], float]:
        """One draft-cycle call. Sampling rows that draft in this call (`drafting`: the chunk is their last) get
        their uniform numbers from their own generator; rows that draft greedily, temperature 0."""
        S, B, K = max(len(p) for p in parts), len(requests), self.graph_k
        rows = np.zeros((B, S, *parts[0].shape[1:]), self.dtype)          # [B, S, ...] the source rows
        uniforms = np.zeros((B, K), np.float32)                             # [B, K] one per draft
        for b, (r, part, draws) in enumerate(zip(requests, parts, drafting)):
            rows[b, : len(part)] = part
            if draws and not r.params.greedy:
                uniforms[b, : r.num_draft_tokens] = r.rng.random(r.num_draft_tokens)
        params = [r.params for r in requests]
        temperature = [0.0 if (p.draft_sample_method or self.sample_method) == "greedy" else p.temperature
                       for p in params]
        lengths = [len(p) for p in parts]
        feeds = {"positions": np.array([r.draft_state.cache.length for r in requests])[:, None] + np.arange(S),  # [B,S]
                 "lengths": np.array(lengths, np.int64),                                                         # [B]
                 "temperature": np.array(temperature, np.float32),                                               # [B]
                 "top_k": np.array([min(p.top_k, self.cfg.vocab_size) for p in params], np.int64),               # [B]
                 # in float32 a top_p as small as 1e-300 must not become 0 (which would keep no token)
                 "top_p": np.maximum(np.array([p.top_p for p in params], np.float32), np.finfo(np.float32).tiny),
                 "uniforms": uniforms,           # float32 may round u up to 1: the graph's draw takes u = 1 too
                 **self.method_feeds(requests, rows, lengths),
                 **self.pools[self.spec.graph].feeds([r.draft_state.cache for r in requests])}
        return self.calls.run(self.session, feeds, Call.CYCLE if S <= self.graph_k + 1 else Call.EXTEND)


__all__ = ["GraphDraftState", "GraphDrafter"]
