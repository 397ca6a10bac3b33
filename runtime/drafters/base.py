"""The drafter seam: what the scheduler asks of a drafting method, whatever it is (docs/extending.md §1).

Once per step the scheduler hands the requests that decode to its drafter's `propose`, which sets each one's
`proposal`: the draft tokens and the distributions they were drawn from. The target verifies them and commits the
accepted prefix; the scheduler then tells the drafter what the target committed (`observe`: the rows of the
outputs it `reads`, for the committed positions only, prefill chunks included). A drafter's per-request state
lives in `Request.draft_state`, made by `start` (empty, or from a prefix snapshot) and dropped by `release`; a
preempted request is released and started again, and recomputes its state from the target's outputs as its
prefill is recomputed. A drafter that keeps caches says which (`parts`: cache layouts the scheduler's pool plan
sizes and allocates beside the target's) and which session reads them.

Lossless acceptance needs only that each draft was drawn from the distribution the proposal gives for it; a
drafter that picks its drafts deterministically (prompt lookup) gives none, which means one-hot.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from v4engine.contract.engine import EngineManifest
from v4engine.contract.layout import CacheLayout

from ..cache import CachePool, SequenceCache
from ..engine_calls import EngineCalls
from ..sessions import EngineSession

if TYPE_CHECKING:
    from ..scheduler import Request


@dataclass
class Proposal:
    """One request's drafts for its next verify. `probs` [len(tokens), V]: the distribution each was drawn from (numpy,
    or a torch tensor on the device where a draft graph left it); None: each was chosen deterministically (a one-hot
    distribution)."""

    tokens: list[int]
    probs: Any = None
    confidence: np.ndarray | None = None     # [len(tokens)]: each draft's survival chance, where the drafter says

    def trimmed(self, n: int) -> "Proposal":
        """The first n drafts (a verify never commits past the request's capacity)."""
        return Proposal(self.tokens[:n], None if self.probs is None else self.probs[:n],
                        None if self.confidence is None else self.confidence[:n])



class Drafter(ABC):
    """One drafting method, drafting up to `k` tokens per request and step."""

    method: str                                  # its name (v4generate --drafter, engine.json's `drafter`)
    has_graph: bool = False                      # whether it runs a draft graph of the engine's
    gives_confidence: bool = False               # whether each proposal says its drafts' confidence
    reads: tuple[str, ...] = ()                  # target outputs it observes, per committed position
    parts: dict[str, CacheLayout] = {}           # its cache parts, by name, each a pool of the scheduler's
    session: EngineSession | None = None         # the graph it calls, which reads its pools

    @classmethod
    def default_tokens(cls, manifest: EngineManifest) -> int:
        """Draft tokens per step when the caller names none: the engine's k."""
        return manifest.mtp

    @classmethod
    @abstractmethod
    def most_tokens(cls, manifest: EngineManifest, max_prefill_chunk: int) -> int:
        """The most draft tokens per step it can make on this engine (0: it cannot draft on it)."""

    @classmethod
    @abstractmethod
    def open(cls, manifest: EngineManifest, k: int, max_prefill_chunk: int,
             open_graph: Callable[[str], EngineSession]) -> "Drafter":
        """The drafter for this engine, drafting k tokens per step (1 <= k <= most_tokens); `open_graph(name)` opens
        one of the engine's graphs as the target's sessions are opened (backend options, device)."""

    def __init__(self, k: int):
        self.k = k
        self.sample_method = "probabilistic"     # how sampling requests that name none draw their drafts
        self.pools: dict[str, CachePool] = {}
        self.calls = EngineCalls()
        self.snapshots = False

    def bind(self, pools: dict[str, CachePool], calls: EngineCalls, snapshots: bool) -> None:
        """Take the pools the scheduler allocated for `parts`, the scheduler's engine calls, and whether prefix
        snapshots are taken (then `snapshot` is asked for after every prefill chunk)."""
        self.pools, self.calls, self.snapshots = pools, calls, snapshots

    def snapshot_bytes(self) -> int:
        """The most bytes a prefix snapshot of this drafter's state holds."""
        return 0

    @abstractmethod
    def start(self, request: Request, snapshot: Any, length: int) -> None:
        """Give `request` its state (`request.draft_state`) at a target cache of `length` committed positions:
        empty (length 0), or forked from a prefix entry holding `snapshot` (what `snapshot` returned)."""

    def observe(self, request: Request, rows: dict[str, Any], n: int, prefill: bool) -> None:
        """The target committed n positions of `request` (a prefill chunk when `prefill`, else the accepted drafts
        and the bonus token's input); `rows` holds, for each output in `reads`, this request's rows of them."""

    def snapshot(self, request: Request) -> np.ndarray | None:
        """What a prefix entry taken now must keep (a copy of) for a fork to rebuild this drafter's state exactly
        (None: nothing)."""
        return None

    @abstractmethod
    def propose(self, requests: list[Request]) -> float:
        """Set each request's `proposal` (its num_draft_tokens drafts at most, or none); the engine seconds."""

    def caches(self, request: Request) -> list[SequenceCache]:
        """The cache sequences `request` holds in this drafter's pools."""
        return []

    def release(self, request: Request) -> None:
        """Free `request`'s state and caches (it finished, or was preempted and will start again)."""
        for cache in self.caches(request):
            cache.release()
        request.draft_state = None


__all__ = ["Drafter", "Proposal"]
