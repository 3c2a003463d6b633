"""Deliberate calibration excursions: a short step to a larger batch when the posterior over c
cannot tell the batches apart and the run's own changes do not teach it (issue 26).

The run's own growth steps (1.4–2×) move the posterior too little against the loss noise when
c is large (docs/robust-goodput.md §4, cause 2). An excursion runs `steps` steps at
B' = `factor`·B on the current layout; its loss around the change is one more natural
experiment (`core.stats.calibration_posterior`), and its tokens still train the model. It is
taken only when its expected value exceeds its expected cost, both in units of "steps of
goodput at the current plan":

    cost  = steps · max(0, 1 − Ḡ(B')/Ḡ(B))                   (goodput given up while there)
    value = horizon · regret · resolve                         (better decisions afterwards)
    regret = Σ_k p(c_k) · [max_j G_k(j) − G_k(ĵ)] / max_j G_k(j)

where Ḡ is the goodput expected under the posterior (`core.control.batch_move`), G_k the
goodput at c_k over the current layout's batches, ĵ the plan the posterior's expectation picks,
`horizon` the steps the run is expected to last beyond now (taken as the steps so far: a run
lasts at least as long again, the rule stated in the doc) and `resolve` the share of the regret
one experiment removes (½).
"""

from __future__ import annotations

import math

import numpy as np

from copus.core.control.batch_move import expected_goodput
from copus.core.plan.goodput import CandidateSet, goodput
from copus.core.plan.plan import ParallelPlan

RESOLVE = 0.5


def excursion_value(
    candidates: CandidateSet,
    step_s: np.ndarray,
    current: ParallelPlan,
    b_noise: float,
    c_values: np.ndarray,
    weights: np.ndarray,
    *,
    factor: float,
    steps: int,
    horizon_steps: float,
    max_batch: int,
    lr_aware: bool,
    lr_ref_batch: float,
) -> tuple[int, float, float] | None:
    """(candidate index of B', value, cost) of an excursion from `current`, or None when no
    same-layout plan at ≈ factor·B exists or φ is unknown."""
    cur_i = candidates.index_of(current)
    if cur_i is None or not (math.isfinite(b_noise) and b_noise > 0):
        return None
    b = candidates.global_batch_size.astype(float)
    cur_b = float(current.global_batch_size)
    same = (
        (candidates.dp == current.dp)
        & (candidates.tp == current.tp)
        & (candidates.pp == current.pp)
        & np.isfinite(step_s)
        & (step_s > 0)
        & (b <= max_batch)
    )
    up = np.flatnonzero(same & (b > cur_b) & (b <= factor * cur_b + 1e-9))
    idx = np.flatnonzero(same & (b >= cur_b))
    if len(up) == 0 or len(idx) < 2:
        return None
    target = int(up[np.argmax(b[up])])
    w = np.asarray(weights, dtype=float).reshape(-1)
    c = np.asarray(c_values, dtype=float).reshape(-1)
    keep = w >= 1e-4
    w, c = w[keep] / w[keep].sum(), c[keep]
    g = np.stack(
        [goodput(step_s[idx], b[idx], float(ck) * b_noise, lr_aware=lr_aware, lr_ref_batch=lr_ref_batch) for ck in c]
    )  # (k, plans)
    mean = w @ g
    pick = int(np.argmax(mean))
    best = g.max(axis=1)
    regret = float(w @ ((best - g[:, pick]) / np.where(best > 0, best, 1.0)))
    g_cur, g_up = expected_goodput(
        step_s[[cur_i, target]],
        b[[cur_i, target]],
        b_noise,
        c,
        w,
        lr_aware=np.array([lr_aware]),
        lr_ref_batch=lr_ref_batch,
    )
    cost = steps * max(0.0, 1.0 - float(g_up) / float(g_cur)) if g_cur > 0 else math.inf
    value = horizon_steps * regret * RESOLVE
    return target, value, cost
