"""A gradient-noise-scale estimate that keeps up with a falling |G|² (issue 14; cbs-notes §4, §5.6).

One EMA has to trade lag against noise. Its time constant τ_E lags a trend: if |G|² ∝ e^(−t/τ_G),
the EMA over-estimates |G|² by about 1/(1 − τ_E/τ_G), so b_noise = tr(Σ)/|G|² comes out low
(cbs-notes §4: β = 0.99 and |G|² halving every 500 steps gives b_noise 14 % low; when |G|² falls
100× in 100 steps a 20-step EMA is off by a factor of ~10). A short EMA is unbiased but noisy:
with 2 small gradients per step one step's |G|² estimate has a relative spread of ~2 (measured on
the tiny model at B = 8).

`TrackingGnsEstimator` keeps a bank of bias-corrected EMA pairs (the `core.gns.GnsEstimator`
sums) with time constants τ_k = ref_batch·2^k samples, k = 0..levels−1. Each update decays
level k by exp(−B/τ_k) = β_k^(B/B0): the decay is tied to samples, as in AdaptDL
(`gradient_noise_scale.py`, θ = 0.999^scale), so growing the batch does not lengthen the window
in samples. The estimate is the longest level that agrees with every shorter one (Lepski's
method for adaptive smoothing, Lepski 1991; Spokoiny 1998):

    k* = max{k : |ln φ_k − ln φ_j| ≤ z_L·σ_j for every j < k with a finite σ_j}

with σ_j the delta-method relative error of level j (`GnsEstimator.rel_err`). While the
statistics are steady all levels agree and the longest (least noisy) one is used; when they
drift, the long levels leave the short levels' confidence bands and the estimate falls back to
a window short enough to follow. `rel_err` is the chosen level's, so a policy acting on the
lower bound φ·exp(−z·rel_err) (`core.gns.lower_bound`) sees the extra noise of a short window.
"""

from __future__ import annotations

import math

from copus.core.stats.gns import GnsEstimator

STATE_VERSION = 1


