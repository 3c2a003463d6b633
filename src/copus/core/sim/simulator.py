"""A training run on a simulated cluster, driven by the same policies as the real trainer.

A run is a sequence of optimizer steps (pure: numpy only, no torch). Each step:

1. **time** — the planner's step-time model (`copus.core.cost.throughput`, analytic hardware
   profile) predicts seconds per step for the current plan; a log-normal factor
   (`step_time_noise`) stands for measurement jitter.
2. **statistics** — the ground truth (`copus.core.sim.trajectory`) gives the loss, |G|² and tr(Σ);
   the raw two-batch inputs s̄ (per-micro-batch) and q (global batch) are drawn with the
   estimator's own sampling noise and fed to a real `core.gns.GnsEstimator`.
3. **progress** — effective samples grow by B·B_crit/(B_crit + B) (McCandlish et al. 2018),
   times 2x − x² under the sqrt-scaled-LR truth (`core.lr_progress`).
4. **decision** — a `StepRecord` goes to `policy.observe(record)`; a `Decision` is applied at
   the next step. A parallelism change ("reconfigure") adds its cost to wall time and is
   reported to the policy via `record_switch_cost(seconds)`.

Reconfiguration cost (`reconfig_cost_s`) follows COPUS Table 2: online resharding took 30–56 s
and checkpoint-restart 112–809 s for 3B–32B models; the model below is a fixed part plus state
bytes moved (16 B/parameter: bf16 weights and grads, fp32 master and two Adam moments).
No policy is implemented here: the simulator only builds records and applies decisions.
What to simulate (the scenario, the goodput variants, the policies built for it) is
`core.sim.scenario`; every policy side by side on one scenario is `core.sim.compare`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from copus.core.stats.gns_tracking import make_estimator
from copus.core.specs.models import ModelShape
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Decision, StepRecord
from copus.core.sim.trajectory import Trajectory, TrajectoryParams

RECONFIG_MODES = ("online", "restart")
STATE_BYTES_PER_PARAM = 16


class Policy(Protocol):
    def observe(self, record: StepRecord) -> Decision | None: ...


class StepTimePredictor(Protocol):
    def predict(self, dp, tp, pp, micro_batch_size, num_microbatches) -> np.ndarray: ...


SIM_ESTIMATOR = "ema"  # the simulated runs' noise-scale estimator (SimSettings.gns_estimator)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimSettings:
    """What the simulator needs besides the policy: the run, the noise and the switch costs."""

    target_losses: tuple[float, ...]
    token_budget: int
    trajectory: TrajectoryParams = field(default_factory=TrajectoryParams)
    seed: int = 0
    base_lr: float = 2e-4  # at `lr_ref_batch`, scaled by sqrt(B / lr_ref_batch)
    lr_ref_batch: int = 16
    step_time_noise: float = 0.03  # σ of the log-normal step-time jitter
    loss_noise: float = 0.01  # σ of the reported per-step loss (loss_noise_token = 0)
    # σ of the reported loss = loss_noise_token / sqrt(tokens per step): the per-step spread of
    # real runs (tiny CPU runs at B = 8, 16, 32: σ·sqrt(B·seq) = 2.08-2.10 nats;
    # docs/robust-goodput.md). 0: the constant `loss_noise`.
    loss_noise_token: float = 2.1
    reconfig_mode: str = "online"  # "online" (COPUS resharding) | "restart" (DCP restart)
    reconfig_cost_s: float | None = None  # override the cost model (seconds per switch)
    gns_decay: float = 0.95  # COPUS §3.2: 0.95 for the first 8M tokens, then 0.99
    gns_decay_late: float = 0.99
    gns_decay_switch_tokens: int = 8_000_000
    # the noise-scale estimator the controllers read: "ema" (COPUS §3.2, one EMA with the decays
    # above) or "tracking" (`copus train`'s default gns.estimator, core/stats/gns_tracking.py)
    gns_estimator: str = ""  # "" = SIM_ESTIMATOR
    stop_at_last_target: bool = True
    max_steps: int = 2_000_000
    keep_records: bool = False  # keep every StepRecord (replay tests, debugging)
    curve_points: int = 400  # (time, loss, batch) samples kept for plots

    def __post_init__(self) -> None:
        if not self.target_losses:
            raise ValueError("target_losses=() is invalid; allowed: at least one loss")
        if self.token_budget < 1:
            raise ValueError(f"token_budget={self.token_budget} is invalid; allowed: >= 1")
        if self.reconfig_mode not in RECONFIG_MODES:
            raise ValueError(f"reconfig_mode={self.reconfig_mode!r} is invalid; allowed: {', '.join(RECONFIG_MODES)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSpan:
    """A stretch of the run under one plan (the plan timeline)."""

    start_s: float
    start_step: int
    plan: ParallelPlan
    b_noise: float  # the estimate when the plan was chosen (NaN at start)
    true_b_noise: float  # the ground truth at that moment
    loss: float


@dataclass(slots=True, kw_only=True)
class SimResult:
    """One policy's simulated run."""

    name: str
    time_to_target_s: dict[float, float | None]
    timeline: list[PlanSpan]
    decisions: list[Decision]
    switch_costs_s: list[float]
    curve: list[tuple[float, float, int]]  # (wall s, true loss, global batch)
    num_steps: int
    tokens: int
    wall_s: float
    final_loss: float
    records: list[StepRecord] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "num_steps": self.num_steps,
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "final_loss": self.final_loss,
            "time_to_target_s": {str(k): v for k, v in self.time_to_target_s.items()},
            "switch_costs_s": self.switch_costs_s,
            "timeline": [
                {
                    "start_s": s.start_s,
                    "start_step": s.start_step,
                    "plan": s.plan.describe(),
                    "dp": s.plan.dp,
                    "tp": s.plan.tp,
                    "pp": s.plan.pp,
                    "micro_batch_size": s.plan.micro_batch_size,
                    "global_batch_size": s.plan.global_batch_size,
                    "b_noise": _num(s.b_noise),
                    "true_b_noise": _num(s.true_b_noise),
                    "loss": s.loss,
                }
                for s in self.timeline
            ],
            "decisions": [d.to_dict() | {"candidates": []} for d in self.decisions],
        }


