"""A posterior over the noise-scale calibration c = B_crit / b_noise, learnt from the run itself.

The goodput controller scores a batch B by its sample efficiency E_c(B) = cφ/(cφ + B) with
φ = the online noise scale (McCandlish et al. 2018, Eq. 2.11; `core.efficiency`). No constant c
is supported (cbs-notes §0: 0.12–20 in McCandlish Table 1, ≫ 1 in Merrill et al. 2025; about 1
on the CPU runs, 2–4 in the truths fitted to COPUS's CBS rows), so `gns.calibration = "auto"`
learns it from what every run already logs, with no extra compute:

**Every batch change is a natural experiment.** One step at batch B_i adds
ΔE_i(c) = B_i · cφ_i / (cφ_i + B_i) effective samples (McCandlish §2.2, App. D). The loss is a
smooth function of effective samples, L = f(E). Under the right c, the loss plotted against the
clock E_c(t) = Σ_{i≤t} ΔE_i(c) has no kink where B changed; under a wrong c it bends there
(c too small: the larger batch looks too efficient, the curve steepens). For a window of steps
around one or more changes, and for every c on a grid over log c, the loss is fitted by weighted
least squares two ways, the clock E_c counted from the run's first step:
- as the power law it is, L ≈ a + b·E_c^(−α) (Kaplan et al. 2020, L(D)), linear in (a, b) for
  each loss exponent α on a small grid (`loss_exponents`; α is one number per run, learnt with c:
  one posterior over (α, c));
- as a quadratic in log E_c (a power law is nearly quadratic in log E over a window; the
  quadratic also absorbs a smooth LR schedule, and the GNS estimator's lag, which kinks at a
  change: its EMA falls further behind a rising B_crit once the larger batch speeds progress).
The quadratic alone (the first version) absorbs most of the bend too: on the 7B sqrt-lr truth
one window told c = 1 from c = 256 by ~1.6 nats, so three unlucky windows ran the posterior away
(docs/robust-goodput.md §6.10); the power law alone reads ~10 nats but takes the estimator's
lag for a bend. Each window's likelihood is their average (`average_quadratic`; the quadratic's
third parameter priced as in BIC, 1/sqrt(n)).

**The estimator's lag in the clock** (`lag_steps`; given by the simulator and the trainer when
`MODEL_ESTIMATOR_LAG`, the default since docs/robust-goodput.md §6.18; §6.13): φ is an EMA
(COPUS §3.2: decay a = 0.99 per step), which lags a rising noise scale by a/(1 − a) = 99 steps and
falls further behind once a larger batch speeds progress per step: with φ_ema in the clock the
window reads that kink as a bend (c 1.4–3× high at small c, where ΔE ≈ cφ). The posterior runs a
lag line: step t enters the clock and the fit when φ_ema(t + lag) has been reported, and that
value stands for φ(t) (exact for a linearly drifting signal); `lag_decay` takes the lag from the
EMA's decay schedule (the mean age of its weights), `lag_level` reports c in the units of the
current, lagged φ. A window closes `lag` steps later than without it. It reads c right on the
simulator's truths; alone it lowered the whole grid's median capture 0.58 → 0.45 (§6.13), on top
of the planned start and tempered windows it raises it 0.70 → 0.77 (§6.18, adopted).

The profile likelihood of c with the noise level unknown is

    log p(losses | c) = −(n/2) · log WRSS(c)        (Gaussian noise, σ profiled out)

with weights w_i = B_i·seq (the per-step loss noise of real runs is σ ≈ 2.1/sqrt(tokens per
step) nats: docs/robust-goodput.md), so one step at a larger batch counts more. The first
`skip_steps` after each change are left out of the fit (the post-change transient: Adam's second
moment lags the new LR, COPUS App. E; Merrill et al. 2025 Assumption 3) but still advance the
clock. Evidence multiplies into a grid posterior over log c (and α with `loss_exponents`; prior:
normal in log c around `prior_c`, `prior_octaves` wide; uniform in α). Windows do not overlap,
so no loss is counted twice.

Decisions use `value()`: the posterior quantile `quantile` of c (0.5: the median, i.e. the
c whose log error is as likely high as low; a factor-k error in c costs goodput about equally
either way in log k, so the median is the robust rule stated in docs/robust-goodput.md).
Pure numpy; no torch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from copus.core.stats.lr_progress import sqrt_rule_factor
from copus.core.stats.window_fit import WindowStep, window_log_likelihood

LOG2_C_RANGE = (-4.0, 8.0)  # c from 1/16 to 256: McCandlish 0.12 … 20, Merrill ≫ 1
GRID_POINTS = 49  # quarter-octave steps
# the truths fitted to COPUS's rows have loss exponents α = 0.17–0.26; Kaplan's L(D) 0.095
POWER_LAW_EXPONENTS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.4)
# offsets E_0 of the power law L ≈ a + b·(E + E_0)^(−α), as fractions of the clock at the first step
# the posterior read, learnt with α and c (uniform prior): an early window (E within a few E_0)
# fitted from E = 0 read c 5–13x high (docs/robust-goodput.md §6.27). The planning controller fits
# them (`controller.PLANNER_LOSS_OFFSETS`, with its VoI experiments since §6.29); the class default
# DEFAULT_LOSS_OFFSETS = (0.0,) is the fit without an offset
LOSS_OFFSETS = (0.0, 0.125, 0.25, 0.5, 1.0)
DEFAULT_LOSS_OFFSETS = (0.0,)
# the lag, in steps, of the GNS estimator modelled in the clock (`CalibrationPosterior.lag_steps`)
# when none is given: an EMA with per-step decay a lags a steadily drifting signal by a/(1 − a)
# steps (99 at COPUS's late decay 0.99; docs/robust-goodput.md §6.13); 0 = off
DEFAULT_LAG_STEPS = 0
DEFAULT_LAG_DECAY: tuple[float, float, float] | None = None
DEFAULT_LAG_LEVEL = True
# whether the controllers built by the simulator and the trainer (gns.estimator = "ema") give
# the posterior the estimator's decay schedule (`lag_decay`): on (docs/robust-goodput.md §6.18:
# 3 seeds, median capture 0.70 -> 0.77, min -1.19 -> -0.08); `bench/planner_grid.py
# --no-lag-model` switches it off
MODEL_ESTIMATOR_LAG = True


def ema_lag_steps(decay: float) -> int:
    """Mean age of an EMA's weights, a/(1 − a) steps: the lag of y_t = a·y_{t−1} + (1 − a)·x_t
    behind a linear trend x_t = x_0 + k·t (y_t = x_{t − a/(1−a)} once the start is forgotten)."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay={decay!r} is invalid; allowed: 0 <= decay < 1")
    return round(decay / (1.0 - decay))


