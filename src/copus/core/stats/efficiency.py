"""Statistical efficiency of a batch size and learning-rate rules on a batch change.

All functions broadcast over numpy arrays (the planner scores thousands of candidates at once);
scalar inputs give numpy scalars (`np.float64` is a `float`).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

LR_RULES = ("none", "linear", "sqrt", "adascale", "sqrt-gain")


def statistical_efficiency(b_noise: ArrayLike, global_batch_size: ArrayLike, ref_batch: ArrayLike = 1.0) -> np.ndarray:
    """Progress per sample at batch B relative to batch B0: E(B) = (b_noise + B0)/(b_noise + B).

    Pollux (Qiao et al., OSDI'21) §3.2, E_t(M) with M0 = B0; COPUS (arXiv 2604.26687) Eq. 6 with
    B0 = 1. Limits: b_noise = inf (pure noise) gives 1; negative b_noise is treated as 0; NaN
    stays NaN. In (0, 1] for B ≥ B0, non-increasing in B.
    """
    phi = np.maximum(np.asarray(b_noise, dtype=float), 0.0)
    batch = np.asarray(global_batch_size, dtype=float)
    ref = np.asarray(ref_batch, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        eff = np.where(np.isposinf(phi), 1.0, (phi + ref) / (phi + batch))
    return eff[()]


def adascale_gain(
    grad_sqnorm: ArrayLike, grad_trace_cov: ArrayLike, scale: ArrayLike, ref_batch: ArrayLike = 1.0
) -> np.ndarray:
    """AdaScale gain r = (σ² + μ²)/(σ²/S + μ²) with σ² = tr(Σ)/B0, μ² = |G|², S = B/B0.

    Johnson et al., ICML 2020, §3 (gain ratio); Pollux's E(B) = r/S. Estimates are clamped to
    the meaningful range (tr(Σ) ≥ 0; |G|² ≤ 0 means no signal, gain = S), and r lies between
    1 and S.
    """
    mu2 = np.asarray(grad_sqnorm, dtype=float)
    sigma2 = np.maximum(np.asarray(grad_trace_cov, dtype=float), 0.0) / np.asarray(ref_batch, dtype=float)
    s = np.asarray(scale, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        gain = np.where(mu2 > 0, (sigma2 + mu2) / (sigma2 / s + mu2), s)
    gain = np.where(np.isnan(mu2) | np.isnan(sigma2), np.nan, gain)
    return np.clip(gain, np.minimum(s, 1.0), np.maximum(s, 1.0))[()]


def lr_scale(
    rule: str,
    new_batch: ArrayLike,
    ref_batch: ArrayLike,
    grad_sqnorm: ArrayLike | None = None,
    grad_trace_cov: ArrayLike | None = None,
) -> np.ndarray:
    """Factor to multiply the learning rate (tuned at `ref_batch`) by at `new_batch`.

    none: 1 (Lau et al. 2025, "optimizer scaling rule: None"); linear: B/B0 (Goyal et al. 2017);
    sqrt: sqrt(B/B0) (Adam's square-root rule, Malladi et al. 2022; COPUS Eq. 9);
    adascale: `adascale_gain` (needs the GNS statistics; while they are NaN, i.e. before the
    estimator has data, the factor is 1 — the gain's conservative end);
    sqrt-gain: sqrt(adascale_gain), the bounded Adam rule of AdaptDL's `AdamScale`
    (`petuum/adaptdl` scaling_rules.py): η ∝ sqrt(r), r = (φ'+1)/(φ'/S+1), φ' = b_noise/B0.
    It follows sqrt(B/B0) while B ≪ b_noise and saturates at sqrt(1 + φ') beyond, as the
    optimal Adam LR does (McCandlish App. E.2: η ∝ B^α, 0.5 < α < 1, only below B_noise;
    Li et al. 2024 "Surge"; cbs-notes §5.2), where plain sqrt keeps growing.
    """
    if rule not in LR_RULES:
        raise ValueError(f"lr_rule={rule!r} is invalid; allowed: {', '.join(LR_RULES)}")
    scale = np.asarray(new_batch, dtype=float) / np.asarray(ref_batch, dtype=float)
    if rule == "none":
        return np.ones_like(scale)[()]
    if rule == "linear":
        return scale[()]
    if rule == "sqrt":
        return np.sqrt(scale)[()]
    if grad_sqnorm is None or grad_trace_cov is None:
        raise ValueError(f"lr_rule={rule!r} needs grad_sqnorm and grad_trace_cov")
    gain = np.asarray(adascale_gain(grad_sqnorm, grad_trace_cov, scale, ref_batch))
    if rule == "sqrt-gain":
        gain = np.sqrt(gain)
    return np.where(np.isnan(gain), 1.0, gain)[()]


def lr_aware_factor(batch: ArrayLike, ref_batch: ArrayLike = 1.0) -> np.ndarray:
    """COPUS Eqs. 7–8: goodput × η(B)/η(B_ref) with η ∝ sqrt(B), i.e. × sqrt(B/B_ref)."""
    return np.sqrt(np.asarray(batch, dtype=float) / np.asarray(ref_batch, dtype=float))[()]
