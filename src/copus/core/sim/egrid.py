"""Deterministic runs on a grid of effective samples: baselines and the honest ceiling.

A run that knows the ground truth (`core.sim.trajectory`) and the step time of every plan
needs no step-by-step simulation: on a geometric grid E_0 < E_1 < … of effective samples (up to
the lowest target), the steps spent between E_k and E_k+1 at batch B are

    n = (E_k+1 − E_k) / ΔE(B, L(E_mid), tokens_mid)              (McCandlish et al. 2018, §2.2)

and they add n·step_s seconds and n·B·seq_len tokens. The midpoint rule in E (as in
`oracle.switch_aware_minutes`) and a predictor for the tokens at the midpoint (they only matter
in the sqrt-LR truth's warm-up) make it accurate to ~0.1 % against the stepwise simulator.

- `fixed_runs_minutes`: K runs at once, each a batch that is a function of the tokens seen
  (a static batch, or a token-denominated schedule), each batch on its fastest plan; a change of
  layout pays `switch_cost_s`.
- `ceiling_minutes`: the one-run, switch-paying dynamic programme. With r_L the best ΔE/step_s
  over the candidates of layout L (the batch moves freely inside a layout),

      f_L(E_k+1) = min(f_L(E_k), min_L' f_L'(E_k) + C) + (E_k+1 − E_k) / r_L(E_mid)

  and each layout carries the tokens of its own best path (so the warm-up reads the path's own
  tokens, not another run's).

The fair start: when a step at tokens = 0 makes no progress (the LR warm-up starts at 0), every
run pays that step at its own first batch; the ceiling pays it at the controllers' initial
batch, on any layout that can host it (the start layout is a decision; the start batch is not).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from copus.core.sim.trajectory import Trajectory, TrajectoryParams

GRID_POINTS = 4000


@dataclass(frozen=True, slots=True)
class Menu:
    """The fastest plan of every (layout, batch) pair of a candidate grid."""

    batches: np.ndarray  # global batch (samples)
    step_s: np.ndarray  # the fastest plan's predicted seconds per step
    layout: np.ndarray  # layout id (dense 0..n_layouts−1)
    layouts: tuple[tuple[int, int, int], ...]  # (dp, tp, pp) of each id

    @classmethod
    def from_candidates(cls, cands, step_s: np.ndarray) -> Menu:
        """Reduce a `core.plan.goodput.CandidateSet` and its step times to (layout, batch)."""
        step_s = np.asarray(step_s, dtype=float)
        ok = np.isfinite(step_s) & (step_s > 0)
        keys = np.stack([cands.dp[ok], cands.tp[ok], cands.pp[ok]], axis=1)
        uniq, lay = np.unique(keys, axis=0, return_inverse=True)
        lay = lay.reshape(-1)
        gbs, sec = cands.global_batch_size[ok].astype(np.int64), step_s[ok]
        order = np.lexsort((sec, gbs, lay))  # fastest first within (layout, batch)
        lay, gbs, sec = lay[order], gbs[order], sec[order]
        first = np.ones(len(lay), bool)
        first[1:] = (lay[1:] != lay[:-1]) | (gbs[1:] != gbs[:-1])
        return cls(
            batches=gbs[first].astype(float),
            step_s=sec[first],
            layout=lay[first],
            layouts=tuple(tuple(int(v) for v in row) for row in uniq),
        )

    def fastest(self, batch: float) -> int | None:
        """Index of the fastest entry at exactly `batch` (None if no layout hosts it)."""
        hit = np.flatnonzero(self.batches == batch)
        return None if not hit.size else int(hit[np.argmin(self.step_s[hit])])

    def fastest_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(batches, step_s, layout) of the fastest plan of every batch, batches ascending."""
        order = np.lexsort((self.step_s, self.batches))
        b = self.batches[order]
        keep = np.ones(len(b), bool)
        keep[1:] = b[1:] != b[:-1]
        idx = order[keep]
        return self.batches[idx], self.step_s[idx], self.layout[idx]


def _grid(traj: Trajectory, targets: Sequence[float], points: int):
    """(edges, sorted targets descending, their effective samples); None if unreachable."""
    order = sorted(targets, reverse=True)
    goals = [traj.progress_for_loss(t) for t in order]
    if not all(np.isfinite(goals)):
        return None
    e_max = max(max(goals), 1e-9)
    lo = min(1e-3 * traj.params.progress_scale_samples, 0.5 * e_max)
    edges = np.concatenate([[0.0], np.geomspace(lo, e_max, points)])
    return edges, order, goals


def _zero_progress_start(traj: Trajectory) -> bool:
    """Does a step at tokens = 0 make no progress (an LR warm-up that starts at 0)?"""
    return traj.params.lr_warmup_tokens > 0 and traj.params.lr_model != "lr-tuned"


