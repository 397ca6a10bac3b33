"""Optimization profiles: the input shape ranges a shape-specialized engine (TensorRT) was built for.

The builder decides them from the calls the scheduler makes (builder/backends/profiles.py) and records them in
engine.json, in the engine's own order; the runtime picks, for each call, the tightest profile covering its
input shapes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .engine_folder import EngineFormatError
from .errors import V4EngineError

Shape = tuple[int, ...]


class ProfileError(V4EngineError):
    """A call's shapes lie outside every optimization profile the engine was built with."""


@dataclass(frozen=True)
class Profile:
    """(min, opt, max) shape of every dynamic input, for one kind of engine call."""

    name: str
    shapes: dict[str, tuple[Shape, Shape, Shape]]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        return cls(d["name"], {n: tuple(tuple(s) for s in r) for n, r in d["shapes"].items()})

    def covers(self, shapes: dict[str, Shape]) -> bool:
        """Whether every input listed here has a shape inside this profile's [min, max] box."""
        return all(len(shapes[n]) == len(lo) and all(a <= d <= b for a, d, b in zip(lo, shapes[n], hi))
                   for n, (lo, _, hi) in self.shapes.items())

    def volume(self) -> int:
        return sum(math.prod(hi) for _, _, hi in self.shapes.values())


def recorded_profiles(compiled: Any, graph: str, source: str) -> list[Profile]:
    """The profiles engine.json's build.compile records for `graph`, type-checked (engine.json is untrusted)."""
    try:
        profiles = [Profile.from_dict(p) for p in compiled["profiles"][graph]]
        if not profiles or not all(isinstance(p.name, str) and all(isinstance(d, int) for r in p.shapes.values()
                                                                    for s in r for d in s) for p in profiles):
            raise ValueError
    except (KeyError, TypeError, ValueError, AttributeError):
        raise EngineFormatError(f"{source}: field 'build.compile.profiles.{graph}' is missing or malformed") from None
    return profiles


def choose_profile(profiles: list[Profile], shapes: dict[str, Shape]) -> int:
    """Index of the tightest profile covering `shapes`; ProfileError naming the call when none does."""
    covering = [i for i, p in enumerate(profiles) if p.covers(shapes)]
    if not covering:
        ranges = "; ".join(f"{p.name}: " + ", ".join(f"{n} {lo}..{hi}" for n, (lo, _, hi) in p.shapes.items()
                                                         if n in ("input_ids",)) for p in profiles)
        raise ProfileError(f"no optimization profile covers input_ids {shapes.get('input_ids')} ({ranges})")
    return min(covering, key=lambda i: profiles[i].volume())


__all__ = ["Profile", "ProfileError", "choose_profile", "recorded_profiles"]
