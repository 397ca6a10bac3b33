"""Prompt lookup: draft the tokens that followed the last occurrence of the request's own latest n-gram.

Code, documents being edited and chat transcripts repeat their own context; where the last n tokens occurred before,
the tokens that followed them then are a good guess for what follows now (vLLM's `ngram` method, transformers'
prompt lookup decoding). No weights and no engine call: it drafts on any engine whose target takes k + 1 positions
per call, `--mtp 0` ones included. The longest n-gram from `max_ngram` down to `min_ngram` that occurred before
wins, at its most recent earlier occurrence (recent text predicts better than old).

Each request keeps an index per n: n-gram -> the position right after its latest occurrence, grown as tokens are
committed, so a step's host work is proportional to the tokens it added, not to the context. Drafts are chosen,
not drawn: their distribution is one-hot, which keeps sampling lossless (a draft d is accepted with probability
p(d); on rejection the token is drawn from p without d).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from v4engine.contract.engine import MAX_MTP, EngineManifest

from ..sessions import EngineSession
from .base import Drafter, Proposal

MAX_NGRAM, MIN_NGRAM = 3, 1
DEFAULT_TOKENS = 3             # per step, on an engine without a draft graph's k to follow


@dataclass
class LookupState:
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)   # n -> n-gram -> position after it
    indexed: int = 0                 # tokens[:indexed] are in the index (occurrences ending before `indexed`)


class PromptLookupDrafter(Drafter):
    method = "prompt_lookup"

    @classmethod
    def default_tokens(cls, manifest: EngineManifest) -> int:
        return manifest.mtp or DEFAULT_TOKENS

    @classmethod
    def most_tokens(cls, manifest: EngineManifest, max_prefill_chunk: int) -> int:
        """As many as a target call takes beside the token before them, up to the engine format's MAX_MTP."""
        return min(MAX_MTP, max_prefill_chunk - 1)

    @classmethod
    def open(cls, manifest: EngineManifest, k: int, max_prefill_chunk: int,
             open_graph: Callable[[str], EngineSession]) -> "PromptLookupDrafter":
        return cls(k)

    def __init__(self, k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        super().__init__(k)
        self.ngrams = range(max_ngram, min_ngram - 1, -1)

    def start(self, request: Any, snapshot: Any, length: int) -> None:
        request.draft_state = LookupState({n: {} for n in self.ngrams})

    def propose(self, requests: list[Any]) -> float:
        for r in requests:
            r.proposal = Proposal(self.lookup(r.draft_state, r.tokens, r.num_draft_tokens))
        return 0.0

    def lookup(self, state: LookupState, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest n-gram ending `tokens`."""
        self._extend(state, tokens)
        for n in self.ngrams:
            if len(tokens) > n:
                after = state.index[n].get(tuple(tokens[-n:]))
                if after is not None:
                    return tokens[after: after + k]
        return []

    def _extend(self, state: LookupState, tokens: list[int]) -> None:
        """Index the occurrences that end before the last token (each has a token after it; the n-gram ending the
        sequence is never its own match) and were not indexed yet."""
        for n, index in state.index.items():
            for after in range(max(state.indexed, n), len(tokens)):
                index[tuple(tokens[after - n: after])] = after
        state.indexed = len(tokens)


__all__ = ["LookupState", "PromptLookupDrafter"]