def _steps(traj: Trajectory, batch: np.ndarray, loss: float, tokens: np.ndarray, de: float) -> np.ndarray:
    """Steps to gain `de` effective samples at `batch` from `tokens` (midpoint tokens by one
    predictor step); inf where a step makes no progress."""
    seq = traj.seq_len
    gain = np.asarray(traj.progress_per_step(batch, loss, tokens), dtype=float)
    n0 = np.where(gain > 0, de / np.where(gain > 0, gain, 1.0), np.inf)
    if traj.params.lr_warmup_tokens > 0 and np.any(tokens < traj.params.lr_warmup_tokens):
        mid = tokens + 0.5 * np.minimum(n0, 1e12) * batch * seq
        gain = np.asarray(traj.progress_per_step(batch, loss, mid), dtype=float)
    return np.where(gain > 0, de / np.where(gain > 0, gain, 1.0), np.inf)


def critical_batch_of_progress(traj: Trajectory, progress: np.ndarray) -> np.ndarray:
    """B_crit(L(E)) in samples for an array of effective samples (`Trajectory.critical_batch`)."""
    p = traj.params
    loss = p.final_loss + (p.initial_loss - p.final_loss) * (
        1.0 + np.maximum(progress, 0.0) / p.progress_scale_samples
    ) ** (-p.loss_exponent)
    return np.maximum(
        p.bcrit_star_tokens / np.maximum(loss, 1e-6) ** (1.0 / p.bcrit_exponent) / traj.seq_len, p.min_bcrit_samples
    )


