"""Fixed batch-size schedules: a function of data consumed (samples or tokens) → global batch.

Linear ramp: Megatron-LM's `--rampup-batch-size` / GPT-3 (32k tokens → 3.2M over the first
4–12B tokens). Stepwise ramp: Nemotron-4 / Llama 3 style stages (Lau et al. 2025 §2 related work).
Values are rounded *down* to a multiple of `multiple` (dp·micro_batch_size), never below one
multiple, so a ramp never overshoots its target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULE_KINDS = ("constant", "linear", "stepwise")
SCHEDULE_UNITS = ("samples", "tokens")


def round_down(value: float, multiple: int) -> int:
    """Largest multiple of `multiple` that is ≤ value, but at least `multiple`."""
    return max(multiple, math.floor(value / multiple + 1e-9) * multiple)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchSchedule:
    """Global batch as a function of data consumed.

    kind "constant": `start` always. "linear": start + (end − start)·min(1, x/duration).
    "stepwise": `num_steps` equal increments, each after another duration/num_steps units:
    start + (end − start)·min(num_steps, ⌊x·num_steps/duration⌋)/num_steps (end once x ≥ duration).
    `unit` says whether x counts samples or tokens; `at(samples, tokens)` picks it.
    """

    kind: str = "constant"
    start: int
    end: int | None = None
    duration: float = 0.0
    num_steps: int = 4
    unit: str = "samples"
    multiple: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"ramp_kind={self.kind!r} is invalid; allowed: "
                             f"{', '.join(SCHEDULE_KINDS)}")
        if self.unit not in SCHEDULE_UNITS:
            raise ValueError(f"unit={self.unit!r} is invalid; allowed: {', '.join(SCHEDULE_UNITS)}")
        if self.start < 1:
            raise ValueError(f"start={self.start!r} is invalid; allowed: an integer >= 1")
        if self.multiple < 1:
            raise ValueError(f"multiple={self.multiple!r} is invalid; allowed: an integer >= 1")
        if self.kind != "constant":
            if self.end is None or self.end < self.start:
                raise ValueError(f"ramp_to={self.end!r} is invalid; allowed: >= start={self.start}")
            if not self.duration > 0:
                raise ValueError(f"ramp duration={self.duration!r} is invalid; allowed: > 0")
        if self.kind == "stepwise" and self.num_steps < 1:
            raise ValueError(f"ramp_steps={self.num_steps!r} is invalid; allowed: >= 1")

    def fraction(self, consumed: float) -> float:
        """How far along the ramp (0..1) after `consumed` units."""
        if self.kind == "constant":
            return 0.0
        x = min(max(consumed / self.duration, 0.0), 1.0)
        if self.kind == "stepwise":
            return min(self.num_steps, math.floor(x * self.num_steps + 1e-12)) / self.num_steps
        return x

    def unrounded(self, consumed: float) -> float:
        end = self.start if self.end is None else self.end
        return self.start + (end - self.start) * self.fraction(consumed)

    def __call__(self, consumed: float) -> int:
        """Global batch after `consumed` samples or tokens, rounded down to `multiple`."""
        return round_down(self.unrounded(consumed), self.multiple)

    def at(self, samples: float, tokens: float) -> int:
        return self(samples if self.unit == "samples" else tokens)


def constant(batch: int, *, multiple: int = 1) -> BatchSchedule:
    return BatchSchedule(kind="constant", start=batch, multiple=multiple)


def linear_ramp(start: int, end: int, duration: float, *, unit: str = "samples",
                multiple: int = 1) -> BatchSchedule:
    return BatchSchedule(kind="linear", start=start, end=end, duration=duration, unit=unit,
                         multiple=multiple)


def stepwise_ramp(start: int, end: int, duration: float, num_steps: int, *,
                  unit: str = "samples", multiple: int = 1) -> BatchSchedule:
    return BatchSchedule(kind="stepwise", start=start, end=end, duration=duration,
                         num_steps=num_steps, unit=unit, multiple=multiple)
