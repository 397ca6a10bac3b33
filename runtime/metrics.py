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
