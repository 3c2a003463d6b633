"""Where a simulated run's deficit against a static batch accrues: the default planning controller's
time to each of 20 loss levels between its start and the final loss, beside a static batch's
(docs/robust-goodput.md §6.35).

    PYTHONPATH=src python bench/deficit_trace.py 32b-32xh100 sqrt-lr 1 [SEED [STATIC_B]]

One line per level: the loss, the controller's minutes and batch there, the static batch's
minutes, and the difference (+: the controller is behind).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from copus.commands.simulate import _preset
from copus.core.sim.presets import get_preset
from copus.core.sim.compare import compare_policies
from copus.core.sim.scenario import Planner, default_policy_factory
from copus.core.sim.simulator import SimResult, simulate


def time_at(res: SimResult, loss: float) -> tuple[float, int]:
    """(wall seconds, batch) of the first step whose true loss is at or below `loss` (nan, 0: never)."""
    for t, lo, b in res.curve:
        if lo <= loss + 1e-9:
            return t, b
    return float("nan"), 0


def main() -> int:
    preset, truth, ratio = sys.argv[1], sys.argv[2], float(sys.argv[3])
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    batch = int(sys.argv[5]) if len(sys.argv) > 5 else 26
    sim_args = argparse.Namespace(truth="fitted", crit_ratio=None, seed=seed, reconfig="online", no_lr_aware=False)
    sc = _preset(get_preset(preset), sim_args, truth, ratio, seed)
    planner = Planner(sc)
    runs = compare_policies(sc, ("goodput",), planner=planner).results
    ctrl = next(r for r in runs if r.name.startswith("goodput") and "copus" not in r.name)
    plan = planner.fastest_plan(batch)
    if plan is None:
        raise SystemExit(f"static batch {batch} has no plan that fits {preset}; allowed: a batch of its menu")
    policy = default_policy_factory(sc)("constant", plan, planner)
    static = simulate(policy, plan, sc.shape, planner.step_time_model, sc.sim, switch_cost_s=planner.switch_cost_s)
    final = max(min(lo for _, lo, _ in static.curve), min(lo for _, lo, _ in ctrl.curve))
    start = ctrl.curve[min(5, len(ctrl.curve) - 1)][1]
    print(f"{ctrl.name} against static B={batch} ({plan.describe()}), {preset} {truth} R={ratio:g} seed {seed}")
    for q in np.linspace(0.05, 1.0, 20):
        loss = start - q * (start - final)
        (tc, bc), (ts, _) = time_at(ctrl, loss), time_at(static, loss)
        print(
            f"loss {loss:8.4f}  controller {tc / 60:7.2f} min (B={bc:5d})  "
            f"static {ts / 60:7.2f}  {(tc - ts) / 60:+6.2f} min"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
