"""Every policy side by side on one scenario, and the speed-up table (COPUS Table 1 style).

`compare_policies` simulates each policy family (`POLICY_FAMILIES`: static batches, CBS, batch
doubling, the norm test, the goodput variants) on one `core.sim.scenario.Scenario` with the same
noise seed (common random numbers, `core.sim.simulator.simulate`); `Comparison` holds the runs and
scores them per target loss by (T_best_baseline − T_goodput)/T_best_baseline (COPUS §6.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from copus.core.plan.plan import ParallelPlan
from copus.core.sim.scenario import GoodputVariant, Planner, PolicyFactory, Scenario, default_policy_factory
from copus.core.sim.simulator import SimResult, simulate

POLICY_FAMILIES = ("static", "cbs", "doubling", "norm-test", "goodput")
# COPUS Table 1 compares against static and cbs; Merrill et al. 2025's doubling rule is a
# practitioner's baseline too (core.sim.yardstick adds the full static menu and schedules)
BASELINE_FAMILIES = ("static", "cbs", "doubling")


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
