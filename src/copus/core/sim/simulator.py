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


# ------------------------------------------------------------------------ policies side by side

POLICY_FAMILIES = ("static", "cbs", "doubling", "norm-test", "goodput")
# COPUS Table 1 compares against static and cbs; Merrill et al. 2025's doubling rule is a
# practitioner's baseline too (core.sim.yardstick adds the full static menu and schedules)
BASELINE_FAMILIES = ("static", "cbs", "doubling")


VARIANT_STARTS = ("scenario", "planner")


@dataclass(frozen=True, slots=True, kw_only=True)
class GoodputVariant:
    """One goodput controller to simulate, given by the controller's own settings objects.

    `settings`: `core.policies.PolicySettings` fields (the [batch]/[gns] keys) over the
    scenario's; `controller`: keyword arguments of `core.controller.make_controller` (margin,
    lr_aware, allow_shrink, reconfig_cost_s, ...). The run is labelled `name`.
    """

    name: str = "goodput"
    settings: tuple[tuple[str, object], ...] = ()
    controller: tuple[tuple[str, object], ...] = ()
    # where the run starts: "scenario" = the scenario's start layout (COPUS: its profiler's
    # choice, the published layout); "planner" = the controller's own fastest plan at the
    # initial batch, as `copus train` starts (controller.start = "planned")
    start: str = "scenario"
    policy: str = "goodput"  # "goodput" (the planning controller) or "goodput-copus"

    def __post_init__(self) -> None:
        if self.start not in VARIANT_STARTS:
            raise ValueError(f"start={self.start!r} is invalid; allowed: {', '.join(VARIANT_STARTS)}")


