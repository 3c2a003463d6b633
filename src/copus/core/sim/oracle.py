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


def oracle_minutes(
    params: TrajectoryParams,
    seq_len: int,
    global_batch_sizes: np.ndarray,
    step_s: np.ndarray,
    targets: Sequence[float],
    max_steps: int = 200_000,
) -> list[float | None]:
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
                break  # stalled for good (x ≥ 2 everywhere)
            i = _fair_start(batches, inv_t)  # LR still 0: the controllers' first batch
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


def _fair_start(batches: np.ndarray, inv_t: np.ndarray) -> int:
    """The candidate of a zero-progress step (the LR warm-up's first step): the fastest plan of
    the smallest batch, where every controller starts. Taking the highest-throughput candidate
    instead (B = 1024 for 3B) would burn the warm-up tokens no controller can burn."""
    small = np.flatnonzero(batches == batches.min())
    return int(small[np.argmax(inv_t[small])])


def speedup_pct(baseline_min: float | None, run_min: float | None) -> float | None:
    """(T_baseline − T_run)/T_baseline in percent (COPUS §6.1); None if either is missing."""
    if baseline_min is None or run_min is None or not math.isfinite(baseline_min):
        return None
    return 100.0 * (baseline_min - run_min) / baseline_min


def scenario_oracle_minutes(
    scenario, params: TrajectoryParams | None = None, planner=None, layout: tuple[int, int, int] | None = None
) -> list[float | None]:
    """`oracle_minutes` over every memory-feasible plan of a `core.sim.scenario.Scenario` (the
    controller's own candidate grid), under `params` (default: the scenario's truth).
    `layout` (dp, tp, pp): only that layout's plans, i.e. the batch schedule's own ceiling."""
    from copus.core.sim.scenario import Planner

    cands, step_s = (planner or Planner(scenario)).menu()
    ok = np.isfinite(step_s) & (step_s > 0)
    if layout is not None:
        ok &= (cands.dp == layout[0]) & (cands.tp == layout[1]) & (cands.pp == layout[2])
    return oracle_minutes(
        params or scenario.sim.trajectory,
        scenario.shape.seq_len,
        cands.global_batch_size[ok],
        step_s[ok],
        scenario.sim.target_losses,
    )


def switch_aware_minutes(
    params: TrajectoryParams,
    seq_len: int,
    global_batch_sizes: np.ndarray,
    step_s: np.ndarray,
    layout_ids: np.ndarray,
    targets: Sequence[float],
    switch_cost_s: float,
    points: int = 4000,
) -> list[float | None]:
    """Minutes to each target of the best controller that pays `switch_cost_s` per layout change
    but otherwise knows the truth: the ceiling a real run can reach, where `oracle_minutes`
    also switches for free.

    On a grid of effective samples E (geometric, `points` steps up to the lowest target), with
    r_L(E) = max over the candidates of layout L of ΔE_i / step_s_i (the best batch of each
    layout, free to change), the fastest path is the dynamic programme

        f_L(E_k+1) = min(f_L(E_k), min_L' f_L'(E_k) + C) + (E_k+1 − E_k) / r_L(E_k+½)

    (start on any layout; the batch moves freely within a layout). Under the sqrt-LR truth the
    rate also depends on the tokens seen; they are taken along `oracle_minutes`'s own path at
    the same E (its warm-up), so that truth's result is approximate.
    """
    traj = Trajectory(params, seq_len)
    batches = np.asarray(global_batch_sizes, dtype=float)
    step = np.asarray(step_s, dtype=float)
    ids = np.asarray(layout_ids)
    layouts = np.unique(ids)
    order = sorted(targets, reverse=True)
    goals = [traj.progress_for_loss(t) for t in order]
    if not all(np.isfinite(goals)):
        return [None] * len(targets)
    e_max = max(goals)
    grid = np.concatenate([[0.0], np.geomspace(1e-3 * params.progress_scale_samples, e_max, points)])
    token_of = _oracle_tokens(traj, batches, step, e_max)
    f = np.zeros(len(layouts))
    hit: dict[float, float] = {}
    k_goal = 0
    for lo, hi in zip(grid[:-1], grid[1:]):
        mid = 0.5 * (lo + hi)
        gain = np.asarray(traj.progress_per_step(batches, traj.loss(mid), token_of(mid)), float)
        rate = gain / step
        best = np.array([rate[ids == lay].max() for lay in layouts])
        dt = np.where(best > 0, (hi - lo) / np.where(best > 0, best, 1.0), np.inf)
        f = np.minimum(f, f.min() + switch_cost_s) + dt
        while k_goal < len(goals) and hi >= goals[k_goal]:
            hit[order[k_goal]] = float(f.min()) / 60.0
            k_goal += 1
    return [hit.get(t) if hit.get(t) is not None and math.isfinite(hit[t]) else None for t in targets]


def _oracle_tokens(traj: Trajectory, batches: np.ndarray, step_s: np.ndarray, e_max: float):
    """tokens(E) along the free oracle's greedy path (linear interpolation; only the sqrt-LR
    truth's warm-up reads it)."""
    if traj.params.lr_warmup_tokens <= 0:
        return lambda e: math.inf
    inv_t = 1.0 / step_s
    e_path, tok_path = [0.0], [0.0]
    progress, tokens, loss = 0.0, 0.0, traj.loss(0.0)
    while progress < e_max and len(e_path) < 2_000_000:
        gain = np.asarray(traj.progress_per_step(batches, loss, tokens), dtype=float)
        i = int(np.argmax(gain * inv_t))
        if not gain[i] > 0:
            i = _fair_start(batches, inv_t)
        progress += float(gain[i])
        tokens += batches[i] * traj.seq_len
        loss = traj.loss(progress)
        e_path.append(progress)
        tok_path.append(tokens)
        if tokens >= traj.params.lr_warmup_tokens:
            break  # past the warm-up the rate no longer reads the tokens
    e_arr, t_arr = np.array(e_path), np.array(tok_path)
    return lambda e: float(np.interp(e, e_arr, t_arr, right=math.inf))


def layout_ids(candidates) -> np.ndarray:
    """One integer per (dp, tp, pp) of every candidate of a `core.plan.goodput.CandidateSet`."""
    keys = np.stack([candidates.dp, candidates.tp, candidates.pp], axis=1)
    return np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1)


def scenario_switch_aware_minutes(scenario, params: TrajectoryParams | None = None, planner=None) -> list[float | None]:
    """The switch-aware ceiling of a `core.sim.scenario.Scenario`: `scenario_oracle_minutes` plus
    what paying the scenario's switch cost adds in `switch_aware_minutes` (its result at the
    cost minus at zero cost). The difference form keeps the greedy oracle's exact sqrt-LR
    warm-up; under the lr-tuned truth it equals `switch_aware_minutes` itself (the programme at
    zero cost reproduces the greedy oracle within 0.1 %, tested to 0.5 %)."""
    from copus.core.sim.scenario import Planner

    planner = planner or Planner(scenario)
    cands, step_s = planner.menu()
    ok = np.isfinite(step_s) & (step_s > 0)
    ids = layout_ids(cands)
    truth = params or scenario.sim.trajectory
    args = (truth, scenario.shape.seq_len, cands.global_batch_size[ok], step_s[ok], ids[ok], scenario.sim.target_losses)
    paid = switch_aware_minutes(*args, planner.switch_cost_s)
    free = switch_aware_minutes(*args, 0.0)
    greedy = oracle_minutes(*args[:4], scenario.sim.target_losses)
    return [None if None in (g, p, f) else g + max(p - f, 0.0) for g, p, f in zip(greedy, paid, free)]
