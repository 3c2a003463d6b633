"""What a batch experiment is worth to the planning controller, and what it costs
(docs/robust-goodput.md §6.9): a preposterior analysis on the plan's own grid. Pure numpy.

**Loss of a choice.** With weights v over the hypotheses c_j the plan takes, at each point m of
the rest of the run, the batch B̂_m(v) with the highest expected relative rate
Σ_j v_j r_jm(B)/r*_jm; if c_k is the truth that choice loses

    L_k(v) = Σ_m ΔE_km · (1/r_km(B̂_m(v)) − 1/r*_km)        (seconds; ΔE_km: the grid's stretches)

**What the experiment would teach.** A move B_now → B_x changes the loss per step by the factor
(B_x/B_now)·ρ_c, ρ_c = E_c(B_x)/E_c(B_now) = (cφ + B_now)/(cφ + B_x). Read under c_j's clock
while c_k is the truth, the slope of the loss against the clock bends at the move by
δ_jk = g·(B_x/B_now)·|ρ_k − ρ_j| (g = |dL/dstep| now). The posterior fits a quadratic over a
window of h steps either side of the move (`window_steps`); a bend δ at the window's middle
leaves a residual of rms κ·δ·h after the best quadratic (κ = 0.072: |x| on [−1, 1] less its
projection on 1 and x², Legendre). The loss curve's own cubic term leaves a misfit m that does
not average out (it bends the reading, not its noise), so only the bend beyond it counts; over
n = 2h steps of loss noise σ the expected log-likelihood ratio of c_j against c_k is −z²_jk/2:

    z²_jk = n · max(κ·δ_jk·h − m, 0)² / σ²

and the posterior after the experiment, c_k the truth, is a draw: the window reads one number,
the bend, in noise, so with d_jk = sign(ρ_j − ρ_k)·z_jk (|d_jk| = z_jk; the hypotheses lie on
one line, ordered by ρ) and the outcome's standard normal ε,

    p(j | k, ε) ∝ p_j · exp(−d²_jk/2 + ε·d_jk)

averaged over ε at `OUTCOME_POINTS` equal-mass points (the normal's quantiles at (q + ½)/Q: the
choice is a step function of ε, which a Gauss–Hermite rule's few heavy central points resolve
badly; docs/robust-goodput.md §6.29). Its mean over ε is the expected log-likelihood ratio
−z²_jk/2. Taking only that mean (`OUTCOME_POINTS = 1`: the expected outcome, §6.9–§6.28) tilts
the posterior toward the truth for any z > 0: where the plan's choice is a near-tie, a window
that carries almost no information was priced as if it always broke the tie the right way.
g, σ and m from the losses of the steps at the current batch (`CalibrationPosterior.loss_trend`).

**Value and cost.** V = Σ_k p_k E_ε[L_k(p) − L_k(p(· | k, ε))] (≥ 0 up to the approximations:
the plan after the experiment is the batch choice at every later point, without later
experiments); C = the expected time lost over the experiment's window at B_x instead of the
chosen B_i, C = n_w · s_x · Σ_k p_k (1 − r_k(B_x)/r_k(B_i)), with n_w = skip + read steps + the
lag line's lag (the batch is held until the window closes, §6.29).
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np

# equal-mass points over the window's outcome ε ~ N(0, 1), even: no point at ε = 0, where a
# near-tie is broken the right way whatever z (1: the expected outcome only, before §6.29)
OUTCOME_POINTS = 8
KAPPA = float(np.sqrt(1.0 / 3.0 - 1.0 / 4.0 - 5.0 / 64.0))  # rms of |x| − its best quadratic on [−1, 1]


def choice_loss(rates: np.ndarray, de: np.ndarray, v: np.ndarray) -> np.ndarray:
    """L_k(v) per truth k (module docstring) from `rates` (K, G, N): ΔE/s of N plans at grid
    point m under hypothesis k; `de` (K, G): ΔE of each stretch; `v` (K,): the choice's weights."""
    best = rates.max(axis=2)
    rel = rates / np.maximum(best, 1e-300)[..., None]
    pick = np.argmax(np.einsum("k,kgn->gn", v, rel), axis=1)  # B̂_m(v)
    r_hat = rates[:, np.arange(rates.shape[1]), pick]
    slow = np.where(r_hat > 0, 1.0 / np.maximum(r_hat, 1e-300), np.inf) - 1.0 / np.maximum(best, 1e-300)
    return np.sum(de * np.where(np.isfinite(slow), slow, 0.0), axis=1)


def separation(
    bc_now: np.ndarray,
    b_now: float,
    b_x: float,
    slope: float,
    sigma: float,
    half: int,
    misfit: float = 0.0,
    lr_ratio: np.ndarray | float = 1.0,
) -> np.ndarray:
    """d_jk (K, K) of the module docstring (d²_jk = z²_jk) for the move B_now → B_x at cφ = `bc_now`;
    `lr_ratio`: each hypothesis's LR factor at B_x over B_now (the sqrt rule's rows; 1: re-tuned)."""
    rho = (bc_now + b_now) / (bc_now + b_x) * lr_ratio
    gap = rho[:, None] - rho[None, :]  # ρ_j − ρ_k
    delta = slope * (b_x / b_now) * np.abs(gap)
    z = np.sqrt(2 * half) * np.maximum(KAPPA * delta * half - misfit, 0.0) / max(sigma, 1e-12)
    return np.sign(gap) * z


def outcome_points(points: int = OUTCOME_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """(ε, weights) for E over ε ~ N(0, 1): the quantiles at (q + ½)/Q, weight 1/Q each (Q = 1: ε = 0)."""
    q = max(int(points), 1)
    eps = np.array([NormalDist().inv_cdf((i + 0.5) / q) for i in range(q)])
    return eps, np.full(q, 1.0 / q)


def value(rates: np.ndarray, de: np.ndarray, w: np.ndarray, d: np.ndarray, points: int | None = None) -> float:
    """V = Σ_k p_k E_ε[L_k(p) − L_k(p(· | k, ε))], p(j | k, ε) ∝ p_j exp(−d²_jk/2 + ε·d_jk)."""
    now = choice_loss(rates, de, w)
    gain = 0.0
    for e, we in zip(*outcome_points(OUTCOME_POINTS if points is None else points), strict=True):
        for k in range(len(w)):
            log_l = -0.5 * d[:, k] ** 2 + e * d[:, k]
            post = w * np.exp(log_l - log_l.max())
            gain += we * w[k] * (now[k] - choice_loss(rates, de, post / post.sum())[k])
    return max(float(gain), 0.0)


def window_cost(r_x: np.ndarray, r_i: np.ndarray, step_s: float, steps: int, w: np.ndarray) -> float:
    """C: `steps` steps of `step_s` at rates `r_x` instead of `r_i` (per c_k), expected."""
    lost = 1.0 - r_x / np.maximum(r_i, 1e-300)
    return float(steps * step_s * (w @ lost))
