"""The critical batch measured by branching (Merrill et al. 2025, §3.1) and the McCandlish fit.

From one checkpoint trained at global batch `B`, branches train at `k·B` (LR rule applied to
`k`) on the same samples for the same number of tokens `T`. This module turns their loss curves
into numbers; it never trains anything (no torch).

- `ema_smooth`: the EMA with α = 0.5 that Merrill et al. apply to each branch's loss curve.
- `noise_floor`: ε from repeats of the same branch on different samples — twice the mean
  absolute loss gap between repeats (cbs-notes §5.3: "ε from noise, not 0.01").
- `read_off_critical_batch`: the largest `k·B` whose smoothed loss after `T` tokens is within
  `ε` of every smaller tested batch; the interval runs to the next tested batch and the reported
  value is their geometric mean (Merrill et al. §3.2).
- `fit_b_noise_pair` / `fit_b_noise`: McCandlish et al. (2018, Eq. 2.7) — progress per sample at
  the per-batch optimal LR is ∝ 1/(B + B_noise), so over the same tokens the loss drops satisfy
  `ρ = ΔL_k / ΔL_1 = (B + B_noise) / (kB + B_noise)`, hence `B_noise = B(kρ − 1)/(1 − ρ)`; the
  least-squares version fits `1/ΔL = (batch + B_noise)/C` (linear in the batch) over all branches.
- `measured_calibration`: `c = B_noise_fit / b_noise_online`, the factor the controller applies
  to the online gradient noise scale (`gns.calibration`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

EMA_ALPHA = 0.5  # Merrill et al. 2025, §3.1


def parse_probe_multipliers(text: str) -> list[float]:
    """`gns.probe_multipliers` ("1,2,4") → sorted distinct numbers > 0, at least two, with 1."""
    try:
        ks = sorted({float(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        ks = []
    if len(ks) < 2 or 1.0 not in ks or any(not (math.isfinite(k) and k > 0) for k in ks):
        raise ValueError(
            f"gns.probe_multipliers={text!r}: allowed: comma-separated numbers > 0, "
            'at least two, including 1 (e.g. "1,2,4")'
        )
    return ks


def ema_smooth(losses: Sequence[float], alpha: float = EMA_ALPHA) -> list[float]:
    """s_0 = L_0, s_t = α·L_t + (1 − α)·s_{t−1}: the smoothed loss curve (Merrill et al. §3.1)."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} is invalid; allowed: 0 < alpha <= 1")
    out: list[float] = []
    for x in losses:
        out.append(float(x) if not out else alpha * float(x) + (1.0 - alpha) * out[-1])
    return out


def smoothed_final(losses: Sequence[float], alpha: float = EMA_ALPHA) -> float:
    """The last value of `ema_smooth(losses)`: the branch's loss `L_k` after T tokens."""
    if len(losses) == 0:
        raise ValueError("a branch needs at least one loss value")
    return ema_smooth(losses, alpha)[-1]


def noise_floor(repeats: Mapping[float, Sequence[float]]) -> float:
    """ε = 2 × the mean absolute gap between repeats of the same branch (pooled over branches).

    `repeats[k]` holds the final smoothed losses of repeats of branch `k` on disjoint samples
    (the same token count). Needs at least one branch with two repeats; with exactly one branch
    and two repeats this is "twice the loss gap of two repeats" (cbs-notes §5.3).
    """
    gaps = [abs(a - b) for values in repeats.values() for a, b in combinations(values, 2)]
    if not gaps:
        raise ValueError("noise_floor needs a branch with >= 2 repeats")
    return 2.0 * float(np.mean(gaps))


@dataclass(frozen=True, slots=True, kw_only=True)
class CriticalBatch:
    """Merrill et al.'s read-off: `lower = k*·B`, `upper` = next tested batch (None if k* is the
    largest tested, i.e. the critical batch is at least `lower`), `value` = their geometric
    mean (or `lower` when unbounded)."""

    lower: float
    upper: float | None
    value: float
    epsilon: float

    @property
    def bounded(self) -> bool:
        return self.upper is not None


def read_off_critical_batch(losses: Mapping[float, float], epsilon: float) -> CriticalBatch:
    """Largest tested batch `b*` with `L(b*) ≤ L(b) + ε` for every tested `b < b*`.

    `losses` maps global batch size → smoothed loss after the same T tokens. Merrill et al.
    (2025) §3.1 (definition of k*) and §3.2 (interval to the next tested batch, geometric mean).
    """
    if not losses:
        raise ValueError("read_off_critical_batch needs at least one branch")
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon={epsilon!r} is invalid; allowed: a finite number >= 0")
    batches = sorted(float(b) for b in losses)
    loss = {float(b): float(v) for b, v in losses.items()}
    best = batches[0]
    for i, b in enumerate(batches):
        if all(loss[b] <= loss[s] + epsilon for s in batches[:i]):
            best = b
    j = batches.index(best)
    upper = batches[j + 1] if j + 1 < len(batches) else None
    value = math.sqrt(best * upper) if upper is not None else best
    return CriticalBatch(lower=best, upper=upper, value=value, epsilon=float(epsilon))


