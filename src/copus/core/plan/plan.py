"""ParallelPlan: a data × tensor × pipeline layout plus micro-batching, and its enumeration.

Vocabulary: design.md §2. `global_batch_size = dp · micro_batch_size · num_microbatches`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from copus.core.plan.layout_names import layout_name
from copus.core.specs.models import ModelShape


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelPlan:
    """Degrees of data, tensor and pipeline parallelism and the micro-batching of one step."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int

    def __post_init__(self) -> None:
        for field in ("dp", "tp", "pp", "micro_batch_size", "num_microbatches"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}={value!r} is invalid; allowed: an integer >= 1")

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
                f"global_batch_size={global_batch_size} is not a multiple of "
                f"dp*micro_batch_size={per_step}"
            )
        return ParallelPlan(dp=self.dp, tp=self.tp, pp=self.pp, micro_batch_size=mbs,
                            num_microbatches=global_batch_size // per_step)

    def describe(self) -> str:
        """`dp2.tp1.pp2 mb8x1 (B=16)`: the canonical spelling (core/plan/layout_names.py)."""
        return (f"{layout_name(self.dp, self.tp, self.pp, self.micro_batch_size, self.num_microbatches)}"
                f" (B={self.global_batch_size})")

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


def plan_problems(plan: ParallelPlan, world_size: int | None = None,
                  shape: ModelShape | None = None) -> list[str]:
    """Every reason `plan` cannot run on `world_size` ranks with model `shape` (empty if valid).

    Rules: dp·tp·pp = world; tp divides heads, KV heads, ffn_dim and dim (column/row sharding);
    pp ≤ layers (each stage owns ≥ 1 block); num_microbatches ≥ pp (a pipeline schedule needs at
    least one micro-batch per stage, torch.distributed.pipelining raises otherwise).
    """
    out: list[str] = []
    if world_size is not None and plan.world_size != world_size:
        out.append(f"dp*tp*pp={plan.dp}*{plan.tp}*{plan.pp}={plan.world_size} "
                   f"must equal the world size {world_size}")
    if plan.pp > 1 and plan.num_microbatches < plan.pp:
        out.append(f"num_microbatches={plan.num_microbatches} must be >= pp={plan.pp}")
    if shape is not None:
        for what, n in (("n_heads", shape.n_heads), ("n_kv_heads", shape.n_kv_heads),
                        ("ffn_dim", shape.ffn_dim), ("dim", shape.dim)):
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


def enumerate_plans(world_size: int, global_batch_sizes: Iterable[int],
                    micro_batch_sizes: Iterable[int],
                    shape: ModelShape | None = None) -> Iterator[ParallelPlan]:
    """Every valid plan: each layout × each global batch × each micro-batch that divides it."""
    batches = sorted(set(global_batch_sizes))
    mbss = sorted(set(micro_batch_sizes))
    for dp, tp, pp in layouts(world_size, shape):
        for gbs in batches:
            for mbs in mbss:
                if gbs % (dp * mbs):
                    continue
                plan = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs,
                                    num_microbatches=gbs // (dp * mbs))
                if not plan_problems(plan, world_size, shape):
                    yield plan
