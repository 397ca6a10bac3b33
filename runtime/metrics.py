"""Acceptance and speed metrics, named as vLLM and TensorRT-LLM name them.

acceptance_rate = accepted / drafted; mean_acceptance_length = tokens per verify step including the bonus
token = (accepted + verify_steps) / verify_steps; per_position_acceptance[i] = share of verify steps whose
draft i+1 was accepted; mean_confidence[i] = the mean over verify steps of the drafter's confidence in draft i+1
(DSpark's confidence head, a sigmoid: its chance of surviving given the drafts before it survived), beside
per_position_acceptance / per_position_acceptance[i-1], which it estimates; empty for drafters without one.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    mtp: int
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    accepted_at: list[int] = field(default_factory=list)     # per draft position: verify steps that accepted it
    accepted_per_step: list[int] = field(default_factory=list)
    confidence_at: list[float] = field(default_factory=list)  # per draft position: the sum of its confidence
    confident_steps: list[int] = field(default_factory=list)  # per draft position: verify steps that gave one
    generated: int = 0
    time_to_first_token: float | None = None
    seconds: float = 0.0
    engine_seconds: float = 0.0
    prefix_hit_tokens: int = 0         # prompt positions taken from the prefix cache instead of computed
    preemptions: int = 0               # times its caches were freed for older requests (then recomputed)

    def __post_init__(self) -> None:
        self.accepted_at = self.accepted_at or [0] * self.mtp

    def record_verify(self, drafted: int, accepted: int, confidence: Sequence[float] | None = None) -> None:
        if confidence is not None:
            grow = len(confidence) - len(self.confidence_at)
            self.confidence_at += [0.0] * grow
            self.confident_steps += [0] * grow
            for i, c in enumerate(confidence):
                self.confidence_at[i] += float(c)
                self.confident_steps[i] += 1
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accepted_per_step.append(accepted)
        for i in range(accepted):
            self.accepted_at[i] += 1

    def merge(self, other: "RequestMetrics") -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.verify_steps += other.verify_steps
        self.accepted_per_step += other.accepted_per_step
        self.confidence_at = [a + b for a, b in itertools.zip_longest(self.confidence_at, other.confidence_at,
                                                                       fillvalue=0.0)]
        self.confident_steps = [a + b for a, b in itertools.zip_longest(self.confident_steps, other.confident_steps,
                                                                         fillvalue=0)]
        self.accepted_at = [a + b for a, b in itertools.zip_longest(self.accepted_at, other.accepted_at, fillvalue=0)]
        self.generated += other.generated
        self.seconds += other.seconds
        self.engine_seconds += other.engine_seconds
        self.prefix_hit_tokens += other.prefix_hit_tokens
        self.preemptions += other.preemptions

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.verify_steps if self.verify_steps else 0.0 for a in self.accepted_at]

    @property
    def mean_confidence(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.confidence_at, self.confident_steps)]

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "accepted_per_step": list(self.accepted_per_step),
                "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance": self.per_position_acceptance, "verify_steps": self.verify_steps,
                "mean_confidence": self.mean_confidence,
                "generated_tokens": self.generated, "time_to_first_token": self.time_to_first_token,
                "tokens_per_second": self.tokens_per_second, "engine_seconds": self.engine_seconds,
                "host_seconds": max(0.0, self.seconds - self.engine_seconds),
                "prefix_hit_tokens": self.prefix_hit_tokens, "preemptions": self.preemptions}

    def table(self) -> str:
        """A small acceptance table for people."""
        rows = [("drafted tokens", f"{self.drafted}"), ("accepted tokens", f"{self.accepted}"),
                ("acceptance rate", f"{self.acceptance_rate:.2f}"),
                ("mean acceptance length", f"{self.mean_acceptance_length:.2f}"),
                ("per-position acceptance", " / ".join(f"{a:.2f}" for a in self.per_position_acceptance) or "-"),
                *([("per-position confidence", " / ".join(f"{c:.2f}" for c in self.mean_confidence))]
                  if self.confidence_at else []),
                ("verify steps", f"{self.verify_steps}"), ("tokens/s", f"{self.tokens_per_second:.1f}")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# --------------------------------------------------------------------------- Prometheus series of a server
@dataclass(frozen=True)
class Series:
    """One Prometheus series a server exports (Triton's v4_generate model and v4serve export the same)."""

    name: str
    doc: str
    kind: str                                  # "counter", "gauge" or "histogram"
    buckets: tuple[float, ...] = ()
    per_position: bool = False                 # one series per draft position, label position="1".."k"


SERIES: dict[str, Series] = {
    "ttft": Series("v4_time_to_first_token_seconds", "Seconds from a request's arrival in the scheduler to its "
                   "first token", "histogram", (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)),
    "itl": Series("v4_inter_token_latency_seconds", "Seconds between two steps that give a request tokens (one "
                  "observation per step; a step gives 1..k+1 tokens with MTP)", "histogram",
                  (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)),
    "drafted": Series("v4_draft_tokens_total", "Tokens drafted (by the engine's drafter, or the request's)",
                      "counter"),
    "accepted": Series("v4_accepted_draft_tokens_total", "Drafted tokens the target accepted", "counter"),
    "verify_steps": Series("v4_verify_steps_total", "Verify steps (each accepts 0..k drafts)", "counter"),
    "accepted_at": Series("v4_accepted_at_position_total", "Verify steps that accepted the draft at this position",
                          "counter", per_position=True),
    # a drafter with a confidence head (DSpark): mean confidence = confidence_total / confidence_steps_total
    "confidence_at": Series("v4_draft_confidence_total", "The drafter's confidence in the draft at this position "
                            "(sigmoid of its confidence head), summed over verify steps", "counter", per_position=True),
    "confident_steps": Series("v4_draft_confidence_steps_total", "Verify steps whose draft at this position came "
                              "with a confidence", "counter", per_position=True),
    "generated": Series("v4_generated_tokens_total", "Tokens generated", "counter"),
    "prefix_hits": Series("v4_prefix_hit_tokens_total", "Prompt tokens taken from the prefix cache instead of "
                          "computed", "counter"),
    "engine_steps": Series("v4_engine_steps_total", "Engine calls (draft and verify)", "counter"),
    "waiting": Series("v4_queue_size", "Requests accepted and waiting for a batch slot", "gauge"),
    "running": Series("v4_running_requests", "Requests in the running batch", "gauge"),
    "pending": Series("v4_pending_requests", "Requests accepted and not finished (waiting + running)", "gauge"),
    "cache_bytes": Series("v4_cache_bytes", "Cache bytes the running requests hold", "gauge"),
}


def finished_counts(m: RequestMetrics) -> list[tuple[str, int | None, float]]:
    """(series key, draft position from 1 or None, increment) that a finished request adds to the counters."""
    counts: list[tuple[str, int | None, float]] = [
        ("drafted", None, m.drafted), ("accepted", None, m.accepted), ("verify_steps", None, m.verify_steps),
        ("generated", None, m.generated), ("prefix_hits", None, m.prefix_hit_tokens)]
    for key, values in (("accepted_at", m.accepted_at), ("confidence_at", m.confidence_at),
                        ("confident_steps", m.confident_steps)):
        counts += [(key, i + 1, value) for i, value in enumerate(values)]
    return counts
