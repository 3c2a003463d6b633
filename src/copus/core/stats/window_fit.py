"""How one calibration window's losses score each hypothesis c (and loss exponent α): the
window likelihood of the posterior over c (`core.stats.calibration_posterior`, whose docstring
states the model; docs/robust-goodput.md §6.10, §6.12).

For every c on the grid the clock E_c(t) = Σ_{i≤t} ΔE_i(c) puts the window's losses on one
axis; the right c leaves no bend where the batch changed. The losses are fitted by weighted least
squares as a power law L ≈ a + b·(E_c + E_0)^(−α) (Kaplan et al. 2020, L(D), with the offset E_0 of a
curve that starts from a finite loss) per (α, E_0), and/or as a quadratic in log E_c; the profile
likelihood with the noise level unknown is −(n/2)·log WRSS(c).

With `loss_offsets` (a variant, none by default: §6.27) the offset is E_0 = f·E_c(t_first), a
fraction of the clock at the first step the posterior read (`first_clock`). A loss curve starts
from a finite loss: the simulator's truths fall as L_∞ + (L_0 − L_∞)(1 + E/E_0)^(−α)
(`core.sim.trajectory`), which an early window (E within a few E_0) cannot fit as a power law
from E = 0; a clock warped by a wrong c fits it better, and the window read c 5–13× high
(docs/robust-goodput.md §6.27). E_0 is bounded by the first read's clock: the curve's first phase
is over by then (the posterior reads after the noise scale's warm-up).
Pure numpy; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class WindowStep:
    """One step in a calibration window: its loss, batch, noise scale, and the clock E_c after it."""

    loss: float
    batch: float
    b_noise: float
    fit: bool  # False: inside the transient after a change (clock only)
    clock: np.ndarray  # E_c since the run's start, every grid c, after this step


def window_log_likelihood(
    steps: list[WindowStep],
    log2_grid: np.ndarray,
    min_fit_steps: int = 12,
    lr_exponents: tuple[float, ...] = (0.0,),
    loss_exponents: tuple[float, ...] = (),
    with_quadratic: bool = False,
    effective_n: bool = True,
    loss_offsets: tuple[float, ...] = (0.0,),
    first_clock: np.ndarray | None = None,
) -> np.ndarray | None:
    """log p(losses | γ, (α, f), c) on the grid, shape (len(lr_exponents), len(loss_exponents) ·
    len(loss_offsets) (α-major; 1 without exponents), len(log2_grid)) (module docstring); None if
    too few fitted steps or no change of batch.

    Clock: E(t) = Σ_{i≤t} B_i^γ · B_i·cφ_i/(cφ_i + B_i) since the run's first step. Fit, weights
    B_i, over the steps with `fit`: L_i ≈ a + b·((E_i + E_0)/Ē)^(−α) for each α in `loss_exponents`
    and E_0 = f·`first_clock` (per γ, c) for each f in `loss_offsets` (Ē the window's geometric
    mean of E + E_0; f = 0 or no `first_clock`: no offset), or with `loss_exponents` empty
    L_i ≈ a + b·x_i + q·x_i², x = log E centred and scaled; −(n/2)·log WRSS. `with_quadratic`:
    both, averaged per window, p = p_power(α) + p_quadratic/sqrt(n) (the quadratic's third parameter priced as in BIC).
    `effective_n`: the log-likelihood × n_eff/n (`effective_fraction` of the best fit's
    residuals): a window whose best fit leaves smooth, correlated residuals is misspecified and
    counts as the few independent residuals it has, not as n (docs/robust-goodput.md §6.23).
    """
    fit = np.array([s.fit for s in steps])
    n = int(fit.sum())
    batches = np.array([s.batch for s in steps])
    if n < min_fit_steps or len(set(batches.tolist())) < 2:
        return None
    loss = np.array([s.loss for s in steps])[fit]
    logs = np.log(np.maximum(np.stack([s.clock for s in steps])[fit], 1e-12))  # (n, K, G)
    w = batches[fit] / np.mean(batches[fit])
    quad = None
    if with_quadratic or not loss_exponents:
        wrss = _quadratic_wrss(loss, logs.reshape(n, -1), w).reshape(logs.shape[1], 1, logs.shape[2])
        quad = -0.5 * n * np.log(np.maximum(wrss, 1e-300))
    shifted = [_offset_log_clock(logs, f, first_clock) for f in loss_offsets] if loss_exponents else []
    if not loss_exponents:
        out = quad
    else:
        out = _power_or_average(loss, shifted, w, n, loss_exponents, quad)
    if effective_n:
        out = out * effective_fraction(_best_residuals(loss, logs, w, out, loss_exponents, shifted))
    return out - np.max(out)


def _offset_log_clock(logs: np.ndarray, fraction: float, first_clock: np.ndarray | None) -> np.ndarray:
    """log(E + E_0), E_0 = fraction·first_clock per (γ, c) column; `logs` (n, K, G) unchanged
    for fraction 0 or no first clock."""
    if fraction <= 0 or first_clock is None:
        return logs
    return np.logaddexp(logs, np.log(np.maximum(fraction * first_clock, 1e-12))[None])


def _power_or_average(
    loss: np.ndarray, shifted: list[np.ndarray], w: np.ndarray, n: int, loss_exponents: tuple[float, ...], quad
) -> np.ndarray:
    """The power law's −(n/2)·log WRSS per (γ, (α, E_0), c), α-major over `shifted` (one
    log(E + E_0) per offset), averaged with the quadratic's if given."""
    wrss = np.stack([_power_law_wrss(loss, s, w, a) for a in loss_exponents for s in shifted], axis=1)
    out = -0.5 * n * np.log(np.maximum(wrss, 1e-300))
    if quad is not None:  # the two fits averaged, the quadratic's extra parameter priced (BIC)
        out = np.logaddexp(out, quad - 0.5 * math.log(n))
    return out


