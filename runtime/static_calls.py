"""Calls padded into static shapes: the bucket a call fits (contract/buckets.py) made real, for MIGraphX's programs
and CUDA graphs (contract/calls.py).

A call is padded up to the smallest bucket covering it and its outputs are cut back to its own shape:
- rows past the call's batch repeat its last row (the graphs never write the pools, so a repeated row only reads);
- positions past a row's tokens continue its positions with token 0 and zero streams, as the scheduler already
  pads a batch whose rows have fewer tokens than the longest: the graphs are causal (and the draft reads each
  row's `lengths`), so later positions change nothing before them;
- a block table is widened with each row's last block (rows read there are masked by position).
Each bucket's call is bound once to buffers of its shape (`StaticCalls`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from v4engine.contract.buckets import Bucket, call_dims, choose_bucket
from v4engine.contract.layout import CacheLayout, TensorSpec
from v4engine.contract.profiles import ProfileError

from .pool_arrays import to_numpy, to_torch

FILLED = {"input_ids": 0}                # what pads a row's positions past its tokens (positions: counted on)


def padded(torch: Any, name: str, value: Any, spec: TensorSpec, bucket: Bucket) -> Any:
    """The torch tensor `value` of input `spec` padded up to its shape in `bucket` (see the module doc)."""
    for axis, dim in enumerate(spec.shape):
        extra = bucket.dims[dim] - value.shape[axis] if isinstance(dim, str) else 0
        if extra <= 0:
            continue
        if dim == "seq" and name == "positions":
            last = value.narrow(axis, value.shape[axis] - 1, 1)
            tail = last + torch.arange(1, extra + 1, dtype=value.dtype, device=value.device)
        elif dim == "seq":
            tail = torch.full((*value.shape[:axis], extra, *value.shape[axis + 1:]), FILLED.get(name, 0),
                              dtype=value.dtype, device=value.device)
        elif value.shape[axis] == 0:        # a block table of rows without blocks: block 0, masked by position
            tail = torch.zeros((*value.shape[:axis], extra, *value.shape[axis + 1:]), dtype=value.dtype,
                               device=value.device)
        else:                               # batch rows, block-table columns: the last one again
            tail = value.narrow(axis, value.shape[axis] - 1, 1).repeat_interleave(extra, dim=axis)
        value = torch.cat([value, tail], dim=axis)
    return value


def cut(value: Any, spec: TensorSpec, dims: Mapping[str, int]) -> Any:
    """An output of a padded call cut back to the call's own `dims` (a view)."""
    for axis, dim in enumerate(spec.shape):
        if isinstance(dim, str) and value.shape[axis] != dims[dim]:
            value = value.narrow(axis, 0, dims[dim])
    return value


# --------------------------------------------------------------------------- calls bound to static buffers
POOL_PREFIX = "pool."                    # inputs passed in place (the pools), never copied into static buffers

# (bucket, a number no earlier binding had, static inputs (pools included, holding the call's values), static
# outputs) -> what runs the bound call (ONNX Runtime keys its CUDA graphs by that number and cannot record one
# again under the same)
Bind = Callable[[Bucket, int, dict[str, Any], dict[str, Any]], Callable[[], None]]


@dataclass
class StaticCall:
    """One bucket's bound call: its buffers (alive as long as the binding) and what runs it."""

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    pools: tuple[tuple[int, tuple[int, ...]], ...]      # the pools' addresses and shapes it was bound to
    replay: Callable[[], None] | None = None


class StaticCalls:
    """The calls of one graph that fit one of its buckets, each bucket's call bound once to buffers of its shape.

    `bind` makes a bucket's call over the buffers it is given, holding the call's values, and returns what runs it
    (a CUDA graph recorded then and replayed, a MIGraphX program given their addresses). `on_device(name)`:
    whether output `name` stays a torch tensor (new rows); the others come back as numpy arrays."""

    def __init__(self, torch: Any, device: Any, buckets: Sequence[Bucket], inputs: Sequence[TensorSpec],
                 outputs: Sequence[TensorSpec], layout: CacheLayout, bind: Bind,
                 on_device: Callable[[str], bool]):
        self._torch, self._device, self._buckets = torch, device, list(buckets)
        self._inputs, self._outputs, self._layout = tuple(inputs), tuple(outputs), layout
        self._bind, self._on_device = bind, on_device
        self._calls: dict[str, StaticCall] = {}
        self._output_buffers: dict[tuple, dict[str, Any]] = {}     # by the outputs' shapes
        self.bindings = 0                    # calls bound so far (each bucket once, again if its pools moved)

    def bucket_for(self, feeds: Mapping[str, Any]) -> Bucket | None:
        """The bucket this call pads up to, or None: no bucket covers it (a longer prefill or extend chunk)."""
        try:
            return choose_bucket(self._buckets, call_dims(feeds, self._inputs))
        except ProfileError:
            return None

    def bound(self) -> list[str]:
        """The buckets bound so far, by name."""
        return list(self._calls)

    def run(self, feeds: Mapping[str, Any], bucket: Bucket) -> dict[str, Any]:
        """The call, padded into `bucket`'s buffers, run (bound first if need be), and its outputs cut back to its
        own shape and copied out."""
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
        if call.replay is None:              # bound on this call's own values (a backend may run them once)
            call.replay = self._bind(bucket, self.bindings, call.inputs, call.outputs)
            self.bindings += 1
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


__all__ = ["padded", "cut", "Bind", "StaticCall", "StaticCalls"]