def _gain(traj: Trajectory, batch: np.ndarray, progress: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """One step's effective samples for every run at once (`Trajectory.progress_per_step`
    with a loss per run): ΔE = B·B_crit/(B_crit + B) [· (2x − x²) under the sqrt-LR truth]."""
    from copus.core.stats.lr_progress import sqrt_lr_progress_factor

    p = traj.params
    bcrit = critical_batch_of_progress(traj, progress)
    tuned = batch * bcrit / (bcrit + batch)
    if p.lr_model == "lr-tuned":
        return tuned
    return tuned * sqrt_lr_progress_factor(
        batch,
        bcrit,
        p.lr_fraction_x0,
        ref_batch=p.lr_ref_batch,
        exponent=p.lr_opt_exponent,
        tokens=tokens,
        warmup_tokens=p.lr_warmup_tokens,
    )


STEPWISE_MAX = 20_000  # steps of the exact head of a fixed run
SMOOTH = 0.01  # the head ends once a step changes the gain by < 1 %


def _stepwise_head(traj: Trajectory, menu_lookup, batch_of, runs: int, goals, order, out, col):
    """March every run step by step, as the simulator does, through the LR warm-up and while a
    step changes its gain by ≥ 1 % (a near-stall after the warm-up, where the gain crawls up
    from ~0 and the grid's midpoint rule would run ahead). Returns (progress, tokens, wall,
    batch, step_s, layout) where each run left the head."""
    seq, warm = traj.seq_len, traj.params.lr_warmup_tokens
    e, tok, wall = np.zeros(runs), np.zeros(runs), np.zeros(runs)
    batch = np.asarray(batch_of(tok, e), dtype=float)
    step, lay = menu_lookup(batch)
    active = np.isfinite(step)
    prev = np.full(runs, np.nan)
    for _ in range(STEPWISE_MAX):
        if not active.any():
            break
        g = _gain(traj, batch, e, tok)
        e = np.where(active, e + g, e)
        tok = np.where(active, tok + batch * seq, tok)
        wall = np.where(active, wall + step, wall)
        for k, goal in enumerate(goals):
            newly = active & (e >= goal) & np.isnan(out[:, col[order[k]]])
            out[newly, col[order[k]]] = wall[newly] / 60.0
        smooth = (g > 0) & (np.abs(g - prev) <= SMOOTH * g)
        stalled = (tok >= warm) & ~(g > 0)  # x ≥ 2 past the warm-up: never moves again
        wall = np.where(active & stalled, np.inf, wall)
        active &= ~((tok >= warm) & (smooth | stalled)) & (e < goals[-1])
        prev = g
        nb = np.asarray(batch_of(tok, e), dtype=float)
        moved = active & (nb != batch)
        if moved.any():
            new_step, new_lay = menu_lookup(nb)
            wall = np.where(moved & (new_lay != lay), wall + menu_lookup.switch_cost_s, wall)
            batch, step, lay = (
                np.where(moved, nb, batch),
                np.where(moved, new_step, step),
                np.where(moved, new_lay, lay),
            )
    return e, tok, wall, batch, step, lay


def fixed_runs_minutes(
    params: TrajectoryParams,
    seq_len: int,
    menu: Menu,
    batch_of: Callable[[np.ndarray, np.ndarray], np.ndarray],
    runs: int,
    targets: Sequence[float],
    switch_cost_s: float = 0.0,
    points: int = GRID_POINTS,
) -> np.ndarray:
    """Minutes to each target (shape runs × len(targets), NaN = missed) of `runs` runs whose
    batch is `batch_of(tokens, progress)` (an array of `runs` batches from their tokens and
    effective samples so far), each batch
    on its fastest plan; a layout change pays `switch_cost_s`. A batch no layout hosts: missed.

    The head of each run is marched step by step (`_stepwise_head`), the rest on the grid."""
    traj = Trajectory(params, seq_len)
    out = np.full((runs, len(targets)), np.nan)
    g = _grid(traj, targets, points)
    if g is None:
        return out
    edges, order, goals = g
    tb, ts, tl = menu.fastest_table()

    def lookup(b: np.ndarray):
        i = np.clip(np.searchsorted(tb, b), 0, len(tb) - 1)
        ok = tb[i] == b
        return np.where(ok, ts[i], np.inf), np.where(ok, tl[i], -1)

    lookup.switch_cost_s = switch_cost_s
    col = {t: targets.index(t) for t in order}
    e0, tokens, wall, batch, step, lay = _stepwise_head(traj, lookup, batch_of, runs, goals, order, out, col)
    k = 0
    for lo, hi in zip(edges[:-1], edges[1:]):
        de = np.clip(hi - np.maximum(lo, e0), 0.0, None)
        if not de.any():
            continue
        nb = np.asarray(batch_of(tokens, np.maximum(lo, e0)), dtype=float)
        if np.any(nb != batch):
            new_step, new_lay = lookup(nb)
            wall += np.where((new_lay != lay) & (nb != batch), switch_cost_s, 0.0)
            batch, step, lay = nb, new_step, new_lay
        mid = np.maximum(lo, e0) + 0.5 * de
        gain = _gain(traj, batch, mid, tokens)
        n = np.where(de > 0, de / np.where(gain > 0, gain, np.nan), 0.0)
        n = np.where(np.isnan(n), np.inf, n)
        wall = wall + n * step
        tokens = tokens + np.where(np.isfinite(n), n * batch * seq_len, 0.0)
        while k < len(goals) and hi >= goals[k]:
            c = col[order[k]]
            fresh = np.isnan(out[:, c])
            out[fresh, c] = np.where(np.isfinite(wall[fresh]), wall[fresh] / 60.0, np.nan)
            k += 1
    return out


def ceiling_minutes(
    params: TrajectoryParams,
    seq_len: int,
    menu: Menu,
    initial_batch: float,
    targets: Sequence[float],
    switch_cost_s: float,
    points: int = GRID_POINTS,
) -> list[float | None]:
    """Minutes to each target of the one-run, switch-paying dynamic programme (module
    docstring), starting like the controllers: at `initial_batch` on a zero-progress first step,
    on any layout (the start layout is a decision)."""
    traj = Trajectory(params, seq_len)
    g = _grid(traj, targets, points)
    if g is None:
        return [None] * len(targets)
    edges, order, goals = g
    n_lay = len(menu.layouts)
    by_lay = np.argsort(menu.layout, kind="stable")
    b, s, lay = menu.batches[by_lay], menu.step_s[by_lay], menu.layout[by_lay]
    starts = np.flatnonzero(np.r_[True, lay[1:] != lay[:-1]])
    present = lay[starts]
    f = np.zeros(n_lay)
    tokens = np.zeros(n_lay)
    if _zero_progress_start(traj):
        f[:] = np.inf
        at0 = b == initial_batch
        np.minimum.at(f, lay[at0], s[at0])
        if not np.isfinite(f).any():
            return [None] * len(targets)
        f = np.where(np.isfinite(f), f, f.min() + switch_cost_s)
        tokens[:] = initial_batch * seq_len
    hit: dict[float, float] = {}
    k = 0
    for lo, hi in zip(edges[:-1], edges[1:]):
        best = int(np.argmin(f))
        move = f.min() + switch_cost_s < f
        f = np.where(move, f.min() + switch_cost_s, f)
        tokens = np.where(move, tokens[best], tokens)
        n = _steps(traj, b, traj.loss(0.5 * (lo + hi)), tokens[lay], hi - lo)
        sec = n * s
        fastest = np.minimum.reduceat(sec, starts)
        dt = np.full(n_lay, np.inf)
        dt[present] = fastest
        pick = np.zeros(n_lay, dtype=np.int64)
        # the chosen entry of each layout (first entry at its minimum)
        is_min = sec == np.repeat(fastest, np.diff(np.r_[starts, len(sec)]))
        first_min = np.maximum.reduceat(np.where(is_min, -np.arange(len(sec)), -len(sec)), starts)
        pick[present] = -first_min
        f = f + dt
        tokens = tokens + np.where(np.isfinite(dt), n[pick] * b[pick], 0.0) * seq_len
        while k < len(goals) and hi >= goals[k]:
            hit[order[k]] = float(f.min()) / 60.0
            k += 1
    return [hit[t] if t in hit and math.isfinite(hit[t]) else None for t in targets]
