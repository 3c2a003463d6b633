"""Branches from one training state: the measured critical batch (Merrill et al. 2025, §3.1).

Every rank calls the same functions on a `Trainer` (runtime/train/trainer.py) in the same processes:

1. `stage(trainer)` copies the state a branch may change — model and AdamW tensors (copied off
   the device, `host_stage.py`: pinned host memory on CUDA, a file on CPU; the same layout, so
   no resharding and no DCP round trip; restored in place), progress (the global
   sample offset), GNS EMAs, LR-rule state, plan and RNG states.
2. `run_branch(trainer, staged, spec)` restores that state, sets the plan of batch `k·B`
   (same (dp, tp, pp); `branch_plan`), applies the run's LR rule to the new batch
   (`LearningRate.on_batch_change`: √k for "sqrt"), and trains `spec.num_samples` samples
   starting at the global sample offset `spec.offset`, exactly as the trainer would (the same
   sampler, the same per-step GNS updates). At evenly spaced sample marks shared by every branch
   it evaluates the loss on the same validation windows (`fixed_eval_rows`, under the staged
   plan's micro-batching so every branch is scored by the same computation).
3. The caller reads off the critical batch and the B_noise fit (`core/stats/critical_batch.py`) and
   either restores the staged state again (`copus calibrate`) or keeps a branch (`probe.py`).

Restoring and re-running a branch is bit-identical (test_calibrate): nothing random is left
outside the staged state.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from copus.core.stats.critical_batch import smoothed_final
from copus.core.plan.plan import ParallelPlan, plan_problems
from copus.core.plan.records import StepRecord
from copus.runtime.state import checkpoint as ckpt
from copus.runtime.train.host_stage import TensorStage

SampleHook = Callable[[np.ndarray], None]


# ------------------------------------------------------------------------------------ plans


def branch_plan(base: ParallelPlan, batch: float, world: int, shape) -> ParallelPlan:
    """The plan of global batch `batch` on `base`'s layout: micro_batch_size = the largest
    divisor of batch/dp not above the base's (memory stays bounded). ValueError when no plan
    of this layout runs that batch (not an integer, not a multiple of dp, invalid plan)."""
    if not (batch > 0 and float(batch).is_integer()):
        raise ValueError(f"global batch {batch:g}: allowed: a positive integer (k·B)")
    b = int(batch)
    if b % base.dp:
        raise ValueError(f"global batch {b}: allowed: a multiple of dp={base.dp}")
    per_rank = b // base.dp
    mbs = max(d for d in range(1, min(base.micro_batch_size, per_rank) + 1) if per_rank % d == 0)
    plan = ParallelPlan(dp=base.dp, tp=base.tp, pp=base.pp, micro_batch_size=mbs, num_microbatches=per_rank // mbs)
    problems = plan_problems(plan, world, shape)
    if problems:
        raise ValueError(f"global batch {b} on {base.describe()}: {problems[0]}")
    return plan


def branch_samples(batches: Sequence[int], tokens: int, seq_len: int) -> int:
    """Samples every branch trains on: tokens/seq_len rounded up to a multiple of every batch
    (each branch takes a whole number of steps over the same samples)."""
    if tokens <= 0:
        raise ValueError(f"--tokens={tokens}: allowed: an integer > 0")
    step = math.lcm(*(int(b) for b in batches))
    samples = -(-tokens // seq_len)
    return -(-samples // step) * step


def mark_samples(num_samples: int, batches: Sequence[int], num_marks: int) -> list[int]:
    """Up to `num_marks` evaluation points (sample counts) at step boundaries of every branch;
    the last is `num_samples`."""
    step = math.lcm(*(int(b) for b in batches))
    units = num_samples // step
    n = max(1, min(num_marks, units))
    return sorted({round(units * (i + 1) / n) * step for i in range(n)})


# ------------------------------------------------------------------------------------ state


@dataclass(slots=True, kw_only=True)
class StagedState:
    """What a branch can change, copied from the trainer (this rank's shards): the tensors off
    the device (`host_stage.TensorStage`), the rest as Python data."""

    tensors: TensorStage
    progress: dict
    gns: dict
    lr: dict
    plan: ParallelPlan
    rng: dict

    def close(self) -> None:
        """Free the staged tensors now."""
        self.tensors.close()


def stage(trainer) -> StagedState:
    """Copy the trainer's branchable state (see module docstring). StageError (one line, before
    anything changes) when the copy does not fit where it is staged."""
    from dataclasses import asdict

    return StagedState(
        tensors=TensorStage(trainer.engine, trainer.run_dir, trainer.plan.describe()),
        progress=asdict(trainer.progress),
        gns=copy.deepcopy(trainer.gns.state_dict()),
        lr=copy.deepcopy(trainer.lr.state_dict()),
        plan=trainer.plan,
        rng=ckpt.rng_state(),
    )


def restore(trainer, staged: StagedState) -> None:
    """Put the staged state back (the engine keeps its layout; the plan's batch may differ)."""
    from copus.runtime.train.progress import Progress

    trainer.engine.set_plan(staged.plan)
    trainer.plan = staged.plan
    reshard(trainer.engine)
    staged.tensors.restore(trainer.engine)
    trainer.progress = Progress(**staged.progress)
    trainer.gns.load_state_dict(copy.deepcopy(staged.gns))
    trainer.lr.load_state_dict(copy.deepcopy(staged.lr))
    ckpt.set_rng_state(staged.rng)


# ------------------------------------------------------------------------------------ branches


@dataclass(frozen=True, slots=True, kw_only=True)
class BranchSpec:
    """One branch: multiplier `k` of the staged batch, repeat index, samples [offset, offset+n)."""

    multiplier: float
    global_batch_size: int
    repeat: int
    offset: int
    num_samples: int


@dataclass(slots=True, kw_only=True)
class BranchResult:
    spec: BranchSpec
    lr_factor: float
    steps: int
    tokens: int
    mark_tokens: list[int]
    val_losses: list[float]  # at the marks, same windows for every branch
    smoothed_loss: float  # EMA(α = 0.5) of val_losses, last value (L_k)
    train_loss_ema: float  # EMA(α = 0.5) of the per-step training loss, last value
    seconds: float  # training + evaluation wall time (slowest rank)
    records: list[StepRecord] = field(default_factory=list)

    def to_dict(self) -> dict:
        s = self.spec
        return {
            "multiplier": s.multiplier,
            "global_batch_size": s.global_batch_size,
            "repeat": s.repeat,
            "offset": s.offset,
            "num_samples": s.num_samples,
            "lr_factor": self.lr_factor,
            "steps": self.steps,
            "tokens": self.tokens,
            "mark_tokens": self.mark_tokens,
            "val_losses": self.val_losses,
            "smoothed_loss": self.smoothed_loss,
            "train_loss_ema": self.train_loss_ema,
            "seconds": self.seconds,
        }


def fixed_eval_rows(trainer) -> int:
    """Validation rows per dp rank under the staged plan (the same windows for every branch)."""
    return trainer.eval_rows()


def eval_loss(trainer, base: ParallelPlan, rows: int) -> float:
    """Loss on the first dp·rows validation windows, computed under `base`'s micro-batching."""
    if rows <= 0:
        return math.nan
    current = trainer.plan
    trainer.engine.set_plan(base)
    dp = base.dp
    local = np.arange(rows * dp).reshape(dp, rows)[trainer.engine.dp_rank]
    tokens = torch.from_numpy(trainer.val_set.batch(local).astype(np.int64)).to(trainer.device)
    loss = float(trainer.engine.eval_loss(tokens))
    trainer.engine.set_plan(current)
    reshard(trainer.engine)
    return loss


def reshard(engine) -> None:
    """Free the parameters an evaluation left gathered (FSDP2 with reshard_after_forward=False
    keeps them unsharded after a forward without backward); `set_state_dict` maps the optimizer
    state by the sharded parameters and fails otherwise."""
    from torch.distributed.fsdp import FSDPModule

    for module in engine.model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def train_one_step(trainer, plan: ParallelPlan, on_samples: SampleHook | None = None) -> StepRecord:
    """One optimizer step at `plan` from the trainer's sample offset: `Trainer.step_once`
    (same sampler, slice, LR and GNS update as the run's steps), written nowhere: a branch step."""
    assert trainer.plan == plan, (trainer.plan, plan)
    hook = None if on_samples is None else (lambda global_ids, _local: on_samples(global_ids))
    record, _grad_norm = trainer.step_once(hook)
    return record


def run_branch(
    trainer,
    staged: StagedState,
    spec: BranchSpec,
    *,
    marks: Sequence[int],
    eval_rows: int,
    on_samples: SampleHook | None = None,
) -> BranchResult:
    """Restore `staged`, train `spec` (see module docstring); the trainer is left in the
    branch's final state. `marks`: sample counts (from the branch start) to evaluate at."""
    from copus.runtime.engine.dist import max_over_ranks

    t0 = time.perf_counter()
    restore(trainer, staged)
    plan = branch_plan(staged.plan, spec.global_batch_size, trainer.world, trainer.shape)
    trainer.engine.set_plan(plan)
    trainer.plan = plan
    if plan.global_batch_size != staged.plan.global_batch_size:
        trainer.lr.on_batch_change(
            plan.global_batch_size,
            step=trainer.progress.step,
            grad_sqnorm=trainer.gns.grad_sqnorm,
            grad_trace_cov=trainer.gns.grad_trace_cov,
        )
    trainer.progress.samples = spec.offset  # repeats > 0 train on later, disjoint samples
    records: list[StepRecord] = []
    vals: list[float] = []
    done = 0
    for mark in marks:
        while done < mark:
            records.append(train_one_step(trainer, plan, on_samples))
            done += plan.global_batch_size
        vals.append(eval_loss(trainer, staged.plan, eval_rows))
    seconds = max_over_ranks(time.perf_counter() - t0, trainer.device)
    seq = trainer.shape.seq_len
    return BranchResult(
        spec=spec,
        lr_factor=trainer.lr.factor,
        steps=len(records),
        tokens=done * seq,
        mark_tokens=[m * seq for m in marks],
        val_losses=vals,
        smoothed_loss=smoothed_final(vals) if vals else math.nan,
        train_loss_ema=smoothed_final([r.loss for r in records]) if records else math.nan,
        seconds=seconds,
        records=records,
    )


# ------------------------------------------------------------------------------------ calibration


def load_checkpoint_state(trainer, path) -> dict:
    """Load checkpoint `path` into `trainer` under its saved plan (tensors resharded by DCP),
    with progress, GNS and LR state as saved; returns its trainer state. The RNG state comes
    back at the same world size (as `Trainer.resume`)."""
    import json
    from pathlib import Path

    from copus.runtime.train.progress import Progress, plan_from_dict

    path = Path(path)
    state = json.loads((path / ckpt.TRAINER_STATE).read_text())
    trainer.progress = Progress(**state["progress"])
    trainer.gns.load_state_dict(state["gns"])
    trainer.lr.load_state_dict(state["lr"])
    trainer.engine_for(plan_from_dict(state["plan"]))
    tensors = trainer.dcp_state()
    ckpt.load(path, tensors, check=False)
    trainer.engine.load_state(tensors["model"], tensors["optim"])
    if state.get("world_size") == trainer.world:
        ckpt.set_rng_state(state["rng"])
    return state


def calibrate_state(
    trainer,
    *,
    multipliers: Sequence[float],
    tokens: int,
    repeats: int = 2,
    epsilon: float | None = None,
    num_marks: int = 4,
    on_samples: SampleHook | None = None,
    keep_results: bool = False,
) -> dict:
    """Branch the trainer's current state at k·B for each multiplier, `repeats` times on
    disjoint sample windows (repeat 0 on the run's own next samples), and summarise
    (`core.critical_batch.summarize_branches`). The trainer is restored to the staged state
    afterwards. Returns JSON-ready data; with `keep_results` also the BranchResults."""
    from copus.core.stats.critical_batch import summarize_branches

    if repeats < 1:
        raise ValueError(f"--repeats={repeats}: allowed: an integer >= 1")
    if repeats < 2 and epsilon is None:
        raise ValueError("--repeats=1 measures no noise floor: allowed: --repeats >= 2 or an explicit --epsilon")
    t0 = time.perf_counter()
    staged = stage(trainer)
    base = staged.plan.global_batch_size
    batches = [
        int(branch_plan(staged.plan, k * base, trainer.world, trainer.shape).global_batch_size) for k in multipliers
    ]
    n = branch_samples(batches, tokens, trainer.shape.seq_len)
    marks = mark_samples(n, batches, num_marks)
    rows = fixed_eval_rows(trainer)
    start_loss = eval_loss(trainer, staged.plan, rows)
    b_noise_online = float(trainer.gns.b_noise)
    results: list[BranchResult] = []
    for r in range(repeats):
        for k, b in zip(multipliers, batches):
            spec = BranchSpec(
                multiplier=float(k),
                global_batch_size=b,
                repeat=r,
                offset=staged.progress["samples"] + r * n,
                num_samples=n,
            )
            results.append(run_branch(trainer, staged, spec, marks=marks, eval_rows=rows, on_samples=on_samples))
    restore(trainer, staged)
    staged.close()
    losses: dict[float, list[float]] = {}
    for res in results:
        losses.setdefault(float(res.spec.global_batch_size), []).append(res.smoothed_loss)
    summary = summarize_branches(
        base_batch=float(base), losses=losses, start_loss=start_loss, b_noise_online=b_noise_online, epsilon=epsilon
    )
    seq = trainer.shape.seq_len
    out = {
        "step": staged.progress["step"],
        "tokens": staged.progress["tokens"],
        "samples": staged.progress["samples"],
        "plan": staged.plan.describe(),
        "branch_tokens": n * seq,
        "eval_windows": rows * staged.plan.dp,
        "branches": [res.to_dict() for res in results],
        **summary,
        "cost": {"tokens": sum(res.tokens for res in results), "seconds": time.perf_counter() - t0},
    }
    if keep_results:
        out["results"] = results
    return out


REQUEST = "request.json"