def _best_residuals(
    loss: np.ndarray,
    logs: np.ndarray,
    w: np.ndarray,
    out: np.ndarray,
    loss_exponents: tuple[float, ...],
    shifted: list[np.ndarray],
) -> np.ndarray:
    """Weighted residuals of the most likely (γ, (α, E_0), c): its power law, or its quadratic."""
    k, j, g = np.unravel_index(int(np.argmax(out)), out.shape)
    if loss_exponents:
        a, f = divmod(int(j), len(shifted))
        return _power_law_residuals(loss, shifted[f][:, k, g], w, loss_exponents[a])
    return _quadratic_residuals(loss, logs[:, k, g], w)


def effective_fraction(resid: np.ndarray) -> float:
    """n_eff / n = (1 − ρ)/(1 + ρ), ρ ∈ [0, 0.98] the lag-1 autocorrelation of the best fit's
    residuals: the number of independent residuals of an AR(1) sequence (Bartlett 1946). White
    residuals (noise-limited window) keep their full weight; a smooth misfit counts as few."""
    r = resid - resid.mean()
    den = float(r @ r)
    rho = float(r[1:] @ r[:-1]) / den if den > 0 else 0.0
    rho = min(max(rho, 0.0), 0.98)
    return (1.0 - rho) / (1.0 + rho)


def _power_law_residuals(loss: np.ndarray, log_clock: np.ndarray, w: np.ndarray, alpha: float) -> np.ndarray:
    """Weighted residuals √w·(L − a − b·u) of one column's power-law fit (`_power_law_wrss`)."""
    u = np.exp(-alpha * (log_clock - log_clock.mean()))
    sw = np.sqrt(w)
    design = np.stack([np.ones_like(u), u], axis=1) * sw[:, None]
    coef, *_ = np.linalg.lstsq(design, loss * sw, rcond=None)
    return loss * sw - design @ coef


def _power_law_wrss(loss: np.ndarray, logs: np.ndarray, w: np.ndarray, alpha: float) -> np.ndarray:
    """Weighted residual sum of squares of L ≈ a + b·u, u = exp(−α·(log E − mean log E)), for
    every grid column of `logs` (n, K, G) at once: WRSS = S_LL − S_uL²/S_uu on w-centred sums."""
    u = np.exp(-alpha * (logs - logs.mean(axis=0)))
    sw = w.sum()
    uc = u - np.tensordot(w, u, axes=1) / sw
    lc = loss - float(w @ loss) / sw
    s_uu = np.tensordot(w, uc * uc, axes=1)
    s_ul = np.tensordot(w * lc, uc, axes=1)
    return float(w @ (lc * lc)) - s_ul * s_ul / np.maximum(s_uu, 1e-300)


def _quadratic_wrss(loss: np.ndarray, clocks: np.ndarray, w: np.ndarray) -> np.ndarray:
    """WRSS of L ≈ a + b·x + q·x², x = log E centred and scaled, per column of `clocks` (n, M)."""
    out = np.empty(clocks.shape[1])
    for k in range(clocks.shape[1]):
        resid = _quadratic_residuals(loss, clocks[:, k], w)
        out[k] = float(resid @ resid)
    return out


def _quadratic_residuals(loss: np.ndarray, log_clock: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted residuals √w·(L − a − b·x − q·x²) of one column's quadratic fit in x = log E."""
    sw = np.sqrt(w)
    x = log_clock - log_clock.mean()
    x = x / max(float(np.ptp(x)), 1e-12)
    design = np.stack([np.ones_like(x), x, x * x], axis=1) * sw[:, None]
    coef, *_ = np.linalg.lstsq(design, loss * sw, rcond=None)
    return loss * sw - design @ coef
