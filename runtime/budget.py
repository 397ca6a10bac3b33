"""The cache budget and the pool plan: how many slots and blocks each part's pools get, and where they live.

The budget bounds all of the cache memory: the pools and the prefix cache's snapshots (rings and drafters' state,
which live beside the pools). By default it holds the caches of max_batch sequences of max_seq_len tokens and
their snapshots' share, but never more than half of the memory the pools live in: the host's, or what each GPU
has free beside the weights (an engine.json cannot make the runtime promise memory it does not have, and device
pools are allocated whole). The budget pays for a slot of every part per batch row first (a budget that cannot is
refused), then for the snapshots: an eighth of what the pools get, but two per batch row at least (a wide model's
rings are large against a small budget: the slice's 3.4 MB snapshot against its 4.3 MB eighth kept one entry and
never hit), and never more than half of what the slots leave (the default budget holds that share beside full
pools, so nothing is cut there); then for as many target blocks as the rest holds,
never more than max_batch sequences of max_seq_len can use (nor than a shape-specialized engine's profiles take,
which stop there), and at least one where there are growing groups. A session of static shapes (MIGraphX's
programs) takes pools of its own sizes and no other: they must fit the budget given, or half of the memory they
live in, and are then the budget with the snapshots' share.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from v4engine.contract.backends import BACKENDS
from v4engine.contract.engine import EngineManifest, check_limits
from v4engine.contract.errors import V4EngineError
from v4engine.contract.layout import CacheLayout
from v4engine.contract.stages import TARGET

from .cache import CachePool
from .pool_arrays import PoolArrays, pool_arrays
from .sampling import RequestError
from .sessions import EngineSession


@dataclass(frozen=True)
class Limits:
    """What one Generator serves at most: None takes the engine's build limits (engine.json), or for the cache the
    default budget (the module doc)."""

    max_batch: int | None = None             # requests generating together
    max_seq_len: int | None = None           # tokens of a sequence, prompt and generated
    max_prefill_chunk: int | None = None     # prompt tokens per engine call
    max_cache_bytes: int | None = None       # the cache pools' budget

    def resolved(self, manifest: EngineManifest, source: str) -> "Limits":
        """These limits with the engine's in place of None, each checked (RequestError naming the one at fault):
        integers within bounds, and within the engine's own for a shape-specialized engine."""
        built = manifest.limits
        asked = {name: built[name] if getattr(self, name) is None else getattr(self, name) for name in built}
        check_limits(asked, manifest.model, source, RequestError)
        if BACKENDS[manifest.backend].shape_specialized:
            for name, value in asked.items():
                if value > built[name]:
                    raise RequestError(f"{source}: {name} {value} exceeds the {built[name]} this {manifest.backend} "
                                       "engine was built for (rebuild with a larger one)")
        cache = self.max_cache_bytes
        if cache is not None and (not isinstance(cache, int) or isinstance(cache, bool) or cache < 1):
            raise RequestError(f"{source}: max_cache_bytes must be a positive integer of bytes (got {cache!r:.60})")
        return replace(self, **asked)


@dataclass
class PoolPlan:
    """The cache pools of every part (the target's, and its drafter's parts), allocated; the budget they were
    sized from, and the share of it the prefix cache's snapshots may hold."""

    budget: int
    snapshots: int
    pools: dict[str, CachePool]


def sequence_bytes(layouts: dict[str, CacheLayout], capacity: int) -> int:
    """Bytes of every cache group of these parts for one sequence of `capacity` tokens (rows exactly)."""
    return sum(layout.bytes_for(capacity) for layout in layouts.values())


def plan_pools(layouts: dict[str, CacheLayout], sessions: dict[str, EngineSession], dtype: str, max_batch: int,
               max_seq_len: int, max_cache_bytes: int | None, snapshot_bytes: int) -> PoolPlan:
    """Pools for `layouts` (by part: TARGET's first, then the drafter's), each where the session of the same part
    reads it (a pipeline's stages: each on its own device; a drafter's beside the last stage), and the share of
    the budget for prefix snapshots of `snapshot_bytes` each (0: no prefix cache)."""
    device_of = {g.pool: sessions[part].pool_device_of(g.pool) for part, layout in layouts.items()
                 for g in layout.groups}
    storages = {device: pool_arrays(dtype, device) for device in dict.fromkeys(device_of.values())}
    storage = {pool: storages[device] for pool, device in device_of.items()}
    cap = max_cache_bytes if max_cache_bytes is not None else \
        _memory_cap(storages, device_of, layouts, max_seq_len)
    target = layouts[TARGET]
    fixed = {part: sessions[part].pool_shape or {} for part in layouts}
    fixed_bytes = sum(fixed[part].get("pool_slots", 0) * layout.slot_bytes
                      + fixed[part].get("pool_blocks", 0) * layout.block_bytes for part, layout in layouts.items())
    if fixed_bytes > cap:
        raise V4EngineError(f"this engine's programs take cache pools of {fixed_bytes / 2**30:.2f} GiB "
                            f"(max_batch x max_seq_len as built), more than the cache budget of "
                            f"{cap / 2**30:.2f} GiB; rebuild it with a smaller --max-batch or --max-seq-len")
    slots, floor = max_batch * sequence_bytes(layouts, 0), 2 * max_batch * snapshot_bytes
    full = fixed_bytes or max_batch * sequence_bytes(layouts, max_seq_len)
    wanted = max(full // 8, floor) if snapshot_bytes else 0      # the snapshots' share on top of full pools
    budget = min(full + wanted, cap) if max_cache_bytes is None else max_cache_bytes
    least = fixed_bytes or slots + target.block_bytes
    if budget < least:
        given = f"max_cache_bytes {budget}" if max_cache_bytes is not None else \
            f"the cache budget of {budget} bytes (half the memory the pools live in)"
        raise RequestError(f"{given} is less than the {least} bytes of the slots of max_batch {max_batch} rows and "
                           "one block; raise it or lower max_batch")
    snapshots = wanted if budget == full + wanted else \
        min(max(budget // 9, floor), (budget - slots) // 2, budget - least) if snapshot_bytes else 0
    blocks = min(max(1, (budget - snapshots - slots) // target.block_bytes),
                 max_batch * target.table_blocks(max_seq_len)) if target.block_bytes else 0
    pools = {part: CachePool(layout, fixed[part].get("pool_slots", max_batch),
                             fixed[part].get("pool_blocks", blocks if part == TARGET else 0), storage)
             for part, layout in layouts.items()}
    return PoolPlan(fixed_bytes + snapshots if fixed_bytes else budget, snapshots, pools)


def _memory_cap(storages: dict[str | None, PoolArrays], device_of: dict[str, str | None],
                layouts: dict[str, CacheLayout], seq_len: int) -> int:
    """The largest cache budget that takes at most half of each place's memory, given the share of a sequence's
    cache bytes each place holds (all of it, unless a pipeline spreads the pools over several GPUs). Host numpy
    pools and torch CPU pools share one place: the host's memory."""
    place = {device: "cpu" if device is None else device for device in storages}
    held = dict.fromkeys(place.values(), 0)
    for g in (g for layout in layouts.values() for g in layout.groups):
        held[place[device_of[g.pool]]] += g.bytes_for(seq_len)
    memory = {place[device]: storage.memory() for device, storage in storages.items()}
    total = sum(held.values())
    return min(memory[p] // 2 * total // max(1, held[p]) for p in held)


__all__ = ["Limits", "PoolPlan", "plan_pools", "sequence_bytes"]
