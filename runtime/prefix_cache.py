"""Prefix caching: a prompt that starts like an earlier one starts from that prompt's cache state.

A V4 sequence's state at position P is more than its compressed rows: the sliding window and the compressors'
open windows are rings that move on with every token, so an earlier request's live state at P is gone once it
has passed P (and cannot be recomputed from the last window alone: those positions' rows depend on the windows
before them, layer by layer). An entry is therefore taken whenever a prefill chunk ends, at P, and holds, for
tokens[:P] exactly:
- the target's blocks holding the rows of windows closed before P, shared by reference count. Full blocks are
  never written again; the last one, when P is not a block boundary, is copied into a block of the forking
  sequence's own (the rows after P in it are the earlier sequence's, and are overwritten before they are read);
- a copy of the target's rings at P (windows and compressors' partial windows: O(window) rows per layer);
- the drafter's snapshot: what it needs to rebuild its state at P exactly (runtime/drafters/). MTP's is the
  target's streams of the last W - 1 positions before P: the MTP layer's window rows at a position are a function
  of that position's inputs only (its streams and the next token), so a forked request's first draft cycle
  recomputes exactly the draft window it reads, from P - (W - 1) on.
A request that forks at P runs exactly the tokens of a cold run from P on. Entries are found through a chain of
block hashes (blake2b) of their full blocks, confirmed token by token, and evicted least recently used: when the
pool needs blocks, or when the snapshots' own bytes pass their cap. A request's `cache_salt` (SamplingParams)
starts the chain and is part of every entry's identity: requests of different salts never share an entry.
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cache import CachePool, PoolExhausted, SequenceCache


@dataclass
class PrefixEntry:
    salt: str                            # the cache_salt of the request it was taken from ("" for none)
    tokens: tuple[int, ...]
    blocks: list[int]                    # target blocks with rows of positions [0, P), one reference held here
    rings: dict[str, Any]                # the target's rings at P, by pool name (where the pools are)
    draft: np.ndarray | None             # the drafter's snapshot at P, or None

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.rings.values()) + (self.draft.nbytes if self.draft is not None else 0)


class PrefixCache:
    """Entries of one scheduler's target pool; `max_bytes` caps the snapshots' own bytes (rings and drafters')."""

    def __init__(self, pool: CachePool, max_bytes: int):
        self.pool, self.max_bytes = pool, max_bytes
        self.block_tokens = pool.layout.block_tokens
        self.entries: OrderedDict[tuple, PrefixEntry] = OrderedDict()   # by (salt, tokens), oldest use first
        self.by_blocks: dict[bytes, list[PrefixEntry]] = {}      # by the hash of their full blocks
        self.nbytes = 0

    def _keys(self, salt: str, tokens: list[int], blocks: int) -> list[bytes]:
        """The chained hash of the salt and tokens[:i * block_tokens] for i = 0..blocks."""
        keys, bt = [hashlib.blake2b(salt.encode(), digest_size=16).digest() if salt else b""], self.block_tokens
        data = np.asarray(tokens[: blocks * bt], np.int64)
        for i in range(blocks):
            keys.append(hashlib.blake2b(keys[-1] + data[i * bt:(i + 1) * bt].tobytes(), digest_size=16).digest())
        return keys

    def lookup(self, tokens: list[int], limit: int, salt: str = "") -> PrefixEntry | None:
        """The longest entry of `salt` that `tokens` starts with, of at most `limit` positions (most recently used
        now)."""
        for key in reversed(self._keys(salt, tokens, limit // self.block_tokens)):
            found = [e for e in self.by_blocks.get(key, ()) if e.length <= limit and e.salt == salt
                     and tuple(tokens[: e.length]) == e.tokens]
            if found:
                entry = max(found, key=lambda e: e.length)
                self.entries.move_to_end((entry.salt, entry.tokens))
                return entry
        return None

    def insert(self, tokens: list[int], cache: SequenceCache, draft: np.ndarray | None, salt: str = "") -> None:
        """Remember `cache` (the target's) as the state after tokens[:cache.length] for requests of `salt`, with a
        copy of the drafter's snapshot there (None: it needs none)."""
        length = cache.length
        key = (salt, tuple(tokens[:length]))
        if length == 0 or key in self.entries:
            return
        blocks = cache.blocks[: self.pool.layout.blocks_for(length)]
        entry = PrefixEntry(salt, key[1], blocks, cache.ring_rows(), draft.copy() if draft is not None else None)
        if entry.nbytes > self.max_bytes:
            return
        self.pool.share(blocks)
        self.entries[key] = entry
        self.by_blocks.setdefault(self._keys(salt, tokens, length // self.block_tokens)[-1], []).append(entry)
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self.evict_one()

    def evict_one(self, keep: PrefixEntry | None = None) -> bool:
        """Drop the least recently used entry other than `keep`; False when there is none."""
        for key, entry in self.entries.items():
            if entry is not keep:
                del self.entries[key]
                base = self._keys(entry.salt, list(entry.tokens), entry.length // self.block_tokens)[-1]
                self.by_blocks[base].remove(entry)
                if not self.by_blocks[base]:
                    del self.by_blocks[base]
                self.pool.release(entry.blocks)
                self.nbytes -= entry.nbytes
                return True
        return False

    def freeable(self, keep: PrefixEntry | None = None) -> int:
        """Blocks that evicting every entry but `keep` would free: those no running sequence holds."""
        held = Counter(b for e in self.entries.values() if e is not keep for b in e.blocks)
        return sum(1 for b, n in held.items() if self.pool.refs[b] == n)

    def fork(self, entry: PrefixEntry) -> SequenceCache:
        """A new target sequence at the entry's state: its full blocks shared, its partial last block (if any)
        copied into one of the sequence's own (PoolExhausted if none is free), its rings copied."""
        full = entry.length // self.block_tokens
        cache = SequenceCache(self.pool, length=entry.length)
        try:
            own = self.pool.take_blocks(len(entry.blocks) - full)    # for the rows after the fork
        except PoolExhausted:
            cache.release()
            raise
        self.pool.share(entry.blocks[:full])
        cache.blocks = entry.blocks[:full] + own
        if own:
            self.pool.copy_block(entry.blocks[full], own[0])
        cache.restore_rings(entry.rings)
        return cache

    def clear(self) -> None:
        while self.evict_one():
            pass
