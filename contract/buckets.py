"""Static shapes: the buckets a MIGraphX engine holds one program each for (and CUDA graphs are recorded for,
contract/calls.py, their pools left at any size).

MIGraphX's releases (up to ROCm 7.2) compile a graph whose inputs have more than one dynamic dimension only
behind a development option, and run a program whose outputs live in the caller's memory (offload_copy off: what
keeps the pools on the device) only at static shapes. So a MIGraphX engine holds one program per bucket: every
dynamic dimension of an optimization profile fixed at one value.
- `batch` and `blocks` (the block table's width) at the powers of two up to the profile's maximum, and the maximum;
- `seq` at the profile's maximum (a prefill chunk, or the k + 1 tokens of a verify);
- the pools (`pool_slots`, `pool_blocks`) at the profile's maximum: the runtime allocates them at exactly those
  sizes (`EngineSession.pool_shape`), and they are never padded.
A call is padded up to the smallest bucket covering it (runtime/static_calls.py says how).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .layout import TensorSpec
from .profiles import Profile, ProfileError

POWERS_OF_TWO = ("batch", "blocks")      # dimensions bucketed at powers of two; the others at their maximum


@dataclass(frozen=True)
class Bucket:
    """One program's static shape: a value for every dynamic dimension of its graph's inputs."""

    name: str
    dims: dict[str, int]

    def shape(self, spec: TensorSpec, more: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """`spec`'s shape in this bucket (`more`: dimensions the inputs do not name, e.g. an output's rows)."""
        dims = self.dims | dict(more or {})
        return tuple(d if isinstance(d, int) else dims[d] for d in spec.shape)

    def covers(self, dims: Mapping[str, int]) -> bool:
        """Whether a call of these dimensions pads up to this bucket (pools only at their exact size)."""
        return all(dims[n] <= v if n in ("batch", "seq", "blocks") else dims[n] == v
                   for n, v in self.dims.items() if n in dims)


def dim_ranges(profile: Profile, inputs: Sequence[TensorSpec]) -> dict[str, tuple[int, int]]:
    """(min, max) of every dynamic dimension of the profile, by name; ValueError when an input with a dynamic
    dimension is missing from the profile or of another rank there, or two inputs disagree on a dimension."""
    ranges: dict[str, tuple[int, int]] = {}
    for spec in inputs:
        if all(isinstance(d, int) for d in spec.shape):
            continue
        if spec.name not in profile.shapes or len(profile.shapes[spec.name][0]) != len(spec.shape):
            raise ValueError(f"input {spec.name} of rank {len(spec.shape)} is not in profile {profile.name} at "
                             "that rank")
        lo, _, hi = profile.shapes[spec.name]
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, str):
                if ranges.setdefault(dim, (lo[axis], hi[axis])) != (lo[axis], hi[axis]):
                    raise ValueError(f"dimension {dim} has two ranges, {ranges[dim]} and {(lo[axis], hi[axis])}")
    return ranges


def powers_of_two(lo: int, hi: int) -> list[int]:
    """The powers of two from lo up to (not including) hi, then hi: the values a dimension is bucketed at."""
    return [1 << i for i in range(hi.bit_length()) if lo <= 1 << i < hi] + [hi]


def _values(name: str, lo: int, hi: int) -> list[int]:
    return powers_of_two(lo, hi) if name in POWERS_OF_TWO else [hi]


def profile_buckets(profile: Profile, inputs: Sequence[TensorSpec]) -> list[Bucket]:
    """The profile's buckets, smallest first: named `{profile}.b{batch}` (and `.t{blocks}` where a block table is)."""
    ranges = dim_ranges(profile, inputs)
    out = [{}]
    for name, (lo, hi) in ranges.items():
        out = [dims | {name: v} for dims in out for v in _values(name, lo, hi)]
    def named(dims: dict[str, int]) -> Bucket:
        return Bucket(f"{profile.name}.b{dims.get('batch', 1)}" + (f".t{dims['blocks']}" if "blocks" in dims else ""),
                      dims)

    return [named(dims) for dims in out]


def graph_buckets(profiles: Iterable[Profile], inputs: Sequence[TensorSpec]) -> list[Bucket]:
    """Every bucket of a graph's profiles, in the profiles' order: the order of its programs in engine.json."""
    return [bucket for profile in profiles for bucket in profile_buckets(profile, inputs)]


def call_dims(feeds: Mapping[str, Any], inputs: Sequence[TensorSpec]) -> dict[str, int]:
    """The value of every dynamic dimension in a call's feeds."""
    return {dim: int(feeds[spec.name].shape[axis]) for spec in inputs
            for axis, dim in enumerate(spec.shape) if isinstance(dim, str)}


def choose_bucket(buckets: Sequence[Bucket], dims: Mapping[str, int]) -> Bucket:
    """The smallest bucket a call of these dimensions pads up to; ProfileError naming the call when none does."""
    covering = [b for b in buckets if b.covers(dims)]
    if not covering:
        raise ProfileError(f"no program of this engine takes a call of {dict(dims)} (its buckets: "
                           f"{', '.join(b.name for b in buckets)}; its pools must be of "
                           f"{ {n: v for n, v in buckets[0].dims.items() if n.startswith('pool')} })")
    return min(covering, key=lambda b: (b.dims.get("seq", 0), b.dims.get("batch", 0), b.dims.get("blocks", 0)))


__all__ = ["Bucket", "powers_of_two", "profile_buckets", "graph_buckets", "call_dims", "choose_bucket", "dim_ranges"]
