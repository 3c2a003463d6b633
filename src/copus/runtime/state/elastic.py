"""The plan a resumed run trains with when the world size changed (issue 10, item 3).

torchrun's elastic range (`--nnodes MIN:MAX`) restarts the workers with a new WORLD_SIZE when a
host dies or joins; they resume from the latest checkpoint of the same run (`Trainer.same_run`).
`resume_plan` decides the plan for the new world: the checkpoint's own when it still runs there,
else `core.replan.replan` over the new world's candidates. Torch-free; the trainer applies it.

- goodput policy: the controller's own candidates (built for the new world, memory-pruned), its
  step-time model (refitted to the steps measured before the restart) and the restored noise
  scale × calibration (COPUS §1.2);
- other policies: every plan of the new world at the checkpoint's batch (range widened to it),
  micro-batches up to max(the checkpoint's, 4), priced by the analytic prior of the run's
  hardware (`setup.run_hardware`); these policies change only the batch from then on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from copus.config import Config
from copus.core.cost.fit import prior_model
from copus.core.plan.goodput import CandidateSet, StepTimePredictor, build_candidates
from copus.core.specs.hardware import HardwareProfile
from copus.core.specs.models import ModelShape
from copus.core.plan.plan import ParallelPlan, default_micro_batch_size, plan_problems
from copus.core.plan.records import Decision, decision_kind
from copus.core.plan.replan import FixedDegrees, replan


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplanInputs:
    """What `core.replan.replan` ranks with."""

    candidates: CandidateSet
    model: StepTimePredictor
    b_noise: float  # calibrated; inf = unknown
    model_name: str
    lr_aware: bool = True
    lr_ref_batch: float | None = None


def fixed_degrees(cfg: Config) -> FixedDegrees:
    p = cfg.parallel
    return FixedDegrees(dp=p.dp, tp=p.tp, pp=p.pp, micro_batch_size=p.micro_batch_size)


def replan_inputs(
    cfg: Config,
    policy: Any,
    b_noise: float,
    saved: ParallelPlan,
    world: int,
    shape: ModelShape,
    hardware: HardwareProfile | None,
) -> ReplanInputs:
    """The goodput controller's candidates and model, else every plan at the saved batch."""
    if hasattr(policy, "candidates") and hasattr(policy, "model"):  # core.controller
        opts = getattr(policy, "search_options", {})
        fitted = getattr(getattr(policy, "fitter", None), "num_fits", 0) > 0
        return ReplanInputs(
            candidates=policy.candidates,
            model=policy.model,
            b_noise=policy.calibration * b_noise,
            model_name=f"goodput controller's {'fitted' if fitted else 'prior'} step-time",
            lr_aware=opts.get("lr_aware", True),
            lr_ref_batch=opts.get("lr_ref_batch"),
        )
    B, mbs = saved.global_batch_size, cfg.parallel.micro_batch_size
    sizes = [mbs] if mbs else list(range(1, max(saved.micro_batch_size, 4) + 1))
    cands = build_candidates(
        world, shape, min_batch=min(B, cfg.batch.min), max_batch=max(B, cfg.batch.max), micro_batch_sizes=sizes
    )
    return ReplanInputs(
        candidates=cands, model=prior_model(shape, hardware, world), b_noise=math.inf, model_name="analytic step-time"
    )


def configured_plan(
    cfg: Config, initial: ParallelPlan, global_batch_size: int, world: int, shape: ModelShape
) -> ParallelPlan:
    """The configured layout (`initial`, from setup.initial_plan) at `global_batch_size` when
    it divides, with parallel.micro_batch_size or the default; else `initial` as it is."""
    per = initial.dp
    if global_batch_size % per:
        return initial
    mbs = cfg.parallel.micro_batch_size or default_micro_batch_size(global_batch_size // per, initial.pp)
    if (global_batch_size // per) % mbs:
        return initial
    plan = initial.with_batch(global_batch_size, mbs)
    return initial if plan_problems(plan, world, shape) else plan


def resume_plan(
    cfg: Config,
    *,
    saved: ParallelPlan,
    saved_world: int,
    world: int,
    shape: ModelShape,
    policy: Any,
    b_noise: float,
    initial: ParallelPlan,
    hardware: HardwareProfile | None = None,
    step: int = 0,
) -> Decision | None:
    """None: the checkpoint's plan `saved` runs on `world` ranks and keeps the fixed dp/tp/pp.
    Otherwise the plan for this world as a Decision whose reason starts "world size changed
    from X to Y" (or names the problem of the checkpoint's plan); when no candidate respects
    the fixed [parallel] keys, the configured plan `initial` at the saved batch if possible."""
    fixed = fixed_degrees(cfg)
    problems = plan_problems(saved, world, shape)
    if not problems and fixed.admits(saved, layout_only=True):
        return None
    if saved_world and saved_world != world:
        why = f"world size changed from {saved_world} to {world}"
    else:
        why = (
            f"checkpoint plan {saved.describe()} does not fit: "
            f"{problems[0] if problems else '[parallel] ' + fixed.describe()}"
        )
    inp = replan_inputs(cfg, policy, b_noise, saved, world, shape, hardware)
    decision = replan(
        inp.candidates,
        inp.model,
        saved=saved,
        why=why,
        fixed=fixed,
        b_noise=inp.b_noise,
        lr_aware=inp.lr_aware,
        lr_ref_batch=inp.lr_ref_batch,
        model_name=inp.model_name,
        step=step,
    )
    if decision is not None:
        return decision
    plan = configured_plan(cfg, initial, saved.global_batch_size, world, shape)
    return Decision(
        kind=decision_kind(saved, plan),
        plan=plan,
        step=step,
        reason=f"{why}: no candidate respects {fixed.describe()}; configured plan {plan.describe()}",
    )
