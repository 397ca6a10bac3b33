"""Pipeline stages: the target's layers split into consecutive graphs, one per device (docs/parallelism.md §0).

A model too large for one GPU (V4-Flash's 148.6 GiB against an H200's ~140 GiB; V4-Pro's ~865 GB) runs as N stage
graphs on N devices. Stage i holds layers [start, stop): the first also the embedding, the last also the final
hc_head, norm and LM head, and beside it the MTP draft graph (which reads the embedding and head again). Every
stage takes the call's `input_ids` and `positions` (hash routing and rope need them in every layer) and the pools of
its own layers' cache groups; a stage after the first takes the previous stage's output streams as `hidden_in`; every
stage returns its streams as `hidden` (the last stage's are the pre-head streams the draft reads) and its layers'
new rows. One stage is the plain `target` graph.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import V4EngineError

TARGET = "target"
MAX_GPU = 1023                  # the largest GPU number accepted (a device id, not a count)


@dataclass(frozen=True)
class Stage:
    """Stage `index` of `count`, running the target layers `layers` (consecutive, never empty)."""

    index: int
    count: int
    layers: range

    @property
    def graph(self) -> str:
        """Its graph's name in engine.json: `target` for a single stage, else `target.{index}`."""
        return TARGET if self.count == 1 else f"{TARGET}.{self.index}"

    @property
    def first(self) -> bool:
        """Whether it embeds the tokens (else it takes the previous stage's streams)."""
        return self.index == 0

    @property
    def last(self) -> bool:
        """Whether it ends with the LM head (and has the draft graph beside it)."""
        return self.index == self.count - 1


def stages_of(bounds: list[int]) -> list[Stage]:
    """The stages whose layers run from bounds[i] to bounds[i + 1] (bounds[0] = 0, bounds[-1] = the layer count)."""
    count = len(bounds) - 1
    return [Stage(i, count, range(bounds[i], bounds[i + 1])) for i in range(count)]


def single_stage(layers: int) -> list[Stage]:
    """The one stage of an engine that is not split."""
    return stages_of([0, layers])


def gpu_list(text: str, flag: str) -> list[int]:
    """A command line's comma-separated GPU numbers ("0,1"), or V4EngineError naming the flag."""
    try:
        return [int(gpu) for gpu in text.split(",")]
    except ValueError:
        raise V4EngineError(f"{flag} must be comma-separated GPU numbers (got {text!r})") from None


def check_devices(devices: Sequence[object], stages: int, source: str, error: type[Exception]) -> list[int]:
    """`devices` as one GPU number per pipeline stage of the engine at `source`; `error`, in one line, otherwise."""
    devices = list(devices)
    if len(devices) != stages or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_GPU
                                         for d in devices):
        raise error(f"devices: {source} has {stages} pipeline stage(s), which need {stages} GPU number(s) from 0 "
                    f"to {MAX_GPU}, one per stage (got {devices!r:.100})")
    return devices


__all__ = ["MAX_GPU", "Stage", "TARGET", "check_devices", "gpu_list", "single_stage", "stages_of"]