# COPUS as published (§4.5, Alg. 2; copus-notes §1.6-1.9): LR-aware goodput (Eq. 8), c = 2,
# 10 % switching margin, growth ≤ 2x per decision, the batch never shrinks; the point estimate
# as soon as there is one (the paper has no accuracy gate: max_rel_err = 1e9 disables copus's),
# no confidence bound, no recovery hold, no step-time bound, no probes or audits.
NO_GATE_REL_ERR = 1e9
COPUS_FAITHFUL = GoodputVariant(
    name="goodput-copus",
    policy="goodput-copus",
    settings=(
        ("max_growth", 2.0),
        ("calibration", 2.0),
        ("gns_c", 2.0),
        ("calibration_mode", "fixed"),
        ("confidence", 0.0),
        ("max_rel_err", NO_GATE_REL_ERR),
        ("recovery_steps", 0),
    ),
    controller=(("margin", 0.10), ("lr_aware", True), ("allow_shrink", False)),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """A model on a cluster, the run to simulate and the planner's search space."""

    shape: ModelShape
    hardware: str
    world_size: int
    sim: SimSettings
    initial_batch: int = 16
    max_batch: int = 1024
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    static_batches: tuple[int, ...] = ()  # () = powers of two from initial_batch to max_batch
    batch_grid: str = "multiples"  # core.goodput grid; "geometric" for huge clusters
    memory_headroom: float = 0.9  # fraction of device memory the planner may use
    # The controller's step-time model: False = the analytic model itself, the simulator's
    # ground truth (as COPUS decides from its profiled table, §4.4); True = refit online from
    # the noisy simulated step times, as the real trainer does (slower: scipy fits).
    online_fit: bool = False
    lr_aware: bool = True  # COPUS Eq. 8 sqrt(B) factor in the controller
    policy_overrides: tuple[tuple[str, object], ...] = ()  # PolicySettings fields to change
    # goodput controllers to run side by side (() = one "goodput" from lr_aware/policy_overrides)
    goodput_variants: tuple[GoodputVariant, ...] = ()
    # (dp, tp, pp) of the CBS baselines (() = tuned by the planner for the initial and final batch)
    cbs_layouts: tuple[tuple[int, int, int], ...] = ()
    # (dp, tp, pp) the goodput runs start from (None: the planner's fastest at initial_batch)
    start_layout: tuple[int, int, int] | None = None
    # the run's planned length in tokens (copus train's train.max_tokens; 0: unknown), which
    # the planning controller plans to
    horizon_tokens: int = 0

    def variants(self) -> tuple[GoodputVariant, ...]:
        return self.goodput_variants or (GoodputVariant(name="goodput"),)

    def batches_for_static(self) -> tuple[int, ...]:
        if self.static_batches:
            return self.static_batches
        out, b = [], self.initial_batch
        while b <= self.max_batch:
            out.append(b)
            b *= 2
        return tuple(out)


class Planner:
    """The analytic step-time and memory models of one scenario, and fastest-plan look-ups."""

    def __init__(self, scenario: Scenario) -> None:
        from copus.core.specs.hardware import get_hardware
        from copus.core.cost.memory import MemoryModel
        from copus.core.cost.throughput import StepTimeModel

        self.scenario = scenario
        self.hardware = get_hardware(scenario.hardware)
        self.step_time_model = StepTimeModel.analytic(scenario.shape, self.hardware, scenario.world_size)
        self.memory_model = MemoryModel(
            shape=scenario.shape, stack=self.hardware.stack, distributed_optimizer=self.hardware.distributed_optimizer
        )
        self.memory_capacity_bytes = self.hardware.memory_bytes * scenario.memory_headroom
        sim = scenario.sim
        self.switch_cost_s = (
            sim.reconfig_cost_s
            if sim.reconfig_cost_s is not None
            else reconfig_cost_s(scenario.shape, scenario.world_size, sim.reconfig_mode)
        )

    def menu(self):
        """(every memory-feasible candidate of the scenario's batch range, its predicted step
        seconds): the controller's own grid, which the oracles (`core.sim.oracle`) and the gap
        split (`core.sim.gap`) choose from."""
        from copus.core.plan.goodput import build_candidates

        sc = self.scenario
        cands = build_candidates(
            sc.world_size,
            sc.shape,
            min_batch=sc.initial_batch,
            max_batch=sc.max_batch,
            micro_batch_sizes=sc.micro_batch_sizes,
            batch_grid=sc.batch_grid,
            memory_model=self.memory_model,
            memory_capacity_bytes=self.memory_capacity_bytes,
        )
        return cands, np.asarray(cands.predict_step_s(self.step_time_model), dtype=float)

    def fastest_plan(self, global_batch_size: int, layout: tuple[int, int, int] | None = None) -> ParallelPlan | None:
        """The plan with the shortest predicted step at this batch (None if nothing fits).

        COPUS's static baselines: "the throughput-optimal (S, B_m) for that batch" (§6.1).
        """
        from copus.core.plan.goodput import build_candidates

        cands = build_candidates(
            self.scenario.world_size,
            self.scenario.shape,
            min_batch=global_batch_size,
            max_batch=global_batch_size,
            micro_batch_sizes=self.scenario.micro_batch_sizes,
            memory_model=self.memory_model,
            memory_capacity_bytes=self.memory_capacity_bytes,
        )
        if layout is not None:
            cands = cands.subset((cands.dp == layout[0]) & (cands.tp == layout[1]) & (cands.pp == layout[2]))
        if not len(cands):
            return None
        return cands.plan(int(np.argmin(cands.predict_step_s(self.step_time_model))))

    def smallest_batch_plan(self, layout: tuple[int, int, int]) -> ParallelPlan | None:
        """Fastest plan of `layout` at the smallest reachable batch ≥ the initial batch."""
        b = self.scenario.initial_batch
        while b <= self.scenario.max_batch:
            plan = self.fastest_plan(b, layout)
            if plan is not None:
                return plan
            b += 1
        return None


class CachedPredictor:
    """A fixed step-time model that remembers its answer for the same candidate arrays.

    The controller scores the same `CandidateSet` arrays at every decision; with a model that
    does not change (no online refit) the answer does not change either. Pure speed-up: values
    are those of `model.predict`. Keys are array identities; the arrays are kept alive.
    """

    def __init__(self, model: StepTimePredictor) -> None:
        self.model = model
        self._cache: dict[tuple[int, ...], tuple[tuple, np.ndarray]] = {}

    def predict(self, dp, tp, pp, micro_batch_size, num_microbatches) -> np.ndarray:
        args = (dp, tp, pp, micro_batch_size, num_microbatches)
        if np.size(dp) < 64:
            return self.model.predict(*args)
        key = tuple(id(a) for a in args)
        hit = self._cache.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], args)):
            hit = (args, np.asarray(self.model.predict(*args), dtype=float))
            self._cache[key] = hit
        return hit[1]


