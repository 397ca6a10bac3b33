"""Paged cache pools with exact rollback: one preallocated pool per cache group, shared by every sequence.

The layout (contract/layout.py) says what each group holds. A sequence owns one slot of every fixed group's pool
(its window and partial-window rings) and a list of blocks of the growing groups' pools (compressed rows and
index keys, `block_tokens` positions per block). The graphs read the pools in place through the call's `slots`
and `block_table` (builder/model/paging.py); they never write them: they return deltas, and `commit(n)` writes
the rows of the first n new positions, and nothing else. Rollback is committing fewer. Host work per step is
therefore proportional to the new tokens, whatever the context.

The arrays are host numpy arrays or torch tensors on the engine's device (runtime/pool_arrays.py): the pool
allocates and writes through them. Device writes are deferred to one write per pool and step; everything that
reads or writes the arrays otherwise (a call's feeds, prefix snapshots and forks) flushes them first.

Blocks are reference-counted, so that a prompt prefix's blocks can be shared by the sequences that start with it
(runtime/prefix_cache.py). Rows are only ever added, never rewritten: a forked sequence writes only rows of
windows closed after its fork point, which lie in blocks of its own (its copy of a partial last block, or new
ones); the sequence a prefix entry was taken from may go on adding rows after the fork point to the entry's
partial last block, which no reader of the entry sees (a fork copies the block and masks those rows).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from v4engine.contract.errors import V4EngineError
from v4engine.contract.layout import BLOCK_TABLE, SLOTS, CacheGroup, CacheLayout, closed_windows

from .pool_arrays import PoolArrays


class PoolExhausted(V4EngineError):
    """A pool has no free slot or block left (the scheduler makes room or waits; callers never see it)."""


class CachePool:
    """The pools of one part (the target, or the MTP layer) for `slots` sequences and `blocks` blocks.

    Arrays are allocated zeroed, in `storage` (host or device). On the host they stay untouched, so a large
    budget costs memory only as blocks are used; device pools are allocated whole (the budget is capped by the
    device's free memory)."""

    def __init__(self, layout: CacheLayout, slots: int, blocks: int, storage: PoolArrays | Mapping[str, PoolArrays]):
        """storage: where every group's pool lives, or where each does by pool name (a pipeline's stages keep their
        layers' pools on their own devices, runtime/sessions/pipeline.py)."""
        self.layout, self.groups = layout, layout.groups
        self.storage_of = {g.pool: storage[g.pool] if isinstance(storage, Mapping) else storage for g in self.groups}
        self.arrays = {g.pool: self.storage_of[g.pool].zeros((blocks, g.block_rows, g.width) if g.ratio
                                                             else (slots, g.rows_fixed, g.width)) for g in self.groups}
        self._free_slots = list(range(slots - 1, -1, -1))
        self._free_blocks = list(range(blocks - 1, -1, -1))
        self.refs = np.zeros(blocks, np.int64)
        self.bytes_written = 0          # rows committed into the pools, in bytes (what a step costs the host)

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    # ------------------------------------------------------------------ slots and blocks
    def take_slot(self) -> int:
        if not self._free_slots:
            raise PoolExhausted("no free cache slot")
        return self._free_slots.pop()

    def free_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def take_blocks(self, n: int) -> list[int]:
        if n > len(self._free_blocks):
            raise PoolExhausted(f"{n} cache blocks asked, {len(self._free_blocks)} free")
        taken = [self._free_blocks.pop() for _ in range(n)]
        self.refs[taken] = 1
        return taken

    def share(self, blocks: list[int]) -> None:
        self.refs[blocks] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block no one holds is free again."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free_blocks.append(b)

    # ------------------------------------------------------------------ a call's inputs
    def flush(self) -> None:
        """Write the rows commits left pending (device pools defer them, one write per pool and step)."""
        for storage in {id(s): s for s in self.storage_of.values()}.values():
            storage.flush()

    def copy_block(self, source: int, target: int) -> None:
        """Every growing group's rows of block `source` into block `target` (a prefix fork's partial block)."""
        self.flush()
        for g in self.groups:
            if g.ratio:
                self.arrays[g.pool][target] = self.arrays[g.pool][source]

    # ------------------------------------------------------------------ a call's inputs
    def feeds(self, sequences: list["SequenceCache"]) -> dict[str, Any]:
        """`slots`, `block_table` and every pool (by reference: nothing is copied) for one call over `sequences`.
        A shorter table is padded with its own last block (any block would do: the rows are masked)."""
        self.flush()
        feeds: dict[str, np.ndarray] = {SLOTS: np.array([s.slot for s in sequences], np.int64)}
        if self.layout.paged:
            width = max(len(s.blocks) for s in sequences)
            table = np.zeros((len(sequences), width), np.int64)
            for b, s in enumerate(sequences):
                if s.blocks:
                    table[b, : len(s.blocks)] = s.block_array()
                    table[b, len(s.blocks):] = s.blocks[-1]
            feeds[BLOCK_TABLE] = table
        return feeds | self.arrays


class SequenceCache:
    """One sequence's part of a CachePool: its slot, its blocks and how many positions it has committed."""

    def __init__(self, pool: CachePool, length: int = 0):
        """A sequence of `length` committed positions (more than 0 only for one whose rows its creator writes: a
        prefix fork, or a draft that recomputes its window)."""
        self.pool, self.length = pool, length
        self.slot = pool.take_slot()
        self.blocks = []

    @property
    def blocks(self) -> list[int]:
        return self._blocks

    @blocks.setter
    def blocks(self, blocks: list[int]) -> None:
        self._blocks, self._array = list(blocks), None

    def block_array(self) -> np.ndarray:
        """The blocks as int64, made again only when they change: a step's calls and commits read them, and at 32K
        tokens a sequence holds about a thousand (a list made into an array each time grew a step's host work with
        the context)."""
        if self._array is None:
            self._array = np.array(self._blocks, np.int64)
            self._array.setflags(write=False)
        return self._array

    @property
    def nbytes(self) -> int:
        return self.pool.slot_bytes + len(self.blocks) * self.pool.block_bytes

    def blocks_needed(self, length: int) -> int:
        """Blocks more this sequence needs to hold `length` positions."""
        return max(0, self.pool.layout.blocks_for(length) - len(self.blocks))

    def reserve(self, length: int) -> None:
        """Hold the blocks for `length` positions (PoolExhausted, and nothing taken, if the pool has too few)."""
        needed = self.blocks_needed(length)
        if needed:
            self.blocks = self.blocks + self.pool.take_blocks(needed)

    def release(self) -> None:
        self.pool.free_slot(self.slot)
        self.pool.release(self.blocks)
        self.blocks = []

    def commit(self, deltas: dict[str, Any], n: int) -> None:
        """Write the rows of the first n new positions (this sequence's row of each `new.*` delta, by group pool
        name; numpy, or torch on the pools' device) into its slot and blocks, which `reserve` made room for."""
        if self.pool.layout.blocks_for(self.length + n) > len(self.blocks):
            raise ValueError(f"cache blocks for {self.length + n} positions were not reserved")
        for g in self.groups:
            new, pool = deltas[g.pool], self.pool.arrays[g.pool]
            if g.ratio:      # the rows of windows closed within the committed positions
                first = self.length // g.ratio
                rows = np.arange(first, first + closed_windows(self.length, n, g.ratio))
                count = len(rows)
                if count:
                    index = (self.block_array()[rows // g.block_rows], rows % g.block_rows)
                    self.pool.storage_of[g.pool].write(pool, index, new[:count])
            else:      # only the last ring-size positions survive a long chunk: write just those, once each
                count = min(n, g.rows_fixed)
                index = (np.full(count, self.slot), np.arange(self.length + n - count, self.length + n) % g.rows_fixed)
                self.pool.storage_of[g.pool].write(pool, index, new[n - count:n])
            self.pool.bytes_written += count * g.width * pool.itemsize
        self.length += n

    @property
    def groups(self) -> list[CacheGroup]:
        return self.pool.groups

    def ring_rows(self) -> dict[str, Any]:
        """A copy of this sequence's rings (its fixed groups' slot rows), where the pools are: a prefix snapshot
        (runtime/prefix_cache)."""
        self.pool.flush()
        return {g.pool: self.pool.storage_of[g.pool].clone(self.pool.arrays[g.pool][self.slot])
                for g in self.groups if not g.ratio}

    def restore_rings(self, rows: dict[str, Any]) -> None:
        self.pool.flush()        # a pending write to this slot (its previous owner's) must not land after these
        for name, value in rows.items():
            self.pool.arrays[name][self.slot] = value