class TrackingGnsEstimator:
    """Drop-in for `GnsEstimator` (same update/properties/state API); see the module docstring.

    `ref_batch` = B0 in samples (the shortest time constant; the run's initial global batch);
    `levels` = number of time constants (B0·2^0 … B0·2^(levels−1) samples); `lepski_z` = z_L.
    """

    def __init__(self, ref_batch: float, levels: int = 9, lepski_z: float = 2.0) -> None:
        if not (isinstance(ref_batch, int | float) and ref_batch > 0 and math.isfinite(ref_batch)):
            raise ValueError(f"ref_batch={ref_batch!r} is invalid; allowed: a finite number > 0")
        if not isinstance(levels, int) or levels < 1:
            raise ValueError(f"levels={levels!r} is invalid; allowed: an integer >= 1")
        if not lepski_z > 0:
            raise ValueError(f"lepski_z={lepski_z!r} is invalid; allowed: a number > 0")
        self.ref_batch = float(ref_batch)
        self.timescales = [self.ref_batch * 2.0**k for k in range(levels)]
        self.lepski_z = float(lepski_z)
        self.levels = [GnsEstimator(0.5) for _ in self.timescales]
        self.num_skipped = 0
        self._chosen: int | None = None

    # ---- updates ---------------------------------------------------------------------------
    def update(
        self, small_sqnorm: float, small_batch: float, big_sqnorm: float, big_batch: float, tokens: int = 0
    ) -> bool:
        """Add one step's statistics to every level (decay exp(−B/τ_k)); False if unusable."""
        ok = False
        for tau, level in zip(self.timescales, self.levels):
            decay = math.exp(-float(big_batch) / tau) if _positive(big_batch) else 0.0
            ok = level.update(small_sqnorm, small_batch, big_sqnorm, big_batch, tokens, decay=decay)
            if not ok:
                break
        if not ok:
            self.num_skipped += 1
        self._chosen = None
        return ok

    def chosen_level(self) -> int:
        """Index of the level in use (Lepski's rule; 0 before any update)."""
        if self._chosen is None:
            self._chosen = self._select()
        return self._chosen

    def _select(self) -> int:
        """Lepski's rule over the levels with a finite positive φ (a short level whose |G|²
        EMA is ≤ 0 says nothing about the others and is passed over); the longest level
        when none has one (its φ is then inf, 0 or NaN: no signal, or no data)."""
        logs = [_log(lv.b_noise) for lv in self.levels]
        errs = [lv.rel_err for lv in self.levels]
        usable = [k for k, lk in enumerate(logs) if lk is not None]
        if not usable:
            return len(self.levels) - 1
        best = usable[0]
        for k in usable[1:]:
            bands = [(logs[j], errs[j]) for j in usable if j < k and math.isfinite(errs[j])]
            if any(abs(logs[k] - lj) > self.lepski_z * sj for lj, sj in bands):
                break
            best = k
        return best

    # ---- the estimate ----------------------------------------------------------------------
    @property
    def _level(self) -> GnsEstimator:
        return self.levels[self.chosen_level()]

    @property
    def timescale_samples(self) -> float:
        """Time constant of the level in use, in samples."""
        return self.timescales[self.chosen_level()]

    @property
    def num_updates(self) -> int:
        return self.levels[0].num_updates

    @property
    def grad_sqnorm(self) -> float:
        return self._level.grad_sqnorm

    @property
    def grad_trace_cov(self) -> float:
        return self._level.grad_trace_cov

    @property
    def b_noise(self) -> float:
        return self._level.b_noise

    @property
    def rel_err(self) -> float:
        return self._level.rel_err

    @property
    def num_effective(self) -> float:
        return self._level.num_effective

    @property
    def last_grad_sqnorm(self) -> float:
        return self.levels[0].last_grad_sqnorm

    @property
    def last_grad_trace_cov(self) -> float:
        return self.levels[0].last_grad_trace_cov

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "kind": "tracking",
            "ref_batch": self.ref_batch,
            "lepski_z": self.lepski_z,
            "num_skipped": self.num_skipped,
            "num_updates": self.num_updates,
            "levels": [lv.state_dict() for lv in self.levels],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; the level count and B0 must match the configuration."""
        if state.get("kind") is None and state.get("version") == 1:
            raise ValueError(
                "GNS state kind='ema' (one EMA: copus 0.1, or gns.estimator='ema') is "
                "invalid for gns.estimator='tracking'; allowed: resume it with "
                "--set gns.estimator=ema, or start a new run"
            )
        if state.get("version") != STATE_VERSION or state.get("kind") != "tracking":
            raise ValueError(
                f"GNS state kind={state.get('kind')!r} version="
                f"{state.get('version')!r} is invalid; allowed: tracking, "
                f"{STATE_VERSION}"
            )
        if len(state["levels"]) != len(self.levels) or float(state["ref_batch"]) != self.ref_batch:
            raise ValueError(
                f"GNS state with {len(state['levels'])} levels at ref_batch="
                f"{state['ref_batch']} is invalid here; allowed: {len(self.levels)}"
                f" levels at ref_batch={self.ref_batch:g}"
            )
        for lv, st in zip(self.levels, state["levels"]):
            lv.load_state_dict(st)
        self.num_skipped = int(state.get("num_skipped", 0))
        self._chosen = None


ESTIMATORS = ("tracking", "ema")


def resolve_estimator(kind: str, policy: str) -> str:
    """`gns.estimator = "auto"` → "ema" under the goodput policies, "tracking" otherwise.

    The goodput controllers scale the noise scale by c = B_crit / φ learnt from the loss
    (`core.stats.calibration_posterior`): a consistent bias of φ is absorbed into c, a bias
    that changes with the estimator's chosen window is not. On the simulator's honest grid
    (seed 0, 40 cells) the planner captured a median 0.52 of the ceiling reading the EMA and
    0.15 reading the tracking estimator; on the CPU head-to-head the EMA run grew later and was
    level with static B=8 (docs/robust-goodput.md §6.15). COPUS §3.2 reads an EMA too."""
    if kind != "auto":
        return kind
    return "ema" if policy.startswith("goodput") else "tracking"


def make_estimator(
    kind: str,
    *,
    ref_batch: float,
    decay: float = 0.95,
    decay_late: float = 0.99,
    decay_switch_tokens: int = 8_000_000,
    levels: int = 9,
    lepski_z: float = 2.0,
) -> TrackingGnsEstimator | GnsEstimator:
    """`gns.estimator`: "tracking" (this module, the default) or "ema" (COPUS §3.2: one EMA
    per step, `decay` before `decay_switch_tokens` tokens, then `decay_late`)."""
    from copus.core.stats.gns import DecaySchedule

    if kind == "tracking":
        return TrackingGnsEstimator(ref_batch, levels=levels, lepski_z=lepski_z)
    if kind == "ema":
        return GnsEstimator(DecaySchedule(decay=decay, decay_late=decay_late, switch_tokens=decay_switch_tokens))
    raise ValueError(f"gns.estimator={kind!r} is invalid; allowed: {', '.join(ESTIMATORS)}")


def _positive(x: float) -> bool:
    try:
        return math.isfinite(x) and x > 0
    except TypeError:
        return False


def _log(b: float) -> float | None:
    return math.log(b) if math.isfinite(b) and b > 0 else None
