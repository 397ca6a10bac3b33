"""Every engine call the scheduler and its drafter make goes through one `EngineCalls`: counted, and timed by kind.

The count is the scheduler's `engine_steps` (the Triton model exports it); `on_call`, when set, is told each call's
kind (contract/calls.py `Call`), its input_ids shape and its seconds: how benchmarks take per-call costs apart.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from v4engine.contract.calls import Call

from .sessions import EngineSession

OnCall = Callable[[Call, tuple[int, ...], float], None]


class EngineCalls:
    def __init__(self) -> None:
        self.steps = 0
        self.on_call: OnCall | None = None

    def run(self, session: EngineSession, feeds: dict[str, np.ndarray], kind: Call
            ) -> tuple[dict[str, np.ndarray], float]:
        """(the session's outputs for `feeds`, the call's seconds)."""
        started = time.perf_counter()
        out = session.run(feeds)
        seconds = time.perf_counter() - started
        self.steps += 1
        if self.on_call is not None:
            self.on_call(kind, feeds["positions"].shape, seconds)
        return out, seconds


def apart_by_length(lengths: Sequence[int], short: int) -> list[list[int]]:
    """The rows of one step cut into calls (their indices): those of at most `short` positions (verifies, draft
    cycles) apart from longer ones (prefill chunks, a draft cycle's catch-up after a prompt). In one call every
    short row would be padded to the longest: at batch 8 a 128-token chunk beside seven verifies of 6 positions
    costs as much as eight chunks, where two calls cost one chunk and one verify. Empty groups are left out."""
    groups = [[i for i, n in enumerate(lengths) if n <= short], [i for i, n in enumerate(lengths) if n > short]]
    return [g for g in groups if g]


__all__ = ["EngineCalls", "OnCall", "apart_by_length"]