def reconfig_cost_s(shape: ModelShape, world_size: int, mode: str = "online") -> float:
    """Seconds for one parallelism change, from the state moved (COPUS Table 2 magnitudes).

    online:  25 s + state/(world · 0.5 GB/s)   → 3B/8 GPUs ≈ 38 s, 32B/32 ≈ 58 s (paper 30–56 s)
    restart: 120 s + 2·state/1.6 GB/s (save + load) → 3B ≈ 184 s, 32B ≈ 776 s (paper 112–809 s)
    """
    state = STATE_BYTES_PER_PARAM * shape.num_params()
    if mode == "online":
        return 25.0 + state / (world_size * 0.5e9)
    if mode == "restart":
        return 120.0 + 2.0 * state / 1.6e9
    raise ValueError(f"reconfig_mode={mode!r} is invalid; allowed: {', '.join(RECONFIG_MODES)}")


class _StepTimes:
    """Predicted seconds per step, cached per plan (the model is called once per new plan)."""

    def __init__(self, model: StepTimePredictor) -> None:
        self.model = model
        self.cache: dict[ParallelPlan, float] = {}

    def __call__(self, plan: ParallelPlan) -> float:
        hit = self.cache.get(plan)
        if hit is None:
            out = self.model.predict(
                *(np.array([v]) for v in (plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches))
            )
            hit = float(np.asarray(out, dtype=float).reshape(-1)[0])
            if not (math.isfinite(hit) and hit > 0):
                raise ValueError(
                    f"plan {plan.describe()} has predicted step time {hit}; "
                    "allowed: a finite number > 0 (infeasible plan?)"
                )
            self.cache[plan] = hit
        return hit


