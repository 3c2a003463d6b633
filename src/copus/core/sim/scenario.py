"""What a policy comparison simulates: the scenario, the goodput variants, the policies built for it.

- `GoodputVariant` — one goodput controller to run, given by the controller's own settings
  objects; `COPUS_FAITHFUL` is COPUS as published (§4.5, Alg. 2).
- `Scenario` — a model on a cluster, the run (`core.sim.simulator.SimSettings`) and the
  planner's search space; `preset_scenario` builds one from a `core.sim.presets.Preset` (COPUS
  §6.1 settings).
- `Planner` — the scenario's analytic step-time and memory models and its fastest-plan look-ups
  (COPUS's static baselines: "the throughput-optimal (S, B_m) for that batch", §6.1).
- `default_policy_factory` — `core.control.policies.make_policy` with COPUS's settings (design §10)
  for every policy, a goodput run with its variant's settings on top.

Pure (numpy only, no torch). A run is `core.sim.simulator.simulate`; the policies side by side,
`core.sim.compare`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from copus.core.specs.models import ModelShape
from copus.core.plan.plan import ParallelPlan
from copus.core.sim.simulator import Policy, SimSettings, StepTimePredictor, reconfig_cost_s
from copus.core.sim.trajectory import TrajectoryParams

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
