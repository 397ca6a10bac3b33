"""CUDA graphs: an engine's per-token calls, a verify and a draft cycle, each replayed as one launch.

On a GPU a decode step of a small batch is hundreds of small kernels, and launching them one by one from the host
costs more than running them. A CUDA graph records one call's launches once and replays them with one launch. It
replays exactly what it recorded: the same kernels on the same addresses at the same shapes. So:
- the calls are padded to buckets of static shapes (runtime/buckets.py, as MIGraphX's programs are): the engine's
  `verify` and `cycle` profiles (CAPTURED_CALLS), batch and block-table width at powers of two; prefill and
  extend chunks (once per prompt, not per token) run as before;
- every input lives in a buffer of the bucket's shape that is allocated once (`StaticCall.inputs`); a call copies
  its own (padded) values into them and replays;
- the cache pools are passed in place, so the scheduler allocates them once at the profile's pool sizes
  (`EngineSession.pool_shape`); a call whose pools moved anyway is recorded again on their new addresses;
- the outputs are written into buffers of the bucket's shape; a call gets its rows cut back, copied out (the
  next replay writes the same buffers).
The graphs the engine holds for this have no control flow (v4build --cuda-graphs: Sinkhorn's rounds unrolled,
the draft's conditionals dropped), which ONNX Runtime requires and TensorRT's capture of an enqueue needs.

The recording itself is the backend's (`Capture`): ONNX Runtime's CUDA provider records on the first run of an
IOBinding under a graph id (`enable_cuda_graph`); TensorRT's enqueue is recorded by torch.cuda.graph.
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
POOL_PREFIX = "pool"                     # inputs passed in place (the pools), never copied into static buffers

# (bucket, a number no earlier recording had, static inputs (pools included), static outputs) -> replay, which runs
# the recorded call (ONNX Runtime keys its graphs by that number and cannot record one again under the same)
Capture = Callable[[Bucket, int, dict[str, Any], dict[str, Any]], Callable[[], None]]


@dataclass
class StaticCall:
    """One bucket's recorded call: its buffers (alive as long as the recording) and how to replay it."""

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    pools: tuple[int, ...]               # the pools' addresses it was recorded on
    replay: Callable[[], None]


def captured_buckets(profiles: Sequence[Profile], names: Sequence[str], inputs: Sequence[TensorSpec]) -> list[Bucket]:
    """The buckets of a graph's profiles whose calls the engine records (engine.json's `cuda_graphs` names them)."""
    return graph_buckets([profile for profile in profiles if profile.name in names], inputs)


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
        self.recordings = 0                  # calls recorded so far (each bucket once, again if its pools moved)

    @property
    def pool_shape(self) -> dict[str, int]:
        """The pool sizes every bucket was made for: the scheduler allocates the pools at exactly these."""
        return {n: v for n, v in self._buckets[0].dims.items() if n.startswith("pool_")}

    def bucket_for(self, feeds: Mapping[str, Any]) -> Bucket | None:
        """The bucket this call pads up to, or None: it runs uncaptured (a prefill chunk, pools of another size)."""
        try:
            return choose_bucket(self._buckets, call_dims(feeds, self._inputs))
        except ProfileError:
            return None

    def recorded(self) -> list[str]:
        """The buckets recorded so far, by name."""
        return list(self._calls)

    def run(self, feeds: Mapping[str, Any], bucket: Bucket) -> dict[str, Any]:
        """The call, padded into `bucket`'s buffers, replayed, and its outputs cut back to its own shape."""
        torch = self._torch
        pools = tuple(feeds[s.name].data_ptr() for s in self._inputs if s.name.startswith(POOL_PREFIX))
        call = self._calls.get(bucket.name)
        if call is None or call.pools != pools:
            call = self._calls[bucket.name] = self._record(feeds, bucket, pools)
        for spec in self._inputs:
            if not spec.name.startswith(POOL_PREFIX):
                value = feeds[spec.name]
                tensor = to_torch(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
                call.inputs[spec.name].copy_(padded(torch, spec.name, tensor.to(self._device), spec, bucket))
        call.replay()
        dims = call_dims(feeds, self._inputs)
        real = dims | self._layout.emitted(dims["seq"])
        out = {}
        for spec in self._outputs:
            value = cut(call.outputs[spec.name], spec, real)
            out[spec.name] = value.clone() if self._on_device(spec.name) else to_numpy(value)
        return out

    def _record(self, feeds: Mapping[str, Any], bucket: Bucket, pools: tuple[int, ...]) -> StaticCall:
        torch = self._torch
        inputs = {}
        for spec in self._inputs:
            if spec.name.startswith(POOL_PREFIX):
                inputs[spec.name] = feeds[spec.name]
            else:
                inputs[spec.name] = torch.zeros(bucket.shape(spec), dtype=getattr(torch, spec.dtype),
                                                device=self._device)
        more = self._layout.emitted(bucket.dims["seq"])
        outputs = {spec.name: torch.empty(bucket.shape(spec, more), dtype=getattr(torch, spec.dtype),
                                          device=self._device) for spec in self._outputs}
        replay = self._capture(bucket, self.recordings, inputs, outputs)
        self.recordings += 1
        return StaticCall(inputs, outputs, pools, replay)


__all__ = ["CAPTURED_CALLS", "Capture", "CapturedCalls", "StaticCall", "captured_buckets"]
