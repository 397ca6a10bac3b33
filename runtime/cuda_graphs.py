"""CUDA graphs: an engine's per-token calls, a verify and a draft cycle, each replayed as one launch.

On a GPU a decode step of a small batch is hundreds of small kernels, and launching them one by one from the host
costs more than running them. A CUDA graph records one call's launches once and replays them with one launch. It
replays exactly what it recorded: the same kernels on the same addresses at the same shapes. So:
- the calls of the engine's `verify` and `cycle` profiles (CAPTURED_CALLS) are padded to buckets of static shapes
  (runtime/buckets.py, as MIGraphX's programs are): batch and block-table width at powers of two, sequence at
  k + 1. Calls no bucket covers (prefill and extend chunks longer than k + 1: once per prompt, not per token) run
  as before;
- every other input lives in a buffer of the bucket's shape that is allocated once (`StaticCall.inputs`); a call
  copies its own (padded) values into them, and the first call of a bucket records it on those values;
- the cache pools are passed in place, at whatever size the scheduler gave them: a call whose pools are not those
  its bucket was recorded on (moved, or grown) is recorded again on them;
- the outputs are written into buffers of their shape (shared by the buckets that differ only in block-table
  width: they are replayed one at a time); a call gets its rows cut back and copied out, so the next replay can
  write the same buffers.
The graphs the engine holds for this have no control flow (v4build --cuda-graphs: Sinkhorn's rounds unrolled,
the draft's conditionals dropped), which ONNX Runtime requires and TensorRT's recording of an enqueue needs.

The recording itself is the backend's (`Capture`): ONNX Runtime's CUDA provider records an IOBinding's run under
a graph id of its own after a warm-up run (`enable_cuda_graph`); TensorRT's enqueue is recorded by torch.cuda.graph.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .buckets import Bucket, call_dims, choose_bucket, cut, graph_buckets, padded
from .layout import CacheLayout, TensorSpec
from .pool_arrays import to_numpy, to_torch
from .profiles import Profile, ProfileError

CAPTURED_CALLS = ("verify", "cycle")     # the profiles whose calls run as CUDA graphs: one per generated token
POOL_PREFIX = "pool."                    # inputs passed in place (the pools), never copied into static buffers

# (bucket, a number no earlier recording had, static inputs (pools included, holding the call's values), static
# outputs) -> replay, which runs the recorded call (ONNX Runtime keys its graphs by that number and cannot record
# one again under the same)
Capture = Callable[[Bucket, int, dict[str, Any], dict[str, Any]], Callable[[], None]]


@dataclass
class StaticCall:
    """One bucket's recorded call: its buffers (alive as long as the recording) and how to replay it."""

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    pools: tuple[int, ...]               # the pools' addresses and sizes it was recorded on
    replay: Callable[[], None] | None = None


def captured_calls(profiles: Mapping[str, Sequence[Profile]]) -> tuple[str, ...]:
    """The CAPTURED_CALLS an engine of these graph profiles has (an engine without MTP has no draft cycle)."""
    names = {profile.name for graph_profiles in profiles.values() for profile in graph_profiles}
    return tuple(name for name in CAPTURED_CALLS if name in names)


def captured_buckets(profiles: Sequence[Profile], names: Sequence[str], inputs: Sequence[TensorSpec]) -> list[Bucket]:
    """The buckets of a graph's profiles named in `names` (engine.json's `cuda_graphs`), without the pools'
    dimensions: pools are passed in place at any size. Empty when the graph has none of those profiles."""
    return [Bucket(b.name, {n: v for n, v in b.dims.items() if not n.startswith("pool_")})
            for b in graph_buckets([profile for profile in profiles if profile.name in names], inputs)]


class CapturedCalls:
    """The calls of one graph that fit a bucket of its captured profiles, run through recorded CUDA graphs.

    `capture` records one bucket's call on the buffers it is given. `on_device(name)`: whether output `name` stays a
    torch tensor (new rows); the others come back as numpy arrays."""

    def __init__(self, torch: Any, device: Any, buckets: Sequence[Bucket], inputs: Sequence[TensorSpec],
                 outputs: Sequence[TensorSpec], layout: CacheLayout, capture: Capture,
                 on_device: Callable[[str], bool]):
        self._torch, self._device, self._buckets = torch, device, list(buckets)
        self._inputs, self._outputs, self._layout = tuple(inputs), tuple(outputs), layout
        self._capture, self._on_device = capture, on_device
        self._calls: dict[str, StaticCall] = {}
        self._output_buffers: dict[tuple, dict[str, Any]] = {}     # by the outputs' shapes
        self.recordings = 0                  # calls recorded so far (each bucket once, again if its pools moved)

    def bucket_for(self, feeds: Mapping[str, Any]) -> Bucket | None:
        """The bucket this call pads up to, or None: it runs unrecorded (a longer prefill or extend chunk)."""
        try:
            return choose_bucket(self._buckets, call_dims(feeds, self._inputs))
        except ProfileError:
            return None

    def recorded(self) -> list[str]:
        """The buckets recorded so far, by name."""
        return list(self._calls)

    def run(self, feeds: Mapping[str, Any], bucket: Bucket) -> dict[str, Any]:
        """The call, padded into `bucket`'s buffers, replayed (recorded first if need be), and its outputs cut back
        to its own shape and copied out."""
        torch = self._torch
        pools = tuple((feeds[s.name].data_ptr(), tuple(feeds[s.name].shape)) for s in self._inputs
                      if s.name.startswith(POOL_PREFIX))
        call = self._calls.get(bucket.name)
        if call is None or call.pools != pools:
            call = self._calls[bucket.name] = self._buffers(feeds, bucket, pools)
        for spec in self._inputs:
            if not spec.name.startswith(POOL_PREFIX):
                value = feeds[spec.name]
                tensor = to_torch(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
                call.inputs[spec.name].copy_(padded(torch, spec.name, tensor.to(self._device), spec, bucket))
        if call.replay is None:              # recorded on this call's own values (a backend may run them once)
            call.replay = self._capture(bucket, self.recordings, call.inputs, call.outputs)
            self.recordings += 1
        call.replay()
        dims = call_dims(feeds, self._inputs)
        real = dims | self._layout.emitted(dims["seq"])
        out = {}
        for spec in self._outputs:
            value = cut(call.outputs[spec.name], spec, real).clone()       # the next replay writes the buffers
            out[spec.name] = value if self._on_device(spec.name) else to_numpy(value)
        return out

    def _buffers(self, feeds: Mapping[str, Any], bucket: Bucket, pools: tuple) -> StaticCall:
        """A bucket's buffers: its own inputs at the bucket's shape, the call's pools, outputs shared by shape."""
        torch = self._torch
        inputs = {spec.name: feeds[spec.name] if spec.name.startswith(POOL_PREFIX) else
                  torch.zeros(bucket.shape(spec), dtype=getattr(torch, spec.dtype), device=self._device)
                  for spec in self._inputs}
        more = self._layout.emitted(bucket.dims["seq"])
        shapes = tuple(bucket.shape(spec, more) for spec in self._outputs)
        if shapes not in self._output_buffers:
            self._output_buffers[shapes] = {spec.name: torch.empty(shape, dtype=getattr(torch, spec.dtype),
                                                                   device=self._device)
                                            for spec, shape in zip(self._outputs, shapes)}
        return StaticCall(inputs, self._output_buffers[shapes], pools)


__all__ = ["CAPTURED_CALLS", "Capture", "CapturedCalls", "StaticCall", "captured_buckets", "captured_calls"]
