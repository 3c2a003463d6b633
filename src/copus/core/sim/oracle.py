"""The best any controller could do in the simulator: the ceiling of a simulated speed-up.

An oracle knows the ground truth (`core.trajectory`) and the step time of every plan, and
changes plan and batch for free at every step. Time to a loss is Σ step_s over the steps taken,
and each step's choice only depends on the current loss and tokens, so the greedy choice

    i*(step) = argmax_i ΔE(B_i, L, tokens) / step_s_i          (true progress per second)

minimises the time to every target at once (the integrand of ∫ dE / rate(E) is minimised
pointwise; warm-up makes the rate depend on tokens as well, which the step-by-step march keeps).
Its speed-up over the simulated baselines is the ceiling of any policy's in the same truth
and cost model (COPUS's "Ideal" row is the same idea for its own controller: zero switch cost).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from copus.core.sim.trajectory import Trajectory, TrajectoryParams


def oracle_minutes(params: TrajectoryParams, seq_len: int, global_batch_sizes: np.ndarray,
                   step_s: np.ndarray, targets: Sequence[float],
                   max_steps: int = 200_000) -> list[float | None]:
    """Minutes to each target loss of the oracle over the candidates (batch_i, step_s_i)."""
    traj = Trajectory(params, seq_len)
    batches = np.asarray(global_batch_sizes, dtype=float)
    inv_t = 1.0 / np.asarray(step_s, dtype=float)
    order = sorted(targets, reverse=True)
    hit: dict[float, float] = {}
    progress, tokens, wall, k = 0.0, 0.0, 0.0, 0
    loss = traj.loss(0.0)
    for _ in range(max_steps):
        gain = np.asarray(traj.progress_per_step(batches, loss, tokens), dtype=float)
        i = int(np.argmax(gain * inv_t))
        if not gain[i] > 0:
            if tokens >= params.lr_warmup_tokens:
                break                              # stalled for good (x ≥ 2 everywhere)
            i = int(np.argmax(batches * inv_t))   # LR still 0: get through warm-up fastest
        progress += float(gain[i])
        tokens += batches[i] * seq_len
        wall += 1.0 / inv_t[i]
        loss = traj.loss(progress)
        while k < len(order) and loss <= order[k]:
            hit[order[k]] = wall / 60.0
            k += 1
        if k == len(order):
            break
    return [hit.get(t) for t in targets]


def speedup_pct(baseline_min: float | None, run_min: float | None) -> float | None:
    """(T_baseline − T_run)/T_baseline in percent (COPUS §6.1); None if either is missing."""
    if baseline_min is None or run_min is None or not math.isfinite(baseline_min):
        return None
    return 100.0 * (baseline_min - run_min) / baseline_min


def scenario_oracle_minutes(scenario, params: TrajectoryParams | None = None, planner=None,
                            layout: tuple[int, int, int] | None = None) -> list[float | None]:
    """`oracle_minutes` over every memory-feasible plan of a `core.simulator.Scenario` (the
    controller's own candidate grid), under `params` (default: the scenario's truth).
    `layout` (dp, tp, pp): only that layout's plans, i.e. the batch schedule's own ceiling."""
    from copus.core.plan.goodput import build_candidates
    from copus.core.sim.simulator import Planner

    planner = planner or Planner(scenario)
    cands = build_candidates(scenario.world_size, scenario.shape,
                             min_batch=scenario.initial_batch, max_batch=scenario.max_batch,
                             micro_batch_sizes=scenario.micro_batch_sizes,
                             batch_grid=scenario.batch_grid, memory_model=planner.memory_model,
                             memory_capacity_bytes=planner.memory_capacity_bytes)
    if layout is not None:
        cands = cands.subset((cands.dp == layout[0]) & (cands.tp == layout[1])
                             & (cands.pp == layout[2]))
    step_s = np.asarray(cands.predict_step_s(planner.step_time_model), dtype=float)
    ok = np.isfinite(step_s) & (step_s > 0)
    return oracle_minutes(params or scenario.sim.trajectory, scenario.shape.seq_len,
                          cands.global_batch_size[ok], step_s[ok], scenario.sim.target_losses)
