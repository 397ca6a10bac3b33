"""MTP drafting: V4's one-layer MTP module, a whole draft cycle per engine call (builder/model/drafting.py).

The MTP layer at position i reads the target's streams H_i and the next token t_{i+1}, and keeps a window cache of
its own (the `draft` part: one ring per sequence). Each cycle runs DRAFT-EXTEND over the positions the target
committed since the last cycle (the whole prompt on the first: its streams are what the layer reads), in chunks of
max_prefill_chunk as the target prefills; its last row gives d1, then k - 1 more steps on the layer's own streams
give d2..dk, drawn inside the graph from each request's sampling settings with uniform numbers from the request's
own generator. Only the extend's rows are committed: the drafts' own rows never are (the next cycle rewrites those
positions from the target's true streams).

Per request it keeps the streams of the committed positions it has not extended over yet (`pending`) and, while
prefix snapshots are taken, the streams of the last W - 1 prefill positions: a fork recomputes exactly the window
it reads from those (runtime/prefix_cache.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from v4engine.contract.calls import Call
from v4engine.contract.drafting import MTP
from v4engine.contract.engine import EngineManifest
from v4engine.contract.layout import STREAMS

from ..cache import SequenceCache
from ..pool_arrays import NUMPY_DTYPES
from ..sessions import EngineSession
from .base import Drafter, Proposal


@dataclass
class MtpState:
    cache: SequenceCache | None             # the layer's window ring (None: the request does not draft)
    pending: list[np.ndarray] = field(default_factory=list)   # streams of positions [cache.length, target length)
    tail: np.ndarray | None = None          # prefill streams of the last W - 1 positions (prefix snapshots)


class MtpDrafter(Drafter):
    method = MTP.method
    has_graph = True
    reads = (STREAMS,)

    @classmethod
    def most_tokens(cls, manifest: EngineManifest, max_prefill_chunk: int) -> int:
        """Its graph drafts the engine's k per call: an engine built with another drafter (or none) has no MTP."""
        return manifest.mtp if manifest.drafter == cls.method else 0

    @classmethod
    def open(cls, manifest: EngineManifest, k: int, max_prefill_chunk: int,
             open_graph: Callable[[str], EngineSession]) -> "MtpDrafter":
        return cls(manifest, open_graph(MTP.graph), k, max_prefill_chunk)

    def __init__(self, manifest: EngineManifest, session: EngineSession, k: int, max_prefill_chunk: int):
        super().__init__(k)
        self.cfg, self.session, self.chunk = manifest.model, session, max_prefill_chunk
        self.graph_k = manifest.mtp                  # drafts per call of the graph (a request keeps its first k)
        self.parts = {MTP.graph: manifest.caches[MTP.graph]}
        self.dtype = NUMPY_DTYPES[manifest.dtype]     # of the streams: what the target returns
        self.window = self.cfg.sliding_window - 1

    def snapshot_bytes(self) -> int:
        return self.window * self.cfg.hc_mult * self.cfg.hidden_size * np.dtype(self.dtype).itemsize

    # ------------------------------------------------------------------ state
    def start(self, request: Any, snapshot: np.ndarray | None, length: int) -> None:
        """A fork recomputes its window from the snapshot's streams: its cache starts that many positions back."""
        recompute = len(snapshot) if snapshot is not None else 0
        cache = SequenceCache(self.pools[MTP.graph], length=length - recompute) if request.num_draft_tokens else None
        request.draft_state = MtpState(cache, [snapshot] if snapshot is not None and cache is not None else [],
                                       snapshot)

    def observe(self, request: Any, rows: dict[str, Any], n: int, prefill: bool) -> None:
        state: MtpState = request.draft_state
        streams = rows[STREAMS][:n]
        if state.cache is not None:                 # the layer reads these streams
            state.pending.append(streams)
        if prefill and self.snapshots:
            state.tail = streams[-self.window:] if state.tail is None else \
                np.concatenate([state.tail, streams])[-self.window:]

    def snapshot(self, request: Any) -> np.ndarray:
        return request.draft_state.tail

    def caches(self, request: Any) -> list[SequenceCache]:
        state = request.draft_state
        return [state.cache] if state is not None and state.cache is not None else []

    # ------------------------------------------------------------------ the draft cycle
    def propose(self, requests: list[Any]) -> float:
        """One draft cycle per request: DRAFT-EXTEND over the newly committed positions and the recursive steps,
        in one engine call (more only when the extend is longer than a prefill chunk). Each request keeps its own
        num_draft_tokens of the graph's k drafts, and, when it samples, the distributions they were drawn from."""
        if not requests:
            return 0.0
        hidden = {r.id: np.concatenate(r.draft_state.pending) for r in requests}
        ids = {r.id: r.tokens[r.draft_state.cache.length + 1: r.target.length + 1] for r in requests}
        engine, chunk = 0.0, self.chunk
        for start in range(0, max(map(len, ids.values())), chunk):      # in chunks, as the target prefills
            rows = [r for r in requests if len(ids[r.id]) > start]
            last = [len(ids[r.id]) <= start + chunk for r in rows]
            out, seconds = self._call(rows, [hidden[r.id][start: start + chunk] for r in rows],
                                      [ids[r.id][start: start + chunk] for r in rows], last)
            engine += seconds
            groups = self.parts[MTP.graph].groups
            for b, (r, drafting) in enumerate(zip(rows, last)):
                r.draft_state.cache.commit({g.pool: out[g.new][b] for g in groups}, len(ids[r.id][start: start + chunk]))
                if drafting:
                    n = r.num_draft_tokens
                    r.proposal = Proposal([int(d) for d in out["drafts"][b, :n]],
                                          None if r.params.greedy else out["draft_probs"][b, :n])
        for r in requests:
            r.draft_state.pending = []
        return engine

    def _call(self, requests: list[Any], hidden: list[np.ndarray], ids: list[list[int]], drafting: list[bool]
              ) -> tuple[dict[str, np.ndarray], float]:
        """One draft-cycle call: the extend rows of each request, and its k drafts. Sampling rows that draft in this
        call (`drafting`: the chunk is their last) get their uniform numbers from their own generator."""
        S, B, K = max(len(t) for t in ids), len(requests), self.graph_k
        N, D = self.cfg.hc_mult, self.cfg.hidden_size
        h = np.zeros((B, S, N, D), self.dtype)                              # [B, S, hc, D] the target's streams
        tok = np.zeros((B, S), np.int64)                                     # [B, S] the next token of each
        uniforms = np.zeros((B, K), np.float32)                              # [B, K] one per draft
        for b, (r, rows, t, draws) in enumerate(zip(requests, hidden, ids, drafting)):
            h[b, : len(t)] = rows
            tok[b, : len(t)] = t
            if draws and not r.params.greedy:
                uniforms[b, : r.num_draft_tokens] = r.rng.random(r.num_draft_tokens)
        params = [r.params for r in requests]
        feeds = {STREAMS: h, "input_ids": tok,
                 "positions": np.array([r.draft_state.cache.length for r in requests])[:, None] + np.arange(S),  # [B, S]
                 "lengths": np.array([len(t) for t in ids], np.int64),                                            # [B]
                 "temperature": np.array([p.temperature for p in params], np.float32),                            # [B]
                 "top_k": np.array([min(p.top_k, self.cfg.vocab_size) for p in params], np.int64),                # [B]
                 # in float32 a top_p as small as 1e-300 must not become 0 (which would keep no token)
                 "top_p": np.maximum(np.array([p.top_p for p in params], np.float32), np.finfo(np.float32).tiny),
                 "uniforms": uniforms,           # float32 may round u up to 1: the graph's draw takes u = 1 too
                 **self.pools[MTP.graph].feeds([r.draft_state.cache for r in requests])}
        return self.calls.run(self.session, feeds, Call.CYCLE if S <= self.graph_k + 1 else Call.EXTEND)


__all__ = ["MtpDrafter", "MtpState"]
