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
            raise ValueError(f"ramp_kind={self.kind!r} is invalid; allowed: {', '.join(SCHEDULE_KINDS)}")
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


def linear_ramp(start: int, end: int, duration: float, *, unit: str = "samples", multiple: int = 1) -> BatchSchedule:
    return BatchSchedule(kind="linear", start=start, end=end, duration=duration, unit=unit, multiple=multiple)


def stepwise_ramp(
    start: int, end: int, duration: float, num_steps: int, *, unit: str = "samples", multiple: int = 1
) -> BatchSchedule:
    return BatchSchedule(
        kind="stepwise", start=start, end=end, duration=duration, num_steps=num_steps, unit=unit, multiple=multiple
    )


# ------------------------------------------------------------------ token-denominated step schedules

STEP_SCHEDULE_UNITS = ("samples", "tokens")
_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def parse_tokens(text: str) -> float:
    """'250B' → 2.5e11: a token count with an optional K/M/B/T suffix (powers of 1000)."""
    t = text.strip().upper()
    unit = t[-1:] if t[-1:] in _SUFFIX and t[-1:] != "" else ""
    number = t[:-1] if unit else t
    try:
        value = float(number) * _SUFFIX[unit]
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"token count {text.strip()!r} is invalid; allowed: a number >= 0 with "
            "an optional K, M, B or T suffix (e.g. 250B)"
        )
    return value


@dataclass(frozen=True, slots=True)
class StepSchedule:
    """A token-denominated step schedule of the global batch (Megatron-LM's step schedule,
    Llama 3's 4M → 8M → 16M tokens, DeepSeek-V3's ramp): `entries` are (threshold tokens,
    global batch in samples), thresholds strictly increasing from 0, batches non-decreasing.

    The batch is a pure function of the tokens consumed, B(t) = batch of the last entry with
    threshold ≤ t, so a resumed run (any layout) lands on the same batch."""

    entries: tuple[tuple[float, int], ...]

    def __post_init__(self) -> None:
        if not self.entries or self.entries[0][0] != 0:
            raise ValueError(
                "batch.schedule is invalid: its first entry must start at 0 tokens; allowed: '0:B0,T1:B1,...'"
            )
        for (t0, b0), (t1, b1) in zip(self.entries, self.entries[1:]):
            if not t1 > t0:
                raise ValueError(
                    f"batch.schedule entry '{_fmt_tokens(t1)}:{b1}' is invalid: its "
                    f"threshold is not above the previous {_fmt_tokens(t0)}; allowed: "
                    "strictly increasing token thresholds"
                )
            if b1 < b0:
                raise ValueError(
                    f"batch.schedule entry '{_fmt_tokens(t1)}:{b1}' is invalid: the "
                    f"batch falls from {b0}; allowed: non-decreasing batches"
                )
        for t, b in self.entries:
            if not (isinstance(b, int) and b >= 1):
                raise ValueError(f"batch.schedule entry '{_fmt_tokens(t)}:{b}' is invalid; allowed: a batch >= 1")

    def __call__(self, tokens: float) -> int:
        """The global batch (samples) after `tokens` tokens."""
        batch = self.entries[0][1]
        for t, b in self.entries:
            if tokens >= t:
                batch = b
            else:
                break
        return batch

    def batches(self) -> tuple[int, ...]:
        return tuple(b for _, b in self.entries)

    def check_divisible(self, multiple: int, what: str = "dp*micro_batch_size") -> None:
        """Every batch must be a multiple of `multiple` (one-line error naming the entry)."""
        for t, b in self.entries:
            if b % multiple:
                raise ValueError(
                    f"batch.schedule entry '{_fmt_tokens(t)}:{b}' is invalid: {b} "
                    f"samples is not a multiple of {what}={multiple}; allowed: "
                    f"multiples of {multiple}"
                )

    def describe(self) -> str:
        return ",".join(f"{_fmt_tokens(t)}:{b}" for t, b in self.entries)


def _fmt_tokens(t: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if t >= scale:
            return f"{t / scale:.4g}{suffix}"
    return f"{t:.4g}"


def parse_step_schedule(text: str, *, unit: str = "samples", seq_len: int | None = None) -> StepSchedule:
    """'0:768,250B:1536,500B:3072' → `StepSchedule`. Thresholds are tokens (K/M/B/T suffixes);
    batch values are samples (sequences), or tokens with `unit="tokens"` (then each must be a
    multiple of `seq_len` and is divided by it). One-line ValueError naming the bad entry."""
    if unit not in STEP_SCHEDULE_UNITS:
        raise ValueError(f"batch.schedule_unit={unit!r} is invalid; allowed: {', '.join(STEP_SCHEDULE_UNITS)}")
    entries = []
    for raw in str(text).split(","):
        item = raw.strip()
        if not item:
            continue
        threshold, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"batch.schedule entry {item!r} is invalid; allowed: 'TOKENS:BATCH' (e.g. 250B:1536)")
        t = parse_tokens(threshold)
        try:
            batch = parse_tokens(value) if unit == "tokens" else float(value)
        except ValueError:
            batch = math.nan
        if not (math.isfinite(batch) and batch >= 1 and batch == int(batch)):
            raise ValueError(
                f"batch.schedule entry {item!r} is invalid: batch {value.strip()!r}; "
                f"allowed: a whole number of {unit} >= 1"
            )
        batch = int(batch)
        if unit == "tokens":
            if not seq_len or batch % seq_len:
                raise ValueError(
                    f"batch.schedule entry {item!r} is invalid: {batch} tokens is not "
                    f"a multiple of seq_len={seq_len}; allowed: whole sequences"
                )
            batch //= seq_len
        entries.append((t, batch))
    if not entries:
        raise ValueError(f"batch.schedule={text!r} is invalid; allowed: '0:B0,T1:B1,...' (e.g. 0:768,250B:1536)")
    return StepSchedule(tuple(entries))
