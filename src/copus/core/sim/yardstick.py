"""The honest yardstick of a simulated cell: best baseline, honest ceiling, capture.

A controller's worth is its speed-up over what its user would otherwise run, as a share of what
any controller could gain (docs/yardstick.md):

- **Metric**: time to the final (lowest) target loss. A switch's timing cannot move it, only
  whether it was paid; an average over several targets lets one switch paid just before the
  first target swing a cell's capture by a third (`weighted_speedup_pct`, Σ_i(T_b,i − T_i)/Σ_i T_b,i,
  and the equal-weight `average_speedup_pct` are reported beside it).
- **Best baseline**: the fastest of every static batch of the full candidate menu (each on its
  fastest plan), every published step schedule scaled to the preset at every anchor
  (`schedule_baselines`), and the simulated baselines of the run (CBS, Merrill's doubling rule,
  the preset's static list).
- **Honest ceiling**: the one-run, switch-paying dynamic programme of `core.sim.egrid`, starting
  like the controllers (the initial batch on the zero-progress first step; the start layout a
  decision). `honest_ceiling_pct` is its speed-up over the best baseline; a cell counts for the
  capture goals when it is ≥ 2 %.
- **Capture** = variant's speed-up / honest ceiling (same metric, same baseline).
- **Untuned choice**: the median static batch of the power-of-two menu, and each published
  schedule anchored at it (`schedule_baselines.untuned`); each variant's speed-up over them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from copus.core.sim.egrid import Menu, ceiling_minutes, fixed_runs_minutes
from copus.core.sim import schedule_baselines as sb

CEILING_FLOOR_PCT = 2.0
METRIC = "time to the final target loss"


@dataclass(slots=True)
class Yardstick:
    """The seed-independent part of a cell: deterministic baselines and the ceilings."""

    targets: list[float]
    final_target: float
    ceiling_min: list[float | None]  # honest: pays switches, fair start
    free_min: list[float | None]  # switches free, fair start
    static_batch: int  # the best static batch of the full menu
    static_min: list[float | None]
    median_batch: int  # the untuned user's static batch
    median_min: list[float | None]
    schedules: dict[str, dict] = field(default_factory=dict)  # name -> tuned/untuned runs
    # Merrill et al.'s doubling rule on the true critical batch (a perfect measurement)
    doubling_min: list[float | None] | None = None

    def deterministic_baselines(self) -> dict[str, list[float | None]]:
        out = {f"static B={self.static_batch} (best of full menu)": self.static_min}
        for name, s in self.schedules.items():
            out[f"schedule {name} tuned"] = s["tuned"]["minutes"]
        if self.doubling_min is not None:
            out["doubling on the true critical batch"] = self.doubling_min
        return out

    def untuned(self) -> dict[str, list[float | None]]:
        out = {f"median static B={self.median_batch}": self.median_min}
        for name, s in self.schedules.items():
            out[f"schedule {name} as published"] = s["untuned"]["minutes"]
        return out


def _minutes_list(row: np.ndarray) -> list[float | None]:
    return [None if not math.isfinite(float(v)) else float(v) for v in row]


def build(scenario, planner, *, horizon_tokens: float) -> Yardstick:
    """The deterministic yardstick of `scenario` (a `core.sim.scenario.Scenario`)."""
    cands, step_s = planner.menu()
    menu = Menu.from_candidates(cands, step_s)
    truth, seq, targets = scenario.sim.trajectory, scenario.shape.seq_len, list(scenario.sim.target_losses)
    final = min(targets)
    cost = planner.switch_cost_s
    ceiling = ceiling_minutes(truth, seq, menu, scenario.initial_batch, targets, cost)
    free = ceiling_minutes(truth, seq, menu, scenario.initial_batch, targets, 0.0)
    batches = np.unique(menu.batches)
    static = fixed_runs_minutes(truth, seq, menu, lambda tok, e: batches, len(batches), targets)
    col = targets.index(final)
    finite = np.where(np.isfinite(static[:, col]), static[:, col], np.inf)
    best = int(np.argmin(finite))
    median = sb.median_static_batch(scenario.initial_batch, scenario.max_batch, batches)
    med_row = static[int(np.flatnonzero(batches == median)[0])]
    schedules = sb.schedule_runs(
        truth,
        seq,
        menu,
        targets,
        cost,
        horizon_tokens=horizon_tokens,
        initial_batch=scenario.initial_batch,
        max_batch=scenario.max_batch,
        median_batch=median,
    )
    from copus.core.sim.trajectory import Trajectory

    doubling = fixed_runs_minutes(
        truth,
        seq,
        menu,
        sb.doubling_batches(Trajectory(truth, seq), scenario.initial_batch, scenario.max_batch, batches),
        1,
        targets,
        cost,
    )
    return Yardstick(
        targets=targets,
        final_target=final,
        ceiling_min=ceiling,
        free_min=free,
        static_batch=int(batches[best]),
        static_min=_minutes_list(static[best]),
        median_batch=int(median),
        median_min=_minutes_list(med_row),
        schedules=schedules,
        doubling_min=_minutes_list(doubling[0]),
    )


def speedup(base: float | None, run: float | None) -> float | None:
    """(T_base − T_run)/T_base in percent; None if either is missing."""
    if base is None or run is None or not (math.isfinite(base) and base > 0):
        return None
    if not math.isfinite(run):
        return None
    return 100.0 * (base - run) / base


def _best_per_target(runs: dict[str, list[float | None]], n: int) -> tuple[list, list]:
    mins, names = [], []
    for i in range(n):
        hits = [(m[i], name) for name, m in runs.items() if m[i] is not None]
        t, name = min(hits) if hits else (None, None)
        mins.append(t)
        names.append(name)
    return mins, names


def score(
    yard: Yardstick, simulated_baselines: dict[str, list[float | None]], variants: dict[str, list[float | None]]
) -> dict:
    """One seed of a cell: the best baseline, the honest ceiling and every variant's speed-ups
    (minutes lists in `yard.targets` order)."""
    n, col = len(yard.targets), yard.targets.index(yard.final_target)
    baselines = {**yard.deterministic_baselines(), **simulated_baselines}
    per_target, names = _best_per_target(baselines, n)
    base_final = per_target[col]
    ceiling = speedup(base_final, yard.ceiling_min[col])
    out = {
        "metric": METRIC,
        "final_target": yard.final_target,
        "best_baseline": {
            "name": names[col],
            "minutes": base_final,
            "per_target": [
                {"target": t, "name": nm, "minutes": m} for t, nm, m in zip(yard.targets, names, per_target)
            ],
        },
        "honest_ceiling_pct": ceiling,
        "ceiling_ge_2pct": bool(ceiling is not None and ceiling >= CEILING_FLOOR_PCT),
        "free_switch_ceiling_pct": speedup(base_final, yard.free_min[col]),
        "ceiling_minutes": yard.ceiling_min,
        "baselines": baselines,
        "untuned": yard.untuned(),
        "schedules": {n: {k: v[k]["describe"] for k in ("tuned", "untuned")} for n, v in yard.schedules.items()},
        "variants": {},
    }
    for name, mins in variants.items():
        pct = speedup(base_final, mins[col])
        per = [speedup(b, m) for b, m in zip(per_target, mins)]
        done = [(b, m) for b, m in zip(per_target, mins) if b is not None]
        weighted = (
            (100.0 * sum(b - (m if m is not None else math.inf) for b, m in done) / sum(b for b, _ in done))
            if done
            else None
        )
        vals = [p for p in per if p is not None]
        out["variants"][name] = {
            "speedup_pct": pct,
            "capture": pct / ceiling if pct is not None and ceiling and ceiling > 0 else None,
            "weighted_speedup_pct": weighted if weighted is None or math.isfinite(weighted) else None,
            "average_speedup_pct": float(np.mean(vals)) if len(vals) == n else None,
            "per_target_pct": per,
            "minutes": mins,
            "vs_untuned_pct": {u: speedup(m[col], mins[col]) for u, m in yard.untuned().items()},
        }
    return out


def seconds_to_minutes(time_to_target_s: dict, targets: list[float]) -> list[float | None]:
    return [None if time_to_target_s.get(t) is None else time_to_target_s[t] / 60.0 for t in targets]