PolicyFactory = Callable[..., Policy]


def default_policy_factory(scenario: Scenario) -> PolicyFactory:
    """`core.policies.make_policy` with COPUS's settings (design §10) for every policy; a goodput
    run takes its `GoodputVariant`'s settings and controller options on top."""
    from dataclasses import replace

    from copus.core.control.policies import PolicySettings, make_policy
    from copus.core.stats import calibration_posterior

    settings = replace(PolicySettings(), **dict(_copus_settings(scenario)), **dict(scenario.policy_overrides))

    def factory(name: str, plan: ParallelPlan, planner: Planner, variant: GoodputVariant | None = None) -> Policy:
        kw, own = {}, settings
        if name == "goodput":
            variant = variant or GoodputVariant()
            own = replace(settings, **dict(variant.settings))
            model = planner.step_time_model
            kw = {
                "step_time_model": model if scenario.online_fit else CachedPredictor(model),
                "memory_capacity_bytes": planner.memory_capacity_bytes,
                "hardware": planner.hardware,
                "memory_model": planner.memory_model,
                "micro_batch_sizes": scenario.micro_batch_sizes,
                "batch_grid": scenario.batch_grid,
                "online_fit": scenario.online_fit,
                "lr_aware": scenario.lr_aware,
                "lr_warmup_tokens": scenario.sim.trajectory.lr_warmup_tokens,
                "reconfig_cost_s": planner.switch_cost_s,
            } | dict(variant.controller)
            if calibration_posterior.MODEL_ESTIMATOR_LAG:
                # the posterior over c models the simulated estimator's EMA lag in its clock (§6.13)
                sim = scenario.sim
                lag = {"lag_decay": (sim.gns_decay, sim.gns_decay_late, float(sim.gns_decay_switch_tokens))}
                kw["posterior_options"] = lag | dict(kw.get("posterior_options") or {})
            if variant.policy == "goodput":
                # every simulated method runs η0·sqrt(B/16) (SimSettings.base_lr; COPUS §6.1)
                kw = {"horizon_tokens": scenario.horizon_tokens, "lr_rule": "sqrt"} | kw
            name = variant.policy
        return make_policy(name, own, plan, scenario.world_size, scenario.shape, **kw)

    return factory


def _copus_settings(scenario: Scenario) -> tuple[tuple[str, object], ...]:
    return (
        ("initial", scenario.initial_batch),
        ("min", scenario.initial_batch),
        ("max", scenario.max_batch),
        ("max_growth", 2.0),
        ("gns_c", 2.0),
        ("calibration", 2.0),
        ("confidence", 0.0),
        ("recovery_steps", 0),
    )


