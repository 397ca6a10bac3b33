"""The kinds of engine call the scheduler makes, and which of them CUDA graphs record.

Every call of an engine graph is one of `Call`: the target's PREFILL (a prompt chunk, verify rows riding along) and
VERIFY (k + 1 tokens per row), a draft graph's EXTEND (a prompt's positions, in chunks) and CYCLE (the positions a
verify committed, then the drafts). A shape-specialized engine holds one optimization profile per kind, named by
its value (builder/backends/profiles.py); benchmarks time calls by kind (runtime/engine_calls.py).

CUDA graphs: an engine's per-token calls, a verify and a draft cycle, each replayed as one launch.

On a GPU a decode step of a small batch is hundreds of small kernels, and launching them one by one from the host
costs more than running them. A CUDA graph records one call's launches once and replays them with one launch. It
replays exactly what it recorded: the same kernels on the same addresses at the same shapes. So:
- the calls of the engine's `verify` and `cycle` profiles (CAPTURED_CALLS) are padded to buckets of static shapes
  (contract/buckets.py, as MIGraphX's programs are): batch, block-table width and positions (up to k + 1) at powers
  of two. Calls no bucket covers (prefill and extend chunks longer than k + 1: once per prompt, not per token) run
  as before;
- every other input lives in a buffer of the bucket's shape that is allocated once (runtime/static_calls.py
  `StaticCalls`, which MIGraphX's programs run through too); a call copies its own (padded) values into them,
  and the first call of a bucket records it on those values;
- the cache pools are passed in place, at whatever size the scheduler gave them: a call whose pools are not those
  its bucket was recorded on (moved, or grown) is recorded again on them;
- the outputs are written into buffers of their shape (shared by the buckets that differ only in block-table
  width: they are replayed one at a time); a call gets its rows cut back and copied out, so the next replay can
  write the same buffers.
The graphs the engine holds for this have no control flow (v4build --cuda-graphs: Sinkhorn's rounds unrolled,
the draft's conditionals dropped), which ONNX Runtime requires and TensorRT's recording of an enqueue needs.

The recording itself is the backend's (the `bind` StaticCalls is given): ONNX Runtime's CUDA provider records an
IOBinding's run under a graph id of its own after a warm-up run (`enable_cuda_graph`); TensorRT's enqueue is
recorded by torch.cuda.graph.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum

from .buckets import Bucket, graph_buckets, powers_of_two
from .layout import TensorSpec
from .profiles import Profile


class Call(StrEnum):
    """A kind of engine call; its value names the optimization profile that serves it."""

    PREFILL = "prefill"         # target: a prompt chunk of up to max_prefill_chunk tokens per row
    VERIFY = "verify"           # target: [t, d1..dk] per row, every decode step
    EXTEND = "extend"           # draft graph: a prompt's positions, in chunks, then the drafts
    CYCLE = "cycle"             # draft graph: the 1..k+1 positions a verify committed, then the drafts


CAPTURED_CALLS = (Call.VERIFY, Call.CYCLE)     # the calls recorded as CUDA graphs: one of each per generated token


def target_calls(k: int, chunk: int) -> dict[Call, tuple[int, int, int]]:
    """The target's calls and the (min, opt, max) positions per row of each, for k drafts per step."""
    return {Call.PREFILL: (1, chunk, chunk), Call.VERIFY: (1, k + 1, k + 1)}


def captured_calls(profiles: Mapping[str, Sequence[Profile]]) -> tuple[str, ...]:
    """The CAPTURED_CALLS an engine of these graph profiles has (an engine without MTP has no draft cycle)."""
    names = {profile.name for graph_profiles in profiles.values() for profile in graph_profiles}
    return tuple(name for name in CAPTURED_CALLS if name in names)


def captured_buckets(profiles: Sequence[Profile], names: Sequence[str], inputs: Sequence[TensorSpec]) -> list[Bucket]:
    """The buckets of a graph's profiles named in `names` (engine.json's `cuda_graphs`), each also at the powers of
    two below k + 1 positions (`.s{seq}`), without the pools' dimensions (pools are passed in place at any size).
    Empty when the graph has none of those profiles.

    Fewer positions matter at width: a draft cycle over the 1 or 2 positions a verify committed, padded to k + 1,
    runs its MoE on padded positions too, which route to experts of their own (the slice: a draft cycle 1.6x as
    long; benchmarks/RESULTS.md)."""
    out = []
    for bucket in graph_buckets([profile for profile in profiles if profile.name in names], inputs):
        dims = {n: v for n, v in bucket.dims.items() if not n.startswith("pool_")}
        out += [Bucket(f"{bucket.name}.s{seq}", dims | {"seq": seq}) for seq in powers_of_two(1, dims["seq"])]
    return out


__all__ = ["CAPTURED_CALLS", "Call", "captured_buckets", "captured_calls", "target_calls"]
