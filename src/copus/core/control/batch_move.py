"""Batch-only moves scored by the goodput *expected under the posterior over c* (issue 26).

COPUS's switching margin (10 %, §6.1) guards every change, including a batch change on the same
layout, which costs nothing but a recovery transient. The goodput curve is flat near its
maximum, so neighbouring batches rarely differ by 10 %: the simulated controller sat at B = 64
for 55 minutes of a 74-minute 3B run while the best batch grew past 128, each step +0.5 … +3.8 %
short of the margin (docs/robust-goodput.md, "why the default lost"). Here a batch move on the
current layout needs only `batch_margin` (default 2 %) over the current plan, in

    Ḡ(plan) = Σ_k p(c_k) · throughput(plan) · E(B; c_k·φ)        (E: McCandlish Eq. 2.11)

the goodput expected under the posterior `p(c)` (`core.stats.calibration_posterior`), so a move
that pays at the median c but loses at the plausible small c is not taken. A fixed c is the
one-point posterior. Layout changes keep the full margin and the amortised reconfiguration
cost (`core.plan.search.evaluate`).
"""

from __future__ import annotations

import math

import numpy as np

from copus.core.plan.goodput import CandidateSet, goodput
from copus.core.plan.plan import ParallelPlan

MIN_WEIGHT = 1e-4  # posterior points lighter than this are left out of the sum


def expected_goodput(
    step_s: np.ndarray,
    batches: np.ndarray,
    b_noise: float,
    c_values: np.ndarray,
    weights: np.ndarray,
    *,
    lr_aware: np.ndarray,
    lr_ref_batch: float,
) -> np.ndarray:
    """Ḡ = Σ_k w_k · goodput(step_s, B, c_k·φ, lr_aware_k) over the posterior's points
    (c_k, lr_aware_k) (weights renormalised over those ≥ MIN_WEIGHT)."""
    w = np.asarray(weights, dtype=float).reshape(-1)
    keep = w >= MIN_WEIGHT
    c = np.asarray(c_values, dtype=float).reshape(-1)[keep]
    lr = np.broadcast_to(np.asarray(lr_aware, dtype=bool).reshape(-1), w.shape)[keep]
    w = w[keep] / w[keep].sum()
    out = np.zeros(len(batches))
    for ck, wk, lk in zip(c, w, lr):
        # goodput is per-sample efficiency × samples/s; the LR factor is relative to
        # lr_ref_batch so that the two forms compare on one scale
        out += wk * goodput(step_s, batches, float(ck) * b_noise, lr_aware=bool(lk), lr_ref_batch=lr_ref_batch)
    return out


def best_batch_move(
    candidates: CandidateSet,
    step_s: np.ndarray,
    current: ParallelPlan,
    b_noise: float,
    c_values: np.ndarray,
    weights: np.ndarray,
    *,
    batch_margin: float,
    max_growth: float,
    min_batch: int,
    max_batch: int,
    allow_shrink: bool,
    lr_aware: np.ndarray | bool,
    lr_ref_batch: float,
    uncertainty: np.ndarray | None = None,
    current_uncertainty: float = 0.0,
    step_confidence: float = 0.0,
) -> tuple[int, float, float] | None:
    """(candidate index, expected gain, required gain) of the best same-layout plan whose
    expected goodput beats the current plan's by more than batch_margin + step_confidence ·
    sqrt(u_current² + u_best²) (the step times' relative uncertainty, `core.step_uncertainty`,
    as in `core.plan.search.evaluate`); None when none does (or the current plan is not a
    candidate)."""
    cur_i = candidates.index_of(current)
    if cur_i is None or not (math.isfinite(b_noise) and b_noise > 0):
        return None
    b = candidates.global_batch_size.astype(float)
    cur_b = float(current.global_batch_size)
    mask = (
        (candidates.dp == current.dp)
        & (candidates.tp == current.tp)
        & (candidates.pp == current.pp)
        & (b >= min_batch)
        & (b <= max_batch)
        & (b <= max_growth * cur_b + 1e-9)
        & np.isfinite(step_s)
        & (step_s > 0)
    )
    if not allow_shrink:
        mask &= b >= cur_b
    idx = np.flatnonzero(mask)
    if len(idx) == 0:
        return None
    g = expected_goodput(step_s[idx], b[idx], b_noise, c_values, weights, lr_aware=lr_aware, lr_ref_batch=lr_ref_batch)
    g_cur = float(
        expected_goodput(
            step_s[[cur_i]], b[[cur_i]], b_noise, c_values, weights, lr_aware=lr_aware, lr_ref_batch=lr_ref_batch
        )[0]
    )
    j = int(np.argmax(g))
    gain = float(g[j]) / g_cur - 1.0 if g_cur > 0 else math.inf
    u_best = float(uncertainty[idx[j]]) if uncertainty is not None else 0.0
    required = batch_margin + step_confidence * math.hypot(current_uncertainty, u_best)
    if int(idx[j]) == cur_i or not gain > required:
        return None
    return int(idx[j]), gain, required