def simulate(
    policy: Policy,
    initial_plan: ParallelPlan,
    shape: ModelShape,
    step_time_model: StepTimePredictor,
    settings: SimSettings,
    *,
    name: str = "",
    switch_cost_s: float | None = None,
    on_record: Callable[[StepRecord], None] | None = None,
) -> SimResult:
    """Run `policy` from `initial_plan` until every target loss is reached or the budget is spent.

    The noise streams depend only on `settings.seed` (common random numbers across policies).
    """
    traj = Trajectory(settings.trajectory, shape.seq_len)
    rng = np.random.default_rng(settings.seed)
    times = _StepTimes(step_time_model)
    cost = (
        switch_cost_s
        if switch_cost_s is not None
        else (
            settings.reconfig_cost_s
            if settings.reconfig_cost_s is not None
            else reconfig_cost_s(shape, initial_plan.world_size, settings.reconfig_mode)
        )
    )
    est = make_estimator(
        settings.gns_estimator or SIM_ESTIMATOR,
        ref_batch=float(initial_plan.global_batch_size),
        decay=settings.gns_decay,
        decay_late=settings.gns_decay_late,
        decay_switch_tokens=settings.gns_decay_switch_tokens,
    )
    targets = sorted(settings.target_losses, reverse=True)
    reached: dict[float, float | None] = dict.fromkeys(targets)
    plan, progress, samples, wall_s, step = initial_plan, 0.0, 0, 0.0, 0
    loss = traj.loss(0.0)
    timeline = [
        PlanSpan(start_s=0.0, start_step=0, plan=plan, b_noise=math.nan, true_b_noise=traj.b_noise(loss), loss=loss)
    ]
    decisions: list[Decision] = []
    switch_costs: list[float] = []
    records: list[StepRecord] = []
    curve: list[tuple[float, float, int]] = [(0.0, loss, plan.global_batch_size)]
    curve_every = max(1, _estimate_steps(traj, settings, initial_plan) // settings.curve_points)
    next_target = 0
    while samples * shape.seq_len < settings.token_budget and step < settings.max_steps:
        batch = plan.global_batch_size
        num_small = plan.dp * plan.num_microbatches
        step_s = times(plan) * math.exp(settings.step_time_noise * rng.standard_normal())
        small_sqnorm, big_sqnorm = traj.sample_grad_stats(rng, loss, batch, num_small)
        progress += traj.progress_per_step(batch, loss, samples * shape.seq_len)
        loss = traj.loss(progress)
        step += 1
        samples += batch
        wall_s += step_s
        tokens = samples * shape.seq_len
        while next_target < len(targets) and loss <= targets[next_target]:
            reached[targets[next_target]] = wall_s
            next_target += 1
        est.update(small_sqnorm, batch / num_small, big_sqnorm, batch, tokens)
        record = StepRecord(
            step=step,
            samples=samples,
            tokens=tokens,
            plan=plan,
            step_s=step_s,
            loss=loss + _loss_sigma(settings, batch, shape.seq_len) * rng.standard_normal(),
            lr=settings.base_lr * math.sqrt(batch / settings.lr_ref_batch),
            small_sqnorm=small_sqnorm,
            small_batch=batch / num_small,
            num_small=num_small,
            big_sqnorm=big_sqnorm,
            grad_sqnorm=est.grad_sqnorm,
            grad_trace_cov=est.grad_trace_cov,
            b_noise=est.b_noise,
            b_noise_rel_err=est.rel_err,
        )
        if settings.keep_records:
            records.append(record)
        if on_record is not None:
            on_record(record)
        if step % curve_every == 0:
            curve.append((wall_s, loss, batch))
        if settings.stop_at_last_target and next_target == len(targets):
            break
        decision = policy.observe(record)
        if decision is None or decision.plan == plan:
            continue
        decisions.append(decision)
        if decision.plan.layout != plan.layout:  # a parallelism change, whatever the label
            spent = cost * math.exp(settings.step_time_noise * rng.standard_normal())
            wall_s += spent
            switch_costs.append(spent)
            record_cost = getattr(policy, "record_switch_cost", None)
            if record_cost is not None:
                record_cost(spent)
        plan = decision.plan
        timeline.append(
            PlanSpan(
                start_s=wall_s,
                start_step=step,
                plan=plan,
                b_noise=decision.b_noise,
                true_b_noise=traj.b_noise(loss),
                loss=loss,
            )
        )
    curve.append((wall_s, loss, plan.global_batch_size))
    return SimResult(
        name=name,
        time_to_target_s=reached,
        timeline=timeline,
        decisions=decisions,
        switch_costs_s=switch_costs,
        curve=curve,
        num_steps=step,
        tokens=samples * shape.seq_len,
        wall_s=wall_s,
        final_loss=loss,
        records=records,
    )


def _loss_sigma(settings: SimSettings, batch: int, seq_len: int) -> float:
    """σ of one step's reported loss: loss_noise_token/sqrt(B·seq), or the constant."""
    if settings.loss_noise_token > 0:
        return settings.loss_noise_token / math.sqrt(batch * seq_len)
    return settings.loss_noise


def _estimate_steps(traj: Trajectory, settings: SimSettings, plan: ParallelPlan) -> int:
    """Rough number of steps of the run (for thinning the plotted curve)."""
    return max(1, settings.token_budget // (plan.global_batch_size * traj.seq_len * 4))


def _num(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None
