"""Optimization profiles: the input shape ranges a shape-specialized engine (TensorRT, MIGraphX) was built for.

The builder decides them from the calls the scheduler makes (builder/backends/profiles.py) and records them in
engine.json (the backend's compile record, contract/backends.py), in the engine's own order; the runtime picks, for
each call, the tightest profile covering its input shapes."""
from __future__ import annotations

import math
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import V4EngineError
from .untrusted import JsonFields

Shape = tuple[int, ...]
MAX_DIM = (1 << 31) - 1          # the largest dimension a recorded profile may name
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")        # a profile's name, as the builder gives them (prefill, verify, ...)


class ProfileError(V4EngineError):
    """A call's shapes lie outside every optimization profile the engine was built with."""


@dataclass(frozen=True)
class Profile:
    """(min, opt, max) shape of every dynamic input, for one kind of engine call."""

    name: str
    shapes: dict[str, tuple[Shape, Shape, Shape]]

    @classmethod
    def read(cls, fields: JsonFields, inputs: Collection[str]) -> "Profile":
        """A profile as engine.json records it (untrusted): its name, and for inputs of its graph, three shapes
        (min, opt, max) of one rank in integers from 0 to MAX_DIM: what `covers` may index and compare."""
        title = fields.get("name", str)
        if not NAME.fullmatch(title):       # it names files: a MIGraphX engine's programs, `{graph}.{bucket}.mxr`
            fields.fail("name", "must be a word of letters, digits, '_' or '-'", title)
        shapes = fields.nested("shapes")
        ranges = {}
        for name, value in shapes.raw.items():
            if name not in inputs or not _is_range(value):
                shapes.fail(name, "must be the (min, opt, max) shapes of an input of the graph", value)
            ranges[name] = tuple(tuple(shape) for shape in value)
        return cls(title, ranges)

    def covers(self, shapes: dict[str, Shape]) -> bool:
        """Whether every input listed here has a shape inside this profile's [min, max] box."""
        return all(len(shapes[n]) == len(lo) and all(a <= d <= b for a, d, b in zip(lo, shapes[n], hi))
                   for n, (lo, _, hi) in self.shapes.items())

    def volume(self) -> int:
        return sum(math.prod(hi) for _, _, hi in self.shapes.values())


def merged_profile(profiles: Sequence[Profile], name: str, opt_from: str | None = None) -> Profile:
    """One profile covering all of `profiles` (every input's smallest min and largest max), its opt shapes those of
    the profile named `opt_from` (default: the first): a refittable TensorRT engine takes a single profile."""
    source = next((p for p in profiles if p.name == opt_from), profiles[0])
    shapes = {}
    for input_name in source.shapes:
        ranges = [p.shapes[input_name] for p in profiles if input_name in p.shapes]
        lo = tuple(min(r[0][i] for r in ranges) for i in range(len(ranges[0][0])))
        hi = tuple(max(r[2][i] for r in ranges) for i in range(len(ranges[0][0])))
        shapes[input_name] = (lo, source.shapes[input_name][1], hi)
    return Profile(name, shapes)


def choose_profile(profiles: Sequence[Profile], shapes: dict[str, Shape]) -> int:
    """Index of the tightest profile covering `shapes`; ProfileError naming the call when none does."""
    covering = [i for i, p in enumerate(profiles) if p.covers(shapes)]
    if not covering:
        ranges = "; ".join(f"{p.name}: " + ", ".join(f"{n} {lo}..{hi}" for n, (lo, _, hi) in p.shapes.items()
                                                         if n in ("input_ids",)) for p in profiles)
        raise ProfileError(f"no optimization profile covers input_ids {shapes.get('input_ids')} ({ranges})")
    return min(covering, key=lambda i: profiles[i].volume())


def _is_range(value: Any) -> bool:
    return (isinstance(value, list) and len(value) == 3
            and all(isinstance(shape, list) and len(shape) == len(value[0]) for shape in value)
            and all(type(d) is int and 0 <= d <= MAX_DIM for shape in value for d in shape))


__all__ = ["Profile", "ProfileError", "choose_profile", "merged_profile"]
