"""Progress per step at a learning rate that is *not* re-tuned for the batch (pure; no torch).

McCandlish, Kaplan & Amodei 2018 ("An Empirical Model of Large-Batch Training", §2.2,
Eqs. 2.5–2.7) expand the loss to second order along the update. One step of learning rate ε
at batch B lowers the expected loss by

    ΔL(ε) = ε·|G|² − ½·ε²·(GᵀHG + tr(HΣ)/B),

a parabola in ε with its top at

    ε_opt(B) = ε_max / (1 + B_noise/B)              (Eq. 2.6, ε_max = |G|²/GᵀHG)
    ΔL_opt(B) = ΔL_max / (1 + B_noise/B)            (Eq. 2.7).

For any other LR, writing ε = x·ε_opt(B), the same parabola gives

    ΔL(x·ε_opt) = ΔL_opt(B) · (2x − x²)             (progress_factor)

so the LR-tuned progress `E(B)` that `core.trajectory` counts is scaled by `2x − x²`: 1 at
x = 1, 2x for x ≪ 1, 0 at x = 2 (beyond it the step diverges; no progress is counted).

COPUS does not re-tune the LR for each B: it keeps one base LR η0 at B_ref = 16 (chosen by a
short sweep), scales it by the Adam square-root rule η(B) = η0·sqrt(B/B_ref) for every method,
static baselines included, warms it up linearly over the first 8M tokens and keeps it constant
after (COPUS §6.1; copus-notes §1.10). Generalise the optimum of Eq. 2.6 to an exponent p
(p = 1: SGD, McCandlish Eq. 2.6; p = ½: Adam's sign-like update, Su's mean-field result
η* ∝ (1 + B_noise/B)^(−½), cbs-notes §3). The fraction of the optimal LR a run at B uses is

    x(B, t) = x0 · w(t) · sqrt(B/B_ref) · [(1 + B_noise/B) / (1 + B_noise/B_ref)]^p   (lr_fraction)

- x0 = η0/ε_opt(B_ref): the base LR as a fraction of the optimal LR at the reference batch.
  At the start B_noise ≪ B_ref, so x0 = η0/ε_max there. It is taken as constant over the run,
  i.e. ε_max drifts so that a constant LR at B_ref stays the same fraction of its optimum:
  with a fixed ε_max the constant LR would pass 2·ε_opt once B_noise grows ~100× during the
  run and the B = 16 run would stall, which Table 1's static rows contradict.
- w(t) is the warm-up ramp.
- sqrt(B/B_ref)·[...]^p is the sqrt rule's LR ratio over the optimal ratio ε_opt(B)/ε_opt(B_ref).

At p = ½ the sqrt rule is exact while B ≪ B_noise (Malladi et al. 2022) and over-scales beyond.
So with x0 < 1 a larger batch with its larger LR makes more progress per sample than E(B)
says: the situation COPUS's LR-aware goodput factor (Eq. 8) describes. x0 = 1 at B = B_ref
recovers E(B) there.
"""

from __future__ import annotations

import math

import numpy as np

LR_EXPONENT_SGD = 1.0  # McCandlish et al. 2018, Eq. 2.6
LR_EXPONENT_ADAM = 0.5  # Adam as a sign-like update (Su's derivation; Malladi et al. 2022's sqrt rule)


def optimal_lr(
    global_batch_size: float, b_noise: float, lr_max: float = 1.0, exponent: float = LR_EXPONENT_SGD
) -> float:
    """ε_opt(B) = ε_max / (1 + B_noise/B)^p (McCandlish 2018 Eq. 2.6 at p = 1)."""
    return lr_max / (1.0 + b_noise / global_batch_size) ** exponent


def progress_factor(x: float) -> float:
    """ΔL(x·ε_opt)/ΔL_opt = 2x − x², floored at 0 (x ≥ 2: the quadratic model diverges).

    Every function here also takes numpy arrays (the oracle scores all candidates at once)."""
    return np.maximum(2.0 * x - x * x, 0.0)


def warmup_factor(tokens: float, warmup_tokens: float) -> float:
    """w(t) = min(1, tokens/warm-up tokens): COPUS's linear warm-up (8M tokens, §6.1)."""
    if warmup_tokens <= 0:
        return 1.0
    return np.minimum(1.0, np.maximum(tokens, 0.0) / warmup_tokens)


def lr_fraction(
    global_batch_size: float,
    b_noise: float,
    lr_fraction_x0: float,
    *,
    ref_batch: float = 16.0,
    exponent: float = LR_EXPONENT_SGD,
    warmup: float = 1.0,
) -> float:
    """x = η(B)/ε_opt(B) for η(B) = η0·w·sqrt(B/B_ref), η0 = x0·ε_opt(B_ref):
    x0·w·sqrt(B/B_ref)·[(1 + B_noise/B)/(1 + B_noise/B_ref)]^p (module docstring)."""
    ratio = optimal_lr(ref_batch, b_noise, exponent=exponent) / optimal_lr(
        global_batch_size, b_noise, exponent=exponent
    )
    return lr_fraction_x0 * warmup * np.sqrt(global_batch_size / ref_batch) * ratio


def sqrt_lr_progress_factor(
    global_batch_size: float,
    b_noise: float,
    lr_fraction_x0: float,
    *,
    ref_batch: float = 16.0,
    exponent: float = LR_EXPONENT_SGD,
    tokens: float = math.inf,
    warmup_tokens: float = 0.0,
) -> float:
    """The factor 2x − x² by which a sqrt-scaled, untuned LR scales the LR-tuned progress."""
    x = lr_fraction(
        global_batch_size,
        b_noise,
        lr_fraction_x0,
        ref_batch=ref_batch,
        exponent=exponent,
        warmup=warmup_factor(tokens, warmup_tokens),
    )
    return progress_factor(x)


def sqrt_rule_factor(
    batch: np.ndarray | float,
    b_crit: np.ndarray,
    x0: np.ndarray,
    ref_batch: float,
    exponent: float = 0.5,
    *,
    overshoot_only: bool = False,
) -> np.ndarray:
    """2x − x² (floored at 0) with x = x0·sqrt(B/B_ref)·[(1 + B_crit/B)/(1 + B_crit/B_ref)]^p: the
    progress per sample of the sqrt LR rule over the LR-tuned E(B) (McCandlish 2018 Eqs. 2.5–2.7;
    `core.stats.lr_progress.sqrt_lr_progress_factor` after the warm-up). `overshoot_only`: x < 1
    counted as x = 1 (factor 1): only the overshoot past the optimum scales. Broadcasts."""
    b = np.asarray(batch, dtype=float)
    bc = np.asarray(b_crit, dtype=float)
    finite = np.isfinite(bc)
    # B_crit → ∞ (φ unknown): the ratio's limit (B_ref/B)^p, i.e. x = x0·(B/B_ref)^(1/2 − p)
    x = np.where(
        finite,
        lr_fraction(b, np.where(finite, bc, 0.0), x0, ref_batch=ref_batch, exponent=exponent),
        x0 * np.sqrt(b / ref_batch) * (ref_batch / b) ** exponent,
    )
    if overshoot_only:
        x = np.maximum(x, 1.0)
    return progress_factor(x)