def fit_b_noise_pair(batch: float, k: float, drop_base: float, drop_k: float) -> float:
    """McCandlish two-branch fit: `B_noise = B(kρ − 1)/(1 − ρ)` with `ρ = ΔL_k / ΔL_1`.

    `drop_base`, `drop_k`: loss drops over the same tokens at batch `B` and `k·B`. Returns NaN
    when the data do not fit the model (no progress, ρ outside (1/k, 1) for k > 1 or outside
    (1, 1/k) for k < 1: B_noise would be negative or infinite).
    """
    if k <= 0 or k == 1 or batch <= 0:
        raise ValueError(f"k={k!r}, batch={batch!r}: allowed: k > 0, k != 1, batch > 0")
    if not (drop_base > 0 and math.isfinite(drop_base) and math.isfinite(drop_k)):
        return math.nan
    rho = drop_k / drop_base
    lo, hi = sorted((1.0, 1.0 / k))
    if not lo < rho < hi:
        return math.nan
    return batch * (k * rho - 1.0) / (1.0 - rho)


@dataclass(frozen=True, slots=True, kw_only=True)
class NoiseFit:
    """Least-squares fit of `ΔL(b) = C / (b + B_noise)` over the branches."""

    b_noise: float  # NaN when the fit has no positive slope / intercept
    scale: float  # C
    num_points: int
    residual_rms: float  # of 1/ΔL


def fit_b_noise(drops: Mapping[float, float]) -> NoiseFit:
    """Fit `1/ΔL = b/C + B_noise/C` (ordinary least squares in the batch `b`), B_noise = a/s.

    `drops` maps global batch → loss drop over the same tokens (McCandlish et al. 2018,
    Eq. 2.7 under a fixed sample budget). Branches without progress (ΔL ≤ 0) are left out.
    """
    pts = [(float(b), 1.0 / float(d)) for b, d in drops.items() if d > 0 and math.isfinite(d)]
    if len(pts) < 2 or len({b for b, _ in pts}) < 2:
        return NoiseFit(b_noise=math.nan, scale=math.nan, num_points=len(pts), residual_rms=math.nan)
    x = np.array([b for b, _ in pts])
    y = np.array([v for _, v in pts])
    slope, intercept = np.polyfit(x, y, 1)
    rms = float(np.sqrt(np.mean((y - (slope * x + intercept)) ** 2)))
    if slope <= 0 or intercept <= 0:
        return NoiseFit(b_noise=math.nan, scale=math.nan, num_points=len(pts), residual_rms=rms)
    return NoiseFit(b_noise=float(intercept / slope), scale=float(1.0 / slope), num_points=len(pts), residual_rms=rms)


def measured_calibration(b_noise_fit: float, b_noise_online: float) -> float:
    """`c = B_noise_fit / b_noise_online` (NaN when either is not a finite positive number)."""
    ok = all(math.isfinite(v) and v > 0 for v in (b_noise_fit, b_noise_online))
    return b_noise_fit / b_noise_online if ok else math.nan


def summarize_branches(
    *,
    base_batch: float,
    losses: Mapping[float, Sequence[float]],
    start_loss: float,
    b_noise_online: float,
    epsilon: float | None = None,
) -> dict:
    """One checkpoint's calibration from its branches (plain numbers, JSON-ready).

    `losses[b]`: the smoothed final loss of each repeat of the branch at global batch `b`
    (repeat r on its own disjoint samples). `start_loss`: the loss at the checkpoint on the same
    windows. ε = `noise_floor(losses)` unless given. The critical batch is read off the mean
    over repeats; B_noise is fitted (least squares) on the mean drops and per repeat, and
    `c = B_noise_fit / b_noise_online` is reported with its spread over repeats.
    """
    mean = {float(b): float(np.mean(v)) for b, v in losses.items()}
    eps = noise_floor(losses) if epsilon is None else float(epsilon)
    cb = read_off_critical_batch(mean, eps)
    fit = fit_b_noise({b: start_loss - v for b, v in mean.items()})
    num_repeats = min(len(v) for v in losses.values())
    per_repeat = [
        fit_b_noise({float(b): start_loss - v[r] for b, v in losses.items()}).b_noise for r in range(num_repeats)
    ]
    c_repeats = [measured_calibration(b, b_noise_online) for b in per_repeat]
    pairs = {
        b: fit_b_noise_pair(base_batch, b / base_batch, start_loss - mean[base_batch], start_loss - v)
        for b, v in mean.items()
        if b != base_batch and base_batch in mean
    }
    finite_c = [c for c in c_repeats if math.isfinite(c)]
    return {
        "base_batch": base_batch,
        "start_loss": start_loss,
        "epsilon": eps,
        "mean_loss": mean,
        "critical_batch": {"lower": cb.lower, "upper": cb.upper, "value": cb.value},
        "b_noise_fit": fit.b_noise,
        "fit_residual_rms": fit.residual_rms,
        "b_noise_pairs": pairs,
        "b_noise_fit_repeats": per_repeat,
        "b_noise_online": b_noise_online,
        "c": measured_calibration(fit.b_noise, b_noise_online),
        "c_repeats": c_repeats,
        "c_spread": (max(finite_c) - min(finite_c)) if len(finite_c) >= 2 else math.nan,
        "c_critical": measured_calibration(cb.value, b_noise_online),
    }
