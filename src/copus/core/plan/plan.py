"""ParallelPlan: a data × tensor × pipeline layout plus micro-batching, and its enumeration.

Vocabulary: design.md §2. `global_batch_size = dp · micro_batch_size · num_microbatches`.

Besides the degrees and the micro-batching a plan carries how each rank runs its share
(issue 25; defaults = copus's runtime as it was, so a plan built without them is unchanged):
- `activation_checkpointing`: "none", "selective" (torchtitan's op policy: save the outputs of
  the matmuls except every second one and of attention, recompute the rest) or "full" (keep each
  block's input, recompute the block in the backward);
- `pipeline_schedule`: "1f1b", "gpipe" or "interleaved-1f1b" with `virtual_stages` ≥ 2 chunks
  per rank (Narayanan et al. SC'21 §2.2);
- `sequence_parallel`: with tp > 1, activations outside the matmuls split over the tp ranks
  along the sequence (Korthikanti et al. 2022 §4.2.2);
- `reshard_after_forward`: FSDP2 frees each block's gathered parameters after its forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from copus.core.plan.layout_names import layout_name
from copus.core.specs.models import ModelShape


AC_MODES = ("none", "selective", "full")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    """`value` if it is one of `allowed`, else ValueError naming both (one line)."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid; allowed: {', '.join(allowed)}")
    return value


def option_codes(value, default: str, allowed: tuple[str, ...], name: str) -> np.ndarray:
    """Index into `allowed` of a mode name, or an int array of such indices (vectorised plans)."""
    if value is None:
        value = default
    if isinstance(value, str):
        return np.asarray(allowed.index(check_choice(name, value, allowed)))
    codes = np.asarray(value)
    if codes.size and (codes.min() < 0 or codes.max() >= len(allowed)):
        raise ValueError(f"{name} codes must be in 0..{len(allowed) - 1} ({', '.join(allowed)})")
    return codes


