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

and the posterior after the experiment, c_k the truth, is p(j | k) ∝ p_j · exp(−z²_jk/2)
(the expected outcome, not a draw). g, σ and m from the losses of the steps at the current
batch (`CalibrationPosterior.loss_trend`).

**Value and cost.** V = Σ_k p_k [L_k(p) − L_k(p(· | k))] (≥ 0 up to the approximations: the
plan after the experiment is the batch choice at every later point, without later
experiments); C = the expected time lost over the experiment's window (n_w = skip + read steps)
at B_x instead of the chosen B_i: C = n_w · s_x · Σ_k p_k (1 − r_k(B_x)/r_k(B_i)).
"""

from __future__ import annotations

import numpy as np

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
    bc_now: np.ndarray, b_now: float, b_x: float, slope: float, sigma: float, half: int, misfit: float = 0.0
) -> np.ndarray:
    """z²_jk (K, K) of the module docstring for the move B_now → B_x at cφ = `bc_now`."""
    rho = (bc_now + b_now) / (bc_now + b_x)
    delta = slope * (b_x / b_now) * np.abs(rho[None, :] - rho[:, None])
    return 2 * half * np.maximum(KAPPA * delta * half - misfit, 0.0) ** 2 / max(sigma, 1e-12) ** 2


def value(rates: np.ndarray, de: np.ndarray, w: np.ndarray, z2: np.ndarray) -> float:
    """V = Σ_k p_k [L_k(p) − L_k(p(· | k))], p(j | k) ∝ p_j exp(−z²_jk/2)."""
    now = choice_loss(rates, de, w)
    gain = 0.0
    for k in range(len(w)):
        post = w * np.exp(-0.5 * (z2[:, k] - z2[:, k].min()))
        gain += w[k] * (now[k] - choice_loss(rates, de, post / post.sum())[k])
    return max(float(gain), 0.0)


def window_cost(r_x: np.ndarray, r_i: np.ndarray, step_s: float, steps: int, w: np.ndarray) -> float:
    """C: `steps` steps of `step_s` at rates `r_x` instead of `r_i` (per c_k), expected."""
    lost = 1.0 - r_x / np.maximum(r_i, 1e-300)
    return float(steps * step_s * (w @ lost))