@dataclass(slots=True, kw_only=True)
class Comparison:
    """Every policy's run on one scenario, and the speed-up table (COPUS Table 1 style)."""

    scenario: Scenario
    results: list[SimResult]
    families: dict[str, str]  # run name -> policy family
    yardstick: dict | None = None  # core.sim.yardstick.score of this comparison (presets)

    def best(self, target: float, families: tuple[str, ...]) -> tuple[str | None, float | None]:
        """Fastest run of the given families to `target` (name, seconds)."""
        hits = [
            (r.time_to_target_s[target], r.name)
            for r in self.results
            if self.families[r.name] in families and r.time_to_target_s[target] is not None
        ]
        if not hits:
            return None, None
        t, name = min(hits)
        return name, t

    def goodput_runs(self) -> list[str]:
        """Names of the goodput runs (one per `GoodputVariant`), in run order."""
        return [r.name for r in self.results if self.families[r.name] == "goodput"]

    def run(self, name: str) -> SimResult:
        return next(r for r in self.results if r.name == name)

    def speedups(self, baselines: tuple[str, ...] = BASELINE_FAMILIES, run: str | None = None) -> list[dict]:
        """Per target: (T_best_baseline − T_goodput)/T_best_baseline (COPUS §6.1 metric) of the
        goodput run `run` (default: the first one)."""
        names = self.goodput_runs()
        name = run or (names[0] if names else None)
        rows = []
        for target in sorted(self.scenario.sim.target_losses, reverse=True):
            base_name, base_t = self.best(target, baselines)
            good_t = self.run(name).time_to_target_s[target] if name is not None else None
            pct = 100.0 * (base_t - good_t) / base_t if base_t is not None and good_t is not None else None
            rows.append(
                {"target": target, "baseline": base_name, "baseline_s": base_t, "goodput_s": good_t, "speedup_pct": pct}
            )
        return rows

    def average_speedup_pct(self, run: str | None = None) -> float | None:
        vals = [r["speedup_pct"] for r in self.speedups(run=run) if r["speedup_pct"] is not None]
        return float(np.mean(vals)) if vals else None

    def to_dict(self) -> dict:
        s = self.scenario
        return {
            "model": s.shape.name,
            "hardware": s.hardware,
            "world_size": s.world_size,
            "seed": s.sim.seed,
            "target_losses": list(s.sim.target_losses),
            "token_budget": s.sim.token_budget,
            "speedups": self.speedups(),
            "average_speedup_pct": self.average_speedup_pct(),
            "variants": {
                n: {"speedups": self.speedups(run=n), "average_speedup_pct": self.average_speedup_pct(n)}
                for n in self.goodput_runs()
            },
            "runs": [r.to_dict() | {"family": self.families[r.name]} for r in self.results],
        }


