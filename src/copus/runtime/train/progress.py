"""Where a run is (`Progress`), a plan as the JSON a checkpoint stores, and the error that ends
a run (`TrainingError`): what the trainer and its parts (step, checkpointing), the branch probes
and `copus calibrate` share without importing the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

from copus.core.plan.plan import ParallelPlan


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite steps)."""


@dataclass(slots=True, kw_only=True)
class Progress:
    """Where the run is. `samples` is also the global sample offset of the next step."""

    step: int = 0
    samples: int = 0
    tokens: int = 0
    num_skipped: int = 0
    nonfinite_streak: int = 0
    train_s: float = 0.0


def plan_to_dict(plan: ParallelPlan) -> dict:
    return {
        "dp": plan.dp,
        "tp": plan.tp,
        "pp": plan.pp,
        "micro_batch_size": plan.micro_batch_size,
        "num_microbatches": plan.num_microbatches,
    }


def plan_from_dict(d: dict) -> ParallelPlan:
    return ParallelPlan(**{k: int(d[k]) for k in ("dp", "tp", "pp", "micro_batch_size", "num_microbatches")})
