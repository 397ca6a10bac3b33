"""The paged cache pools, sequence caches and prefix cache on hand-made pools, no engine: every row a commit writes
carries its position (rings) or its window's index (growing groups), so each test reads back exactly where rows
went, what a rollback (committing fewer) left out, and what a fork shares, copies and masks."""
from __future__ import annotations

import numpy as np
import pytest

from v4engine.builder.tiny import TINY_CONFIGS
from v4engine.contract.config import V4Config
from v4engine.contract.layout import BLOCK_TABLE, SLOTS, CacheLayout, closed_windows
from v4engine.runtime.cache import CachePool, PoolExhausted, SequenceCache
from v4engine.runtime.pool_arrays import HostArrays
from v4engine.runtime.prefix_cache import PrefixCache

CFG = V4Config.from_dict(TINY_CONFIGS["mixed"])          # sliding window 8; CSA ratio 4, HCA ratio 8
LAYOUT = CacheLayout.target(CFG)                         # 16 positions per block: 4 CSA rows, 2 HCA rows
assert LAYOUT.block_tokens == 16


def pool(slots: int = 4, blocks: int = 16) -> CachePool:
    return CachePool(LAYOUT, slots, blocks, HostArrays("fp32"))


def deltas(start: int, n: int, tag: float = 0.0) -> dict[str, np.ndarray]:
    """What a call of n new positions from `start` returns, each row labelled: a ring's row by its position, a
    growing group's by its window's index (+ tag, to tell sequences apart)."""
    out = {}
    for g in LAYOUT.groups:
        if g.ratio:
            windows = np.arange(start // g.ratio, start // g.ratio + closed_windows(start, n, g.ratio) + 1)
            out[g.pool] = np.repeat(windows[:, None] + tag, g.width, axis=1).astype(np.float32)
        else:
            out[g.pool] = np.repeat(np.arange(start, start + n)[:, None] + tag, g.width, axis=1).astype(np.float32)
    return out


def committed(s: SequenceCache) -> dict[str, list[float]]:
    """Each group's rows as `s` holds them: a ring's rows by slot index, a growing group's rows in window order."""
    p, out = s.pool, {}
    for g in LAYOUT.groups:
        if g.ratio:
            rows = [p.arrays[g.pool][s.blocks[w // g.block_rows], w % g.block_rows, 0] for w in range(s.length // g.ratio)]
        else:
            rows = list(p.arrays[g.pool][s.slot, :, 0])
        out[g.pool] = [float(r) for r in rows]
    return out


def test_a_commit_writes_the_last_rows_of_each_ring_and_the_windows_it_closes():
    p = pool()
    s = SequenceCache(p)
    s.reserve(21)
    s.commit(deltas(0, 13), 13)
    s.commit(deltas(13, 8), 8)                           # 21 positions
    for g in LAYOUT.groups:
        got = committed(s)[g.pool]
        if g.ratio:
            assert got == list(range(21 // g.ratio)), g.pool
        else:                                            # the ring holds positions 21 - rows .. 20 at pos % rows
            want = [0.0] * g.rows_fixed
            for position in range(max(0, 21 - g.rows_fixed), 21):
                want[position % g.rows_fixed] = position
            assert got == want, g.pool


def test_rollback_is_committing_fewer_positions():
    """A verify of 4 positions of which 2 are kept writes the rows of those 2 only: no row of a rejected position,
    and no window closed only by one, ever reaches the pools."""
    p = pool()
    s = SequenceCache(p)
    s.reserve(20)
    s.commit(deltas(0, 6), 6)
    before = {name: array.copy() for name, array in p.arrays.items()}
    s.commit(deltas(6, 4, tag=0.5), 2)                   # positions 6, 7 kept; 8, 9 rejected
    assert s.length == 8
    for g in LAYOUT.groups:
        changed = np.argwhere((p.arrays[g.pool] != before[g.pool]).any(axis=-1))
        labels = sorted({float(p.arrays[g.pool][tuple(i)][0]) for i in changed})
        if g.ratio:                                      # the windows positions 6 and 7 close, nothing more
            assert labels == [w + 0.5 for w in range(6 // g.ratio, 8 // g.ratio)], g.pool
        else:
            assert labels == [6.5, 7.5], g.pool


def test_reserving_takes_only_the_blocks_positions_need_and_nothing_when_the_pool_is_short():
    p = pool(slots=2, blocks=3)
    a, b = SequenceCache(p), SequenceCache(p)
    # a block is taken by its first row: 19 positions close 4 CSA windows (one block of 4 rows), 20 close 5
    assert a.blocks_needed(3) == 0 and a.blocks_needed(19) == 1 and a.blocks_needed(20) == 2
    a.reserve(20)
    assert len(a.blocks) == 2 and p.free_blocks == 1
    with pytest.raises(PoolExhausted):
        b.reserve(40)                                    # three blocks asked, one free: none taken
    assert p.free_blocks == 1 and b.blocks == []
    with pytest.raises(PoolExhausted):
        SequenceCache(p)                                 # no third slot
    with pytest.raises(ValueError, match="were not reserved"):
        b.commit(deltas(0, 5), 5)
    a.release()
    assert p.free_blocks == 3 and SequenceCache(p).slot == a.slot


def test_a_calls_feeds_hold_each_rows_slot_and_blocks_and_the_pools_themselves():
    p = pool()
    a, b = SequenceCache(p), SequenceCache(p)
    a.reserve(40)
    b.reserve(5)
    feeds = p.feeds([a, b])
    assert list(feeds[SLOTS]) == [a.slot, b.slot] and len(a.blocks) == 3 and len(b.blocks) == 1
    assert feeds[BLOCK_TABLE].tolist() == [a.blocks, b.blocks * 3], "a shorter row repeats its last block"
    assert all(feeds[g.pool] is p.arrays[g.pool] for g in LAYOUT.groups), "by reference: nothing copied"


def test_shared_blocks_are_free_only_when_the_last_holder_lets_go():
    p = pool(blocks=4)
    [block] = p.take_blocks(1)
    p.share([block])
    p.release([block])
    assert p.free_blocks == 3 and p.refs[block] == 1
    p.release([block])
    assert p.free_blocks == 4 and p.refs[block] == 0


def filled(p: CachePool, length: int, tag: float = 0.0) -> SequenceCache:
    s = SequenceCache(p)
    s.reserve(length)
    s.commit(deltas(0, length, tag), length)
    return s


def test_a_fork_shares_full_blocks_copies_the_partial_one_and_restores_the_rings():
    p = pool()
    prefix = PrefixCache(p, max_bytes=1 << 30)
    tokens = list(range(100, 130))
    source = filled(p, 21)                               # one full block (16 positions) and a partial one
    snapshot = np.arange(6, dtype=np.float32)
    prefix.insert(tokens, source, snapshot)
    snapshot[:] = -1                                     # the entry keeps its own copy of the drafter's snapshot
    entry = prefix.lookup(tokens, limit=29)
    assert entry.length == 21 and entry.draft.tolist() == list(range(6))
    source.commit(deltas(21, 3, tag=0.5), 3)             # the source goes on writing into its partial block
    fork = prefix.fork(entry)
    assert fork.length == 21 and fork.blocks[0] == source.blocks[0] and fork.blocks[1] != source.blocks[1]
    assert p.refs[source.blocks[0]] == 3, "source, entry and fork hold the full block"
    got, want = committed(fork), committed(filled(pool(), 21))
    assert got == want, "the fork sees the state at 21: the source's later rows are not in its copy or rings"


def test_lookup_finds_the_longest_entry_a_prompt_starts_with_within_the_limit():
    p = pool(slots=8, blocks=32)
    prefix = PrefixCache(p, max_bytes=1 << 30)
    base = list(range(200, 260))
    for length in (16, 33, 48):
        s = filled(p, length)
        prefix.insert(base, s, None)
        s.release()
    assert prefix.lookup(base, limit=59).length == 48
    assert prefix.lookup(base, limit=47).length == 33
    assert prefix.lookup(base[:20] + [1] * 40, limit=59).length == 16, "confirmed token by token"
    assert prefix.lookup([7] + base, limit=59) is None


def test_a_cache_salt_keeps_entries_apart_and_each_salt_finds_its_own():
    """A tenant's salt keys its entries: the same prompt under another salt (or none) finds nothing, so neither
    the hit count nor the time to first token tells whether someone else sent it."""
    p = pool(slots=8, blocks=32)
    prefix = PrefixCache(p, max_bytes=1 << 30)
    tokens = list(range(300, 340))
    s = filled(p, 33)
    prefix.insert(tokens, s, None, salt="tenant-a")
    s.release()
    assert prefix.lookup(tokens, limit=39, salt="tenant-a").length == 33
    assert prefix.lookup(tokens, limit=39) is None and prefix.lookup(tokens, limit=39, salt="tenant-b") is None
    s = filled(p, 33, tag=1.0)
    prefix.insert(tokens, s, None)                       # the same tokens, no salt: an entry of its own
    s.release()
    assert len(prefix.entries) == 2 and prefix.lookup(tokens, limit=39).salt == ""
    prefix.clear()
    assert not prefix.entries and not prefix.by_blocks and p.free_blocks == 32


def test_entries_past_the_byte_cap_are_evicted_oldest_use_first_and_free_their_blocks():
    p = pool(slots=8, blocks=32)
    one = LAYOUT.slot_bytes
    prefix = PrefixCache(p, max_bytes=2 * one)
    prompts = [[i] * 40 for i in range(3)]
    for tokens in prompts[:2]:
        s = filled(p, 33)
        prefix.insert(tokens, s, None)
        s.release()
    prefix.lookup(prompts[0], limit=39)                  # the first is used again: the second is now the oldest
    s = filled(p, 33)
    prefix.insert(prompts[2], s, None)
    s.release()
    assert [e.tokens[0] for e in prefix.entries.values()] == [0, 2] and prefix.nbytes <= 2 * one
    held = {b for e in prefix.entries.values() for b in e.blocks}
    assert p.free_blocks == 32 - len(held), "the evicted entry's blocks are free again"
    keep = prefix.lookup(prompts[2], limit=39)
    assert prefix.freeable(keep) == len(prefix.lookup(prompts[0], limit=39).blocks)
    prefix.clear()
    assert not prefix.entries and p.free_blocks == 32