def compare_policies(
    scenario: Scenario,
    policies: tuple[str, ...] = POLICY_FAMILIES,
    *,
    factory: PolicyFactory | None = None,
    planner: Planner | None = None,
) -> Comparison:
    """Simulate each policy family on `scenario` with the same noise seed.

    static:    every static batch on its fastest plan (the best per target is the baseline);
    cbs:       the `gns` policy with the layout tuned for the initial batch and, separately,
               for the batch the first CBS run ended at (COPUS's pessimistic / optimistic CBS);
    norm-test: Lau et al.'s norm test from the fastest plan for the initial batch;
    goodput:   COPUS's controller from the start plan (the scenario's start layout, or the
               planner's fastest at the initial batch for a variant with start="planner"), once per
               `scenario.variants()` (e.g. COPUS_FAITHFUL and copus's defaults).
    """
    bad = [p for p in policies if p not in POLICY_FAMILIES]
    if bad:
        raise ValueError(f"policy {bad[0]!r} is invalid; allowed: {', '.join(POLICY_FAMILIES)}")
    planner = planner or Planner(scenario)
    factory = factory or default_policy_factory(scenario)
    start = planner.fastest_plan(scenario.initial_batch, scenario.start_layout)
    if start is None:
        raise ValueError(
            f"no plan fits initial_batch={scenario.initial_batch} on "
            f"{scenario.world_size} x {scenario.hardware} for {scenario.shape.name}"
        )
    results: list[SimResult] = []
    families: dict[str, str] = {}

    def run(
        family: str, name: str, policy_name: str, plan: ParallelPlan, variant: GoodputVariant | None = None
    ) -> SimResult:
        policy = (
            factory(policy_name, plan, planner, variant) if variant is not None else factory(policy_name, plan, planner)
        )
        res = simulate(
            policy,
            plan,
            scenario.shape,
            planner.step_time_model,
            scenario.sim,
            name=name,
            switch_cost_s=planner.switch_cost_s,
        )
        results.append(res)
        families[name] = family
        return res

    for family in policies:
        if family == "static":
            for batch in scenario.batches_for_static():
                plan = planner.fastest_plan(batch)
                if plan is not None:
                    run("static", f"static B={batch} {_layout(plan)}", "constant", plan)
        elif family == "cbs" and scenario.cbs_layouts:
            for layout in scenario.cbs_layouts:
                plan = planner.smallest_batch_plan(layout)
                if plan is not None:
                    run("cbs", f"cbs {_layout(plan)}", "gns", plan)
        elif family == "doubling":
            layouts = scenario.cbs_layouts or (start.layout,)
            for layout in dict.fromkeys(layouts):
                plan = planner.smallest_batch_plan(layout)
                if plan is not None:
                    run("doubling", f"doubling {_layout(plan)}", "doubling", plan)
        elif family == "goodput":
            for variant in scenario.variants():
                first = start
                if variant.start == "planner":  # copus train's controller.start = "planned"
                    first = planner.fastest_plan(scenario.initial_batch) or start
                    ask = getattr(factory("goodput", first, planner, variant), "start_plan", None)
                    first = ask() if ask is not None else first
                run("goodput", variant.name, "goodput", first, variant if scenario.goodput_variants else None)
        elif family == "cbs":
            first = run("cbs", f"cbs {_layout(start)} (tuned for B={start.global_batch_size})", "gns", start)
            final_batch = first.timeline[-1].plan.global_batch_size
            best_final = planner.fastest_plan(final_batch)
            late = planner.smallest_batch_plan(best_final.layout) if best_final else None
            if late is not None and late.layout != start.layout:
                run("cbs", f"cbs {_layout(late)} (tuned for B={final_batch})", "gns", late)
        else:
            run(family, family, family, start)
    return Comparison(scenario=scenario, results=results, families=families)


def _layout(plan: ParallelPlan) -> str:
    from copus.core.plan.layout_names import layout_name

    return layout_name(plan.dp, plan.tp, plan.pp)


def preset_scenario(
    preset,
    *,
    seed: int = 0,
    reconfig_mode: str = "online",
    variants: tuple[GoodputVariant, ...] = (COPUS_FAITHFUL,),
    trajectory: TrajectoryParams | None = None,
    **sim_overrides,
) -> Scenario:
    """The `Scenario` of a `core.presets.Preset` (COPUS §6.1 settings): its published CBS
    layouts, and the goodput `variants` (default: COPUS_FAITHFUL alone). `trajectory`: the
    ground truth (default: the preset's, `Preset.trajectory`)."""
    from copus.core.specs.resolve import get_model_shape

    budget = int(preset.token_budget * preset.sim_budget_factor)
    sim = SimSettings(
        target_losses=preset.target_losses,
        token_budget=budget,
        trajectory=trajectory or preset.trajectory,
        seed=seed,
        reconfig_mode=reconfig_mode,
        **sim_overrides,
    )
    return Scenario(
        shape=get_model_shape(preset.model),
        hardware=preset.hardware,
        world_size=preset.world_size,
        sim=sim,
        initial_batch=preset.initial_batch,
        max_batch=preset.max_batch,
        static_batches=preset.static_batches,
        batch_grid=getattr(preset, "batch_grid", "multiples"),
        goodput_variants=tuple(variants),
        cbs_layouts=tuple(preset.cbs_layouts),
        # COPUS started from the layout its profiler found fastest at B = 16
        start_layout=preset.published_layouts[0] if preset.published_layouts else None,
        # every published layout ran on the paper's cluster (13B DP4·PP4: 74 of 80 GB
        # by core/cost/memory.py), so the whole device memory is allowed
        memory_headroom=1.0,
        horizon_tokens=int(preset.token_budget),
    )
