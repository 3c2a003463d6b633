"""Fit the simulator's ground truth to the baseline rows of COPUS Table 1 (pure; no torch).

Two stages, so that COPUS's own rows are never used (its speed-ups stay a prediction):

1. **Loss curve on the static rows** (`fit_loss_curve`). A static run at batch B on its fastest
   plan (step time t_s) reaches loss L after
       steps(L) = n_w + ∫_{E_w}^{E(L)} dE / ΔE(B, L(E))
   where ΔE is the truth's progress per step (`Trajectory.progress_per_step`), n_w the warm-up
   steps marched one by one and E_w the progress after them; minutes = steps·t_s/60.
   (E_0, α, B*) of `TrajectoryParams` are fitted by least squares on log minutes.
2. **LR model on the CBS rows** (`fit_truth`). For each candidate truth (x0, p and the ratio
   B_crit/b_noise), stage 1 is refitted and the two CBS baselines (fixed layout, GNS-driven
   batch) are simulated; the candidate with the smallest RMS log-time error over the static
   and CBS rows together wins.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from copus.core.sim.trajectory import Trajectory, TrajectoryParams


MISSED_MINUTES = 1e5  # a static run slower than this has stalled (x ≥ 2: no progress)


@dataclass(frozen=True, slots=True)
class StaticRow:
    """A published static run: batch, predicted seconds per step, minutes to each target."""

    global_batch_size: int
    step_s: float
    minutes: tuple[float | None, ...]


@dataclass(frozen=True, slots=True)
class TruthFit:
    """A fitted truth and how well it reproduces the baseline rows (RMS of log time)."""

    params: TrajectoryParams
    static_rms: float
    cbs_rms: float
    rms: float  # over the static and CBS rows together
    num_rows: int


def static_minutes(
    params: TrajectoryParams, seq_len: int, row: StaticRow, targets: Sequence[float], grid_points: int = 400
) -> list[float]:
    """Minutes a static run needs to reach each target loss (module docstring, stage 1)."""
    traj = Trajectory(params, seq_len)
    batch = row.global_batch_size
    tokens_per_step = batch * seq_len
    warm_steps = math.ceil(params.lr_warmup_tokens / tokens_per_step) if params.lr_warmup_tokens else 0
    marks = [traj.progress_for_loss(t) for t in targets]
    progress, step, out = 0.0, 0, {}
    for _ in range(warm_steps):  # the warm-up, step by step (x grows with tokens)
        progress += traj.progress_per_step(batch, traj.loss(progress), step * tokens_per_step)
        step += 1
        for i, mark in enumerate(marks):
            if i not in out and progress >= mark:
                out[i] = step
    rest = [m for i, m in enumerate(marks) if i not in out and math.isfinite(m)]
    if rest:
        lo = max(progress, 1e-9)
        grid = np.geomspace(lo, max(max(rest), lo * 1.0001), grid_points)
        inv = np.array([1.0 / max(traj.progress_per_step(batch, traj.loss(e)), 1e-300) for e in grid])
        cum = np.concatenate([[0.0], np.cumsum(np.diff(grid) * (inv[1:] + inv[:-1]) / 2)])
        for i, mark in enumerate(marks):
            if i not in out:
                out[i] = step + float(np.interp(mark, grid, cum)) if math.isfinite(mark) else math.inf
    return [out[i] * row.step_s / 60.0 for i in range(len(targets))]


def _log_errors(pairs: Iterable[tuple[float | None, float | None]]) -> list[float]:
    """log(simulated/published) for every published time (a target the simulation misses, or
    reaches only after MISSED_MINUTES, counts log 2)."""
    out = []
    for pub, sim in pairs:
        if pub is None:
            continue
        reached = sim is not None and math.isfinite(sim) and sim < MISSED_MINUTES
        out.append(math.log(sim / pub) if reached else math.log(2.0))
    return out


def static_log_errors(
    params: TrajectoryParams, seq_len: int, rows: Sequence[StaticRow], targets: Sequence[float]
) -> list[float]:
    errs = []
    for row in rows:
        errs += _log_errors(zip(row.minutes, static_minutes(params, seq_len, row, targets)))
    return errs


def fit_loss_curve(
    params: TrajectoryParams, seq_len: int, rows: Sequence[StaticRow], targets: Sequence[float], good_rms: float = 0.3
) -> TrajectoryParams:
    """(E_0, α, B*) by least squares on log minutes of the static rows (stage 1).

    Starts from `params`, then from B* and E_0 scaled by 1/4, 4 and 16 until the RMS is below
    `good_rms`: a start at which some batch over-steps (x ≥ 2, no progress) has flat residuals.
    """
    from scipy.optimize import least_squares

    def with_x(x) -> TrajectoryParams:
        return replace(
            params, progress_scale_samples=math.exp(x[0]), loss_exponent=x[1], bcrit_star_tokens=math.exp(x[2])
        )

    def resid(x):
        errs = np.array(static_log_errors(with_x(x), seq_len, rows, targets))
        return np.clip(errs, -20.0, 20.0)

    base = np.array([math.log(params.progress_scale_samples), params.loss_exponent, math.log(params.bcrit_star_tokens)])
    lo, hi = [-3.0, 0.05, math.log(1e6)], [math.log(1e8), 3.0, math.log(1e11)]
    best = None
    for scale in (1.0, 0.25, 4.0, 16.0):
        x0 = np.clip(base + [math.log(scale), 0.0, math.log(scale)], lo, hi)
        res = least_squares(resid, x0, bounds=(lo, hi), diff_step=1e-3)
        err = rms(res.fun)
        if best is None or err < best[0]:
            best = (err, res.x)
        if err < good_rms:
            break
    return with_x(best[1])


def rms(values: Sequence[float]) -> float:
    return float(np.sqrt(np.mean(np.square(values)))) if len(values) else math.nan


def score_truth(
    params: TrajectoryParams,
    seq_len: int,
    rows: Sequence[StaticRow],
    targets: Sequence[float],
    cbs_errors: Callable[[TrajectoryParams], list[float]],
) -> TruthFit:
    """RMS log-time errors of `params` on the static rows and (via `cbs_errors`) the CBS rows."""
    s = static_log_errors(params, seq_len, rows, targets)
    c = cbs_errors(params)
    return TruthFit(params=params, static_rms=rms(s), cbs_rms=rms(c), rms=rms(s + c), num_rows=len(s) + len(c))


def fit_truth(
    base: TrajectoryParams,
    seq_len: int,
    rows: Sequence[StaticRow],
    targets: Sequence[float],
    candidates: Iterable[dict],
    cbs_errors: Callable[[TrajectoryParams], list[float]],
) -> list[TruthFit]:
    """Every candidate (a dict of `TrajectoryParams` fields over `base`) with its loss curve
    refitted to the static rows and scored on static + CBS rows; best (smallest RMS) first."""
    fits = []
    for fields in candidates:
        params = fit_loss_curve(replace(base, **fields), seq_len, rows, targets)
        fits.append(score_truth(params, seq_len, rows, targets, cbs_errors))
    return sorted(fits, key=lambda f: f.rms)


# ------------------------------------------------------------------ the presets' published rows


def preset_static_rows(preset, planner=None) -> list[StaticRow]:
    """Static rows of a `core.presets.Preset`, each batch on its fastest plan (COPUS §6.1)."""
    from copus.core.sim.scenario import Planner, preset_scenario

    planner = planner or Planner(preset_scenario(preset))
    rows = []
    for label, minutes in preset.published_minutes.items():
        if not label.startswith("Static GBS="):
            continue
        batch = int(label.split("=")[1])
        plan = planner.fastest_plan(batch)
        if plan is None:
            continue
        step_s = float(
            np.asarray(
                planner.step_time_model.predict(
                    *(np.array([v]) for v in (plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches))
                )
            ).ravel()[0]
        )
        rows.append(StaticRow(batch, step_s, tuple(minutes)))
    return rows


def preset_cbs_errors(preset, seed: int = 0) -> Callable[[TrajectoryParams], list[float]]:
    """params -> log(simulated/published) minutes of the preset's two CBS rows (simulated with
    `params` as the truth, same seed and settings as `copus simulate --preset`)."""
    from copus.core.sim.compare import compare_policies
    from copus.core.sim.scenario import Planner, preset_scenario
    from copus.core.sim.table1 import simulated_run_for

    def errors(params: TrajectoryParams) -> list[float]:
        sc = preset_scenario(preset, seed=seed, trajectory=params)
        cmp_ = compare_policies(sc, ("cbs",), planner=Planner(sc))
        targets = sorted(preset.target_losses, reverse=True)
        errs = []
        for label, minutes in preset.published_minutes.items():
            if label.startswith("CBS ("):
                run = simulated_run_for(label, cmp_)
                sim = [
                    None if run is None or run.time_to_target_s[t] is None else run.time_to_target_s[t] / 60.0
                    for t in targets
                ]
                errs += _log_errors(zip(minutes, sim))
        return errs

    return errors