def ac_mode_name(value: bool | str) -> str:
    """False/True (the old flag) → "none"/"full"; a mode name is checked against AC_MODES."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return check_choice("activation_checkpointing", value, AC_MODES)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelPlan:
    """Degrees of data, tensor and pipeline parallelism and the micro-batching of one step."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    activation_checkpointing: str = "none"
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        for field in ("dp", "tp", "pp", "micro_batch_size", "num_microbatches", "virtual_stages"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}={value!r} is invalid; allowed: an integer >= 1")
        check_choice("activation_checkpointing", self.activation_checkpointing, AC_MODES)
        check_choice("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        interleaved = self.pipeline_schedule == "interleaved-1f1b"
        if interleaved != (self.virtual_stages > 1):
            raise ValueError(
                f"virtual_stages={self.virtual_stages} is invalid with pipeline_schedule="
                f"{self.pipeline_schedule!r}; allowed: >= 2 with interleaved-1f1b, else 1"
            )

    @property
    def options(self) -> dict:
        """The per-rank execution choices (everything but the degrees and micro-batching)."""
        return {
            "activation_checkpointing": self.activation_checkpointing,
            "pipeline_schedule": self.pipeline_schedule,
            "virtual_stages": self.virtual_stages,
            "sequence_parallel": self.sequence_parallel,
            "reshard_after_forward": self.reshard_after_forward,
        }

    def options_suffix(self) -> str:
        """' ac=full pp=interleaved-1f1b/v2 sp no-reshard': the non-default options ('' if none)."""
        parts = []
        if self.activation_checkpointing != "none":
            parts.append(f"ac={self.activation_checkpointing}")
        if self.pipeline_schedule != "1f1b":
            v = f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp={self.pipeline_schedule}{v}")
        if self.sequence_parallel:
            parts.append("sp")
        if not self.reshard_after_forward:
            parts.append("no-reshard")
        return "".join(" " + p for p in parts)

    def with_options(self, **options) -> ParallelPlan:
        """The same plan with other execution choices (`options` keys)."""
        return replace(self, **options)

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.micro_batch_size * self.num_microbatches

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def layout(self) -> tuple[int, int, int]:
        """(dp, tp, pp): what a parallelism change changes."""
        return (self.dp, self.tp, self.pp)

    def with_batch(self, global_batch_size: int, micro_batch_size: int | None = None) -> ParallelPlan:
        """The same layout with a new global batch (ValueError if dp·micro_batch does not divide it)."""
        mbs = self.micro_batch_size if micro_batch_size is None else micro_batch_size
        per_step = self.dp * mbs
        if global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of dp*micro_batch_size={per_step}"
            )
        return replace(self, micro_batch_size=mbs, num_microbatches=global_batch_size // per_step)

    def describe(self) -> str:
        """`dp2.tp1.pp2 mb8x1 (B=16)`: the canonical spelling (core/plan/layout_names.py)."""
        return (
            f"{layout_name(self.dp, self.tp, self.pp, self.micro_batch_size, self.num_microbatches)}"
            f"{self.options_suffix()}"
            f" (B={self.global_batch_size})"
        )

    def validate(self, world_size: int | None = None, shape: ModelShape | None = None) -> None:
        """Raise ValueError naming the first bad value; see `plan_problems` for the rules."""
        problems = plan_problems(self, world_size, shape)
        if problems:
            raise ValueError(f"invalid plan {self.describe()}: {problems[0]}")


def default_micro_batch_size(per_dp: int, pp: int, cap: int = 4) -> int:
    """Largest divisor of the per-dp-rank batch that is ≤ `cap` and leaves ≥ pp micro-batches."""
    best = 1
    for m in range(1, min(cap, per_dp) + 1):
        if per_dp % m == 0 and per_dp // m >= pp:
            best = m
    return best


def plan_problems(plan: ParallelPlan, world_size: int | None = None, shape: ModelShape | None = None) -> list[str]:
    """Every reason `plan` cannot run on `world_size` ranks with model `shape` (empty if valid).

    Rules: dp·tp·pp = world; tp divides heads, KV heads, ffn_dim and dim (column/row sharding);
    pp ≤ layers (each stage owns ≥ 1 block); num_microbatches ≥ pp (a pipeline schedule needs at
    least one micro-batch per stage, torch.distributed.pipelining raises otherwise). Interleaved
    1F1B: pp > 1, pp·v ≤ layers and num_microbatches a multiple of pp (Megatron-LM's rule);
    sequence parallel needs tp > 1.
    """
    out: list[str] = []
    if world_size is not None and plan.world_size != world_size:
        out.append(f"dp*tp*pp={plan.dp}*{plan.tp}*{plan.pp}={plan.world_size} must equal the world size {world_size}")
    if plan.pp > 1 and plan.num_microbatches < plan.pp:
        out.append(f"num_microbatches={plan.num_microbatches} must be >= pp={plan.pp}")
    if plan.pipeline_schedule == "interleaved-1f1b":
        if plan.pp < 2:
            out.append(f"pipeline_schedule='interleaved-1f1b' needs pp >= 2, got pp={plan.pp}")
        elif plan.num_microbatches % plan.pp:
            out.append(
                f"num_microbatches={plan.num_microbatches} must be a multiple of pp={plan.pp} with interleaved-1f1b"
            )
    if plan.sequence_parallel and plan.tp < 2:
        out.append(f"sequence_parallel needs tp >= 2, got tp={plan.tp}")
    if shape is not None:
        if plan.virtual_stages > 1 and plan.pp * plan.virtual_stages > shape.n_layers:
            out.append(
                f"pp*virtual_stages={plan.pp * plan.virtual_stages} must be <= n_layers="
                f"{shape.n_layers} of model {shape.name!r}"
            )
        for what, n in (
            ("n_heads", shape.n_heads),
            ("n_kv_heads", shape.n_kv_heads),
            ("ffn_dim", shape.ffn_dim),
            ("dim", shape.dim),
        ):
            if n % plan.tp:
                out.append(f"tp={plan.tp} must divide {what}={n} of model {shape.name!r}")
        if plan.pp > shape.n_layers:
            out.append(f"pp={plan.pp} must be <= n_layers={shape.n_layers} of model {shape.name!r}")
    return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(world_size: int, shape: ModelShape | None = None) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp·tp·pp = world_size that the model shape admits."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is invalid; allowed: an integer >= 1")
    out = []
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            probe = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=1, num_microbatches=pp)
            if not plan_problems(probe, world_size, shape):
                out.append((dp, tp, pp))
    return out


def enumerate_plans(
    world_size: int,
    global_batch_sizes: Iterable[int],
    micro_batch_sizes: Iterable[int],
    shape: ModelShape | None = None,
) -> Iterator[ParallelPlan]:
    """Every valid plan: each layout × each global batch × each micro-batch that divides it."""
    batches = sorted(set(global_batch_sizes))
    mbss = sorted(set(micro_batch_sizes))
    for dp, tp, pp in layouts(world_size, shape):
        for gbs in batches:
            for mbs in mbss:
                if gbs % (dp * mbs):
                    continue
                plan = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=gbs // (dp * mbs))
                if not plan_problems(plan, world_size, shape):
                    yield plan