@dataclass(slots=True, kw_only=True)
class CalibrationPosterior:
    """Grid posterior over log c; feed it every step with `observe`, read `value()`."""

    prior_c: float = 2.0
    prior_octaves: float = 2.0  # sd of the prior in log2 c
    window_steps: int = 60  # steps kept before a change, and waited for after it
    skip_steps: int = 10  # transient after a change: clock only, not fitted
    # a change is an experiment when the batch moved by at least this factor since the last one
    # (smaller moves stay in the window, on the clock; they bend the curve too little to read)
    min_ratio: float = 1.0
    min_fit_steps: int = 12
    quantile: float = 0.5
    tempering: float = 1.0  # < 1 discounts each window's evidence (misspecification)
    # exponents α of the power law L ≈ a + b·E^(−α) fitted in each window, learnt with c
    # (uniform prior): alone, one window tells c = 1 from c = 256 by ~10 nats instead of the
    # quadratic's ~1.6, but the GNS estimator's EMA lag, which kinks at a change, reads as a bend
    # too (c ~2x high); () = the quadratic alone (the first version). docs §6.10
    loss_exponents: tuple[float, ...] = POWER_LAW_EXPONENTS
    # offsets E_0 = f·E_c(first read) of that power law, one per run, learnt with α (`LOSS_OFFSETS`;
    # default (0.0,): none, docs §6.27)
    loss_offsets: tuple[float, ...] = DEFAULT_LOSS_OFFSETS
    # average each window's power-law likelihood with the quadratic's (the quadratic's third
    # parameter priced as in BIC): the power law's evidence where it fits, the quadratic's
    # where the estimator's lag bends the curve (~3 nats a window on the 7B sqrt-lr truth)
    average_quadratic: bool = True
    # each window's log-likelihood × n_eff/n, n_eff from the lag-1 autocorrelation of its best
    # fit's residuals (`window_fit.effective_fraction`): a smooth misfit, e.g. the first steps'
    # curve that no power law in E follows, is not n independent readings (docs §6.23)
    effective_n: bool = True
    # exponents γ of an LR factor B^γ on the progress per sample: 0 = E(B) alone (LR re-tuned
    # for every B; docs/statistics.md §4), ½ = COPUS's LR-aware Eq. 8 (an LR below its optimum,
    # e.g. in warm-up, that the sqrt rule raises with B); the evidence weighs them too
    lr_exponents: tuple[float, ...] = (0.0,)
    prior_lr_aware: float = 0.5  # prior probability of the last exponent (½)
    # the noise-scale estimator's lag in steps, modelled in the clock: step t's ΔE uses the φ
    # reported `lag_steps` steps later (the EMA'd estimate φ_ema(t + lag) ≈ φ(t); the estimator
    # falls further behind once a larger batch speeds progress per step, a kink the fit would
    # read as a bend); the posterior then runs `lag_steps` behind the run. None: DEFAULT_LAG_STEPS
    lag_steps: int | None = None
    # the estimator's EMA decay schedule (decay, decay_late, switch_tokens) (`core.gns.DecaySchedule`;
    # observe() then needs `tokens`): the lag is the mean age of the EMA's weights at each step
    # (19 steps at 0.95, rising to 99 after the switch to 0.99) instead of the constant lag_steps
    lag_decay: tuple[float, float, float] | None = None
    # report c in the units of the φ the run reports now: c × φ_ema(now)/φ_ema(t) for the last
    # step t that left the lag line (the planner multiplies the current φ_ema by c)
    lag_level: bool | None = None
    _lag_ratio: float = 1.0
    _ema_w: float = 0.0  # Σ weights and Σ weight·age of the EMA (its mean age = the lag)
    _ema_age: float = 0.0
    _seen: int = 0  # steps observed (the lag line's clock)
    _lag_now: int = 0
    # base-LR fractions x0 = η0/ε_opt(B_ref) of the sqrt LR rule η(B) = η0·sqrt(B/B_ref), one LR
    # row each after the exponents' rows: progress per sample E(B)·(2x − x²), x = x0·sqrt(B/B_ref)·
    # [(1 + cφ/B)/(1 + cφ/B_ref)]^p (`core.stats.lr_progress`, McCandlish 2018 Eqs. 2.5–2.7); with
    # x0 > 1/sqrt(B/B_ref) the scaled LR overshoots and a larger batch loses progress per sample.
    # () = none (the first version); docs/robust-goodput.md §6.14
    lr_fractions: tuple[float, ...] = ()
    prior_lr_fractions: float = 0.5  # their prior mass together (the exponents' rows share the rest)
    lr_ref_batch: float = 16.0  # B_ref of the sqrt rule
    lr_opt_exponent: float = 0.5  # p of ε_opt ∝ (1 + B_noise/B)^(−p): Adam's ½
    # count only the overshoot, x > 1 (x < 1 read as x = 1: below its optimum the scaled LR's
    # gain with B looks like a larger c, which the c axis already reads; docs §6.14)
    lr_overshoot_only: bool = True
    log2_grid: np.ndarray = field(default_factory=lambda: np.linspace(*LOG2_C_RANGE, GRID_POINTS))
    # (len(lr_exponents) + len(lr_fractions), len(loss_exponents)·len(loss_offsets) or 1, len(log2_grid))
    log_post: np.ndarray = field(init=False)
    experiments: list[dict] = field(default_factory=list)
    _buffer: list[WindowStep] = field(default_factory=list)
    _last_batch: float | None = None
    _since_change: int | None = None  # steps since the last change in the buffer
    _clock: np.ndarray | None = None  # E_c(t) since the first step, every grid c
    _first_clock: np.ndarray | None = None  # E_c at the first step read (the loss offsets' unit)
    _pending: deque = field(default_factory=deque)  # (loss, batch, b_noise, usable) awaiting φ(t + lag)
    # a square-wave experiment (`core.control.experiments.DITHER_HALF_STEPS`, docs/robust-goodput.md §6.33):
    # the changes inside an open window do not extend it; each one's transient is still skipped
    hold_window: bool = False
    _since_last: int = 0  # steps since the last change (its transient)

    def __post_init__(self) -> None:
        if self.lag_steps is None:
            self.lag_steps = DEFAULT_LAG_STEPS
        if self.lag_decay is None:
            self.lag_decay = DEFAULT_LAG_DECAY
        if self.lag_level is None:
            self.lag_level = DEFAULT_LAG_LEVEL
        if not (isinstance(self.lag_steps, int) and self.lag_steps >= 0):
            raise ValueError(f"lag_steps={self.lag_steps!r} is invalid; allowed: an integer >= 0")
        for name in ("prior_c", "prior_octaves", "tempering"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r} is invalid; allowed: a finite number > 0")
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"quantile={self.quantile!r} is invalid; allowed: 0 < q < 1")
        if self.window_steps < 4 or self.skip_steps < 0 or self.min_fit_steps < 4:
            raise ValueError(
                f"window_steps={self.window_steps}, skip_steps={self.skip_steps}, "
                f"min_fit_steps={self.min_fit_steps} are invalid; allowed: "
                "window >= 4, skip >= 0, min_fit >= 4"
            )
        if not 0.0 < self.prior_lr_aware < 1.0 or not self.lr_exponents:
            raise ValueError(f"prior_lr_aware={self.prior_lr_aware!r} is invalid; allowed: 0 < p < 1")
        z = (self.log2_grid - math.log2(self.prior_c)) / self.prior_octaves
        n = len(self.lr_exponents)
        prior_g = np.full(n, (1.0 - self.prior_lr_aware) / max(n - 1, 1))
        prior_g[-1] = self.prior_lr_aware if n > 1 else 1.0
        if self.lr_fractions:
            if any(not (math.isfinite(x) and x > 0) for x in self.lr_fractions) or not 0 < self.prior_lr_fractions < 1:
                raise ValueError(
                    f"lr_fractions={self.lr_fractions!r}, prior_lr_fractions={self.prior_lr_fractions!r} are "
                    "invalid; allowed: finite numbers > 0, 0 < prior < 1"
                )
            frac = np.full(len(self.lr_fractions), self.prior_lr_fractions / len(self.lr_fractions))
            prior_g = np.concatenate([prior_g * (1.0 - self.prior_lr_fractions), frac])
        if any(not (math.isfinite(a) and a > 0) for a in self.loss_exponents):
            raise ValueError(f"loss_exponents={self.loss_exponents!r} are invalid; allowed: finite numbers > 0")
        if not self.loss_offsets or any(not (math.isfinite(f) and f >= 0) for f in self.loss_offsets):
            raise ValueError(f"loss_offsets={self.loss_offsets!r} are invalid; allowed: finite numbers >= 0")
        n_alpha = max(len(self.loss_exponents) * len(self.loss_offsets), 1)
        self.log_post = np.log(prior_g)[:, None, None] - 0.5 * (z * z)[None, None, :] + np.zeros((1, n_alpha, 1))

    # ---- reading ---------------------------------------------------------------------------

    def joint(self) -> np.ndarray:
        """p(γ, c) on the grid (the loss exponent α summed out), shape (len(lr_exponents),
        len(log2_grid))."""
        p = np.exp(self.log_post - np.max(self.log_post)).sum(axis=1)
        return p / p.sum()

    def _curve_marginal(self) -> np.ndarray:
        """Unnormalised p(α, f), shape (len(loss_exponents), len(loss_offsets))."""
        p = np.exp(self.log_post - np.max(self.log_post)).sum(axis=(0, 2))
        return p.reshape(len(self.loss_exponents), len(self.loss_offsets))

    def loss_exponent(self) -> float | None:
        """The most probable loss exponent α (None: the quadratic fit)."""
        if not self.loss_exponents:
            return None
        return float(self.loss_exponents[int(np.argmax(self._curve_marginal().sum(axis=1)))])

    def loss_offset(self) -> float | None:
        """The most probable offset fraction f (E_0 = f·E_c at the first read; None: the quadratic)."""
        if not self.loss_exponents:
            return None
        return float(self.loss_offsets[int(np.argmax(self._curve_marginal().sum(axis=0)))])

    def probabilities(self) -> np.ndarray:
        """p(c), the marginal over the LR exponents."""
        return self.joint().sum(axis=0)

    def lr_exponent(self) -> float:
        """The most probable LR exponent γ (decisions use it: ½ = goodput × sqrt(B))."""
        p = self.joint().sum(axis=1)[: len(self.lr_exponents)]
        return float(self.lr_exponents[int(np.argmax(p))])

    def p_lr_aware(self) -> float:
        """Posterior probability of the last LR exponent (½: COPUS's LR-aware factor)."""
        return float(self.joint().sum(axis=1)[len(self.lr_exponents) - 1])

    def lr_fraction_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """(x0 hypotheses, their posterior probabilities) of the sqrt LR rule's rows; the rest of
        the mass (1 − their sum) is on the exponents' rows (LR re-tuned: no overshoot)."""
        p = self.joint().sum(axis=1)[len(self.lr_exponents) :]
        return np.asarray(self.lr_fractions, dtype=float), p

    def quantile_c(self, q: float, given_exponent: bool = False) -> float:
        """The q-quantile of c (each grid point's mass spread over its quarter-octave cell:
        the CDF at a point counts half of its own mass; linear in log c between points);
        `given_exponent`: conditional on the most probable LR exponent."""
        joint = self.joint()
        p = joint[int(np.argmax(joint.sum(axis=1)))] if given_exponent else joint.sum(axis=0)
        p = p / p.sum()
        cdf = np.cumsum(p) - 0.5 * p
        scale = self._lag_ratio if self.lag_level and (self.lag_steps or self.lag_decay) else 1.0
        return float(2.0 ** np.interp(q, cdf, self.log2_grid)) * scale

    def row_hypotheses(self, points: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(c, weight, x0): equal-mass quantiles of c within each row of the joint posterior, about
        2·`points` in all, each row's count in proportion to its mass (at least one; rows of mass
        < 1 % left out): the LR exponents' rows with x0 = nan (the LR re-tuned for every B), then
        one per sqrt-rule x0 (`lr_fractions`). The rows' hypotheses of c stay paired with their own
        LR factor (docs/robust-goodput.md §6.35)."""
        joint = self.joint()
        x0s = [math.nan] * len(self.lr_exponents) + [float(x) for x in self.lr_fractions]
        scale = self._lag_ratio if self.lag_level and (self.lag_steps or self.lag_decay) else 1.0
        cs, ws, xs = [], [], []
        for row, x0 in zip(joint, x0s, strict=True):
            mass = float(row.sum())
            if mass < 0.01:
                continue
            n = max(int(round(2 * points * mass)), 1)
            q = (np.arange(n) + 0.5) / n
            p = row / mass
            cs.append(2.0 ** np.interp(q, np.cumsum(p) - 0.5 * p, self.log2_grid) * scale)
            ws.append(np.full(n, mass / n))
            xs.append(np.full(n, x0))
        w = np.concatenate(ws)
        return np.concatenate(cs), w / w.sum(), np.concatenate(xs)

    def value(self) -> float:
        """The c decisions use: the posterior `quantile` (median by default) of c given the
        most probable LR exponent."""
        return self.quantile_c(self.quantile, given_exponent=True)

    @property
    def window_open(self) -> bool:
        """Whether a batch change is waiting for its post-window (an experiment under way),
        counting a change still in the lag line (`lag_steps`)."""
        if self._since_change is not None:
            return True
        prev = self._last_batch
        for _, batch, _, usable in self._pending:
            if not usable:
                continue
            if prev is None:
                prev = batch
            elif batch != prev and abs(math.log(batch / prev)) >= math.log(self.min_ratio):
                return True
        return False

    @property
    def window_span(self) -> int:
        """Steps from a change until its window closes: skip + window steps, and the lag line's
        current lag (`lag_steps`) on top: the steps an experiment's batch is held."""
        return self.skip_steps + self.window_steps + self._lag_now

    def interval_ratio(self) -> float:
        """p95 / p05 of c: how many-fold the 90 % interval spans."""
        return self.quantile_c(0.95) / self.quantile_c(0.05)

    def loss_trend(self, span_steps: int) -> tuple[float, float, float] | None:
        """What an experiment's window would see, from the steps kept at the current batch
        (`core.control.experiment_value`), or None with fewer than `min_fit_steps` of them:
        (g = |dL/dstep| at the last step, σ = one step's loss noise, m = the rms misfit that a
        quadratic in x = log E (the posterior's fit, E on the prior median's clock) would leave
        over a window of `span_steps` steps). A quadratic in x fitted by least squares gives
        L_x and L_xx at the last step and σ (its residual sd); for the loss curve's next term
        the power law L − L∞ ∝ E^(−α) gives L_xxx = L_xx²/L_x, and a cubic c3·u³ on u ∈ [−H, H]
        leaves rms 0.151·|c3|·H³ after the best quadratic (Legendre P3), H = half the window in x."""
        tail = []
        for s in reversed(self._buffer):
            if s.batch != self._last_batch:
                break
            tail.append(s)
        n = len(tail)
        if n < self.min_fit_steps:
            return None
        col = int(np.argmin(np.abs(self.log2_grid - math.log2(self.prior_c))))
        x = np.log(np.maximum([s.clock[0, col] for s in reversed(tail)], 1e-12))
        x = x - x[-1]  # 0 at the last step
        y = np.array([s.loss for s in reversed(tail)], dtype=float)
        design = np.stack([np.ones(n), x, x * x], axis=1)
        coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        resid = y - design @ coef
        sigma = float(np.sqrt(resid @ resid / (n - 3)))
        q = max(n // 4, 1)
        dx = float(x[-1] - x[-1 - q]) / q  # x per step now (the last quarter of the steps)
        d1, d2 = float(coef[1]), 2.0 * float(coef[2])
        c3 = d2 * d2 / d1 / 6.0 if d1 != 0 else 0.0
        misfit = 0.151 * abs(c3) * (0.5 * dx * span_steps) ** 3
        return abs(d1) * dx, sigma, misfit

    def mean_c(self) -> float:
        """Posterior mean of c on the grid (E[c], not exp E[log c])."""
        return float(np.sum(self.probabilities() * 2.0**self.log2_grid))

    def summary(self) -> dict:
        """JSON-ready: what decisions.jsonl and `copus report` show."""
        return {
            "c": self.value(),
            "mean": self.mean_c(),
            "median": self.quantile_c(0.5),
            "p05": self.quantile_c(0.05),
            "p95": self.quantile_c(0.95),
            "p_lr_aware": self.p_lr_aware(),
            "experiments": len(self.experiments),
        }

    # ---- learning --------------------------------------------------------------------------

    def observe(
        self, loss: float, batch: float, b_noise: float, usable: bool = True, tokens: float | None = None
    ) -> dict | None:
        """One optimizer step (reported loss, global batch in samples, online b_noise).

        Returns the experiment's row when this step closed a window (else None). A step with a
        non-finite loss or noise scale, or `usable` False (the LR warm-up: there the LR, not
        the batch, limits progress, and a larger batch with its larger LR gains more per
        sample than any E(B) allows), ends the current window without evidence; the clock
        still advances.
        """
        if not batch > 0:
            raise ValueError(f"batch={batch!r} is invalid; allowed: a number > 0")
        if not (self.lag_steps or self.lag_decay):
            return self._observe(loss, batch, b_noise, usable)
        # the lag line: step t enters the clock when φ_ema(t + lag) ≈ φ(t) has been reported
        self._pending.append((float(loss), float(batch), float(b_noise), bool(usable)))
        self._seen += 1
        lag = self._lag_now = self._current_lag(tokens)
        row = None
        while self._pending and self._seen - len(self._pending) <= self._seen - 1 - lag:
            old_loss, old_batch, old_phi, old_usable = self._pending.popleft()
            good = math.isfinite(old_phi) and old_phi > 0
            later = b_noise if math.isfinite(b_noise) and b_noise > 0 else old_phi
            if good and later != old_phi:
                self._lag_ratio = later / old_phi
            row = self._observe(old_loss, old_batch, later, old_usable and good) or row
        return row

    def _current_lag(self, tokens: float | None) -> int:
        """The estimator's lag now in steps: `lag_steps`, or with `lag_decay` the mean age
        A/W of the EMA's weights (W' = a·W + (1 − a), A' = a·(A + W); a from the schedule)."""
        if not self.lag_decay:
            return int(self.lag_steps)
        early, late, switch = self.lag_decay
        a = early if tokens is None or tokens < switch else late
        self._ema_age = a * (self._ema_age + self._ema_w)
        self._ema_w = a * self._ema_w + (1.0 - a)
        return round(self._ema_age / self._ema_w)

    def _observe(self, loss: float, batch: float, b_noise: float, usable: bool) -> dict | None:
        """`observe` for one step whose φ is known (after the lag line)."""
        self._advance_clock(float(batch), b_noise)
        if not (usable and math.isfinite(loss) and math.isfinite(b_noise) and b_noise > 0):
            self._reset()
            return None
        if self._first_clock is None:
            self._first_clock = self._clock.copy()
        changed = (
            self._last_batch is not None
            and batch != self._last_batch
            and abs(math.log(batch / self._last_batch)) >= math.log(self.min_ratio)
        )
        if self._last_batch is None or changed:
            self._last_batch = float(batch)
        self._since_last = 0 if changed else self._since_last + 1
        if changed and not (self.hold_window and self._since_change is not None):
            self._since_change = 0
        elif self._since_change is not None:
            self._since_change += 1
        in_transient = self._since_change is not None and self._since_last < self.skip_steps
        self._buffer.append(WindowStep(float(loss), float(batch), float(b_noise), not in_transient, self._clock.copy()))
        if self._since_change is None:
            del self._buffer[: -self.window_steps]  # only the pre-window is kept
            return None
        if self._since_change >= self.skip_steps + self.window_steps or len(self._buffer) >= 5 * self.window_steps:
            return self._close()
        return None

    def _advance_clock(self, batch: float, b_noise: float) -> None:
        """E_{γ,c} += B^γ · B·cφ/(cφ + B) for every grid (γ, c) (φ unknown: E = 1)."""
        if self._clock is None:
            self._clock = np.zeros((len(self.lr_exponents) + len(self.lr_fractions), len(self.log2_grid)))
        lr = np.power(batch, np.asarray(self.lr_exponents, dtype=float))[:, None]
        lr = np.concatenate([np.broadcast_to(lr, (len(lr), len(self.log2_grid))), self._lr_rows(batch, b_noise)])
        if math.isfinite(b_noise) and b_noise > 0:
            bc = (2.0**self.log2_grid) * b_noise
            self._clock += lr * (batch * bc / (bc + batch))[None, :]
        else:
            self._clock += lr * batch

    def _lr_rows(self, batch: float, b_noise: float) -> np.ndarray:
        """(len(lr_fractions), G): the sqrt rule's factor 2x − x² per x0 and grid c (B_crit =
        cφ; φ unknown: B_crit ≫ B, x = x0·sqrt(B/B_ref)); `core.stats.lr_progress`."""
        if not self.lr_fractions:
            return np.zeros((0, len(self.log2_grid)))
        bc = (2.0**self.log2_grid) * b_noise if math.isfinite(b_noise) and b_noise > 0 else np.inf
        x0 = np.asarray(self.lr_fractions, dtype=float)[:, None]
        return sqrt_rule_factor(
            batch,
            np.broadcast_to(bc, self.log2_grid.shape)[None, :],
            x0,
            self.lr_ref_batch,
            self.lr_opt_exponent,
            overshoot_only=self.lr_overshoot_only,
        )

    def _reset(self) -> None:
        self._buffer, self._since_change, self.hold_window = [], None, False

    def _close(self) -> dict | None:
        steps, self._buffer, self._since_change, self.hold_window = self._buffer, [], None, False
        loglik = window_log_likelihood(
            steps,
            self.log2_grid,
            self.min_fit_steps,
            self.lr_exponents,
            self.loss_exponents,
            self.average_quadratic,
            self.effective_n,
            self.loss_offsets,
            self._first_clock,
        )
        if loglik is None:
            return None
        self.log_post = self.log_post + self.tempering * loglik
        self.log_post -= np.max(self.log_post)
        batches = sorted({s.batch for s in steps})
        row = {
            "steps": len(steps),
            "batches": batches,
            "b_noise": float(np.median([s.b_noise for s in steps])),
            "c_ml": float(2.0 ** self.log2_grid[int(np.argmax(loglik)) % len(self.log2_grid)]),
            "alpha": self.loss_exponent(),
            "lag_steps": self._lag_now,
            "lag_ratio": self._lag_ratio if self.lag_level and (self.lag_steps or self.lag_decay) else 1.0,
        } | self.summary()
        self.experiments.append(row)
        return row

    # ---- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "log_post": self.log_post.tolist(),
            "log2_grid": self.log2_grid.tolist(),
            "experiments": list(self.experiments),
            "clock": None if self._clock is None else self._clock.tolist(),
            "first_clock": None if self._first_clock is None else self._first_clock.tolist(),
            "pending": [list(p) for p in self._pending],
            "lag_state": [self._ema_w, self._ema_age, self._seen, self._lag_ratio],
        }

    def load_state_dict(self, state: dict) -> None:
        grid = np.asarray(state["log2_grid"], dtype=float)
        post = np.asarray(state["log_post"], dtype=float)
        if post.ndim == 2 and post.shape[0] == self.log_post.shape[0]:  # saved before the α axis
            post = np.broadcast_to(post[:, None, :], self.log_post.shape).copy()
        n_off = len(self.loss_offsets)
        if post.ndim == 3 and n_off > 1 and post.shape[1] * n_off == self.log_post.shape[1]:
            post = np.repeat(post, n_off, axis=1)  # saved before the offsets: uniform over them
        if (
            grid.shape != self.log2_grid.shape
            or not np.allclose(grid, self.log2_grid)
            or post.shape != self.log_post.shape
        ):
            raise ValueError(
                "calibration posterior state has another grid; allowed: "
                f"{GRID_POINTS} points over log2 c in {LOG2_C_RANGE}"
            )
        self.log_post = post
        self.experiments = list(state.get("experiments", []))
        clock = state.get("clock")
        self._clock = None if clock is None else np.asarray(clock, dtype=float)
        first = state.get("first_clock")
        self._first_clock = None if first is None else np.asarray(first, dtype=float)
        self._reset()
        self._pending = deque(tuple(p) for p in state.get("pending", []))
        self._ema_w, self._ema_age, seen, self._lag_ratio = state.get("lag_state", [0.0, 0.0, 0, 1.0])
        self._seen = int(seen)
