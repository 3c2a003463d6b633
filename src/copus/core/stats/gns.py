"""Gradient noise scale from gradients that training already computes.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", App. A.1): a gradient
averaged over `b` i.i.d. samples has E‖g_b‖² = |G|² + tr(Σ)/b. Measuring ‖g‖² at two batch sizes
gives unbiased estimates of |G|² and tr(Σ); COPUS (arXiv 2604.26687, Alg. 1) uses one
micro-batch per dp rank as the small batch and the global batch as the big one (design.md §3).

The ratio of two unbiased estimates is biased, so `GnsEstimator` smooths numerator and
denominator with separate exponential moving averages and divides afterwards (COPUS §3.2;
AdaptDL `gradient_noise_scale.py`; k-diffusion `gns.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def two_batch_estimate(
    small_sqnorm: float, small_batch: float, big_sqnorm: float, big_batch: float
) -> tuple[float, float]:
    """Unbiased `(grad_sqnorm, grad_trace_cov)` = estimates of (|G|², tr(Σ)).

    With s̄ = `small_sqnorm` (mean squared norm of gradients over `small_batch` = b samples) and
    q = `big_sqnorm` (squared norm of the gradient over `big_batch` = B samples):

        |G|²  ≈ (B·q − b·s̄) / (B − b)
        tr(Σ) ≈ (s̄ − q) / (1/b − 1/B)

    McCandlish et al. 2018, App. A.1; with N = B/b small gradients these are COPUS Alg. 1's
    (N·q − s̄)/(N − 1) and (s̄ − q)·B/(N − 1). Either estimate can be negative on one step.
    """
    if not small_batch > 0:
        raise ValueError(f"small_batch={small_batch!r} is invalid; allowed: a number > 0")
    if not big_batch > small_batch:
        raise ValueError(
            f"big_batch={big_batch!r} is invalid; allowed: a number > "
            f"small_batch={small_batch!r} (two different batch sizes are needed)"
        )
    b, big = float(small_batch), float(big_batch)
    grad_sqnorm = (big * big_sqnorm - b * small_sqnorm) / (big - b)
    grad_trace_cov = (small_sqnorm - big_sqnorm) / (1.0 / b - 1.0 / big)
    return float(grad_sqnorm), float(grad_trace_cov)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecaySchedule:
    """EMA decay as a function of tokens consumed: `decay` before `switch_tokens`, then `decay_late`.

    COPUS §3.2: 0.95 for the first 8M tokens (forget the noisy early estimates fast), then 0.99.
    """

    decay: float = 0.95
    decay_late: float = 0.99
    switch_tokens: int = 8_000_000

    def __post_init__(self) -> None:
        for name in ("decay", "decay_late"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value!r} is invalid; allowed: 0 <= decay < 1")
        if self.switch_tokens < 0:
            raise ValueError(f"switch_tokens={self.switch_tokens!r} is invalid; allowed: >= 0")

    def __call__(self, tokens: int) -> float:
        return self.decay if tokens < self.switch_tokens else self.decay_late


_EMA_KEYS = ("w1", "w2", "m_sqnorm", "m_trace", "m_sqnorm2", "m_trace2", "m_cross")


class GnsEstimator:
    """Bias-corrected EMAs of |G|² and tr(Σ); `b_noise = EMA(tr Σ) / EMA(|G|²)` in samples.

    Each EMA is kept as a weighted sum with its total weight `w1` (Adam-style bias correction that
    stays exact when the decay changes): after the first update the EMA equals the sample.

    `rel_err` is the relative standard error of `b_noise`. The EMA is a weighted mean of the
    per-step estimates with weights w_t; treating those as independent draws, its variance is
    Var(x)·Σw_t²/(Σw_t)² = Var(x)/n_eff. Var(x), Var(y) and Cov(x, y) of the per-step estimates
    x = |G|², y = tr(Σ) come from EMAs of x², y², xy (reliability-weighted, unbiased), and the
    delta method carries them to the ratio:

        rel_err² = Var(y)/(n_eff·ȳ²) + Var(x)/(n_eff·x̄²) − 2·Cov(x, y)/(n_eff·x̄·ȳ)

    It is `inf` until two updates exist or while either EMA is ≤ 0. Drift of the true statistics
    within the EMA window inflates it (conservative for the "wait until accurate" rule).

    `b_noise` is NaN before the first update, `inf` when EMA |G|² ≤ 0 (no measurable signal:
    pure noise, any batch is "small"), and 0 when EMA tr(Σ) ≤ 0 < EMA |G|².
    """

    def __init__(self, decay: DecaySchedule | float | None = None) -> None:
        if decay is None:
            decay = DecaySchedule()
        elif not isinstance(decay, DecaySchedule):
            decay = DecaySchedule(decay=float(decay), decay_late=float(decay))
        self.decay = decay
        self._ema = dict.fromkeys(_EMA_KEYS, 0.0)
        self.num_updates = 0
        self.num_skipped = 0
        self.last_grad_sqnorm = math.nan
        self.last_grad_trace_cov = math.nan

    def update(
        self,
        small_sqnorm: float,
        small_batch: float,
        big_sqnorm: float,
        big_batch: float,
        tokens: int = 0,
        decay: float | None = None,
    ) -> bool:
        """Add one step's statistics; `tokens` = tokens consumed so far (selects the decay),
        or `decay` = this update's decay, overriding the schedule (`core.gns_tracking` ties it
        to samples).

        Returns False, changing nothing but `num_skipped`, when the sample is unusable: a
        non-finite input or estimate, or a single small gradient (big_batch ≤ small_batch).
        """
        values = (small_sqnorm, small_batch, big_sqnorm, big_batch)
        if not all(_finite(v) for v in values) or not 0 < small_batch < big_batch:
            self.num_skipped += 1
            return False
        x, y = two_batch_estimate(small_sqnorm, small_batch, big_sqnorm, big_batch)
        if not (math.isfinite(x) and math.isfinite(y)):
            self.num_skipped += 1
            return False
        a = self.decay(tokens) if decay is None else float(decay)
        e = self._ema
        e["w1"] = a * e["w1"] + (1.0 - a)
        e["w2"] = a * a * e["w2"] + (1.0 - a) ** 2
        for key, value in (
            ("m_sqnorm", x),
            ("m_trace", y),
            ("m_sqnorm2", x * x),
            ("m_trace2", y * y),
            ("m_cross", x * y),
        ):
            e[key] = a * e[key] + (1.0 - a) * value
        self.num_updates += 1
        self.last_grad_sqnorm, self.last_grad_trace_cov = x, y
        return True

    def _mean(self, key: str) -> float:
        w1 = self._ema["w1"]
        return self._ema[key] / w1 if w1 > 0 else math.nan

    @property
    def grad_sqnorm(self) -> float:
        """Bias-corrected EMA of the |G|² estimates (NaN before the first update)."""
        return self._mean("m_sqnorm")

    @property
    def grad_trace_cov(self) -> float:
        """Bias-corrected EMA of the tr(Σ) estimates (NaN before the first update)."""
        return self._mean("m_trace")

    @property
    def b_noise(self) -> float:
        """tr(Σ)/|G|² from the two EMAs; NaN / inf / 0 edge cases in the class docstring."""
        if self.num_updates == 0:
            return math.nan
        g, t = self.grad_sqnorm, self.grad_trace_cov
        if g <= 0:
            return math.inf
        return max(t, 0.0) / g

    @property
    def num_effective(self) -> float:
        """Effective number of samples in the EMA: (Σw)²/Σw²."""
        w1, w2 = self._ema["w1"], self._ema["w2"]
        return w1 * w1 / w2 if w2 > 0 else 0.0

    @property
    def rel_err(self) -> float:
        """Relative standard error of `b_noise` (delta method; see the class docstring)."""
        n = self.num_effective
        g, t = self.grad_sqnorm, self.grad_trace_cov
        if self.num_updates < 2 or n <= 1.0 + 1e-12 or not (g > 0 and t > 0):
            return math.inf
        unbias = n / (n - 1.0)
        var_g = max(self._mean("m_sqnorm2") - g * g, 0.0) * unbias
        var_t = max(self._mean("m_trace2") - t * t, 0.0) * unbias
        cov = (self._mean("m_cross") - g * t) * unbias
        rel2 = (var_t / (t * t) + var_g / (g * g) - 2.0 * cov / (g * t)) / n
        return math.sqrt(max(rel2, 0.0))

    def state_dict(self) -> dict:
        """Plain JSON-able values (floats, ints, None)."""
        return {
            "version": 1,
            **{k: float(v) for k, v in self._ema.items()},
            "num_updates": self.num_updates,
            "num_skipped": self.num_skipped,
            "last_grad_sqnorm": _none_if_nan(self.last_grad_sqnorm),
            "last_grad_trace_cov": _none_if_nan(self.last_grad_trace_cov),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned; the decay schedule stays as configured."""
        if state.get("version") != 1:
            raise ValueError(f"GNS state version={state.get('version')!r} is invalid; allowed: 1")
        self._ema = {k: float(state[k]) for k in _EMA_KEYS}
        self.num_updates = int(state["num_updates"])
        self.num_skipped = int(state.get("num_skipped", 0))
        self.last_grad_sqnorm = _nan_if_none(state.get("last_grad_sqnorm"))
        self.last_grad_trace_cov = _nan_if_none(state.get("last_grad_trace_cov"))


def lower_bound(b_noise: float, rel_err: float, z: float) -> float:
    """One-sided lower confidence bound of b_noise: φ·exp(−z·rel_err).

    `rel_err` is the delta-method standard error of ln φ (= relative error of φ), so this is
    the log-normal bound: always ≥ 0, → φ as rel_err → 0, and 0 while the error is unknown
    (inf). Merrill et al. 2025 App. B model the noise of the GNS parts to put confidence
    intervals on it; cbs-notes §5.6: act on the lower bound rather than refusing to act.
    z = 0 gives the point estimate. NaN stays NaN; inf (no signal) stays inf when rel_err is
    finite.
    """
    if math.isnan(b_noise):
        return math.nan
    if not math.isfinite(rel_err):
        return 0.0 if z > 0 else b_noise
    if math.isinf(b_noise):
        return b_noise
    return b_noise * math.exp(-z * max(rel_err, 0.0))


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except TypeError:
        return False


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else float(value)


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else float(value)
