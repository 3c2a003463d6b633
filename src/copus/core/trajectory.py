"""Loss and gradient-noise trajectory of a simulated training run (pure; no torch).

The simulator needs a ground truth that the policies do not see: how the loss falls per sample
at a given batch size, and the true gradient statistics |G|² and tr(Σ) at each loss. The model:

- **Progress** is counted in *effective samples* E (McCandlish et al. 2018, "An Empirical Model
  of Large-Batch Training", §2.2 and App. D: `E = E_min · (1 + B/B_crit)` samples at batch B
  buy the progress of `E_min` samples at a tiny batch). One optimizer step at batch B therefore
  adds `ΔE = B · B_crit / (B_crit + B)`, assuming the learning rate is tuned for B (Adam with
  the square-root rule is close to that; the LR-aware factor of COPUS Eq. 8 is the
  *controller's* assumption, not this model's).
- **Loss** is a saturating power law in effective samples,
  `L(E) = L_inf + (L_0 − L_inf) · (1 + E/E_0)^(−α)` (Kaplan et al. 2020, "Scaling Laws for
  Neural Language Models", §4–5, L(D) and L(S) power laws; `L_0` is the loss at
  initialisation, ≈ ln(vocab)).
- **Critical batch** grows as the loss falls, `B_crit(L) = B* / L^(1/α_B)` tokens (Kaplan et al.
  2020, Eq. 5.2 / Fig. 10, fitted on WebText2: `B* ≈ 2e8` tokens, `α_B ≈ 0.21`; McCandlish
  et al. 2018 found B_crit grows by orders of magnitude during training).
- **Measured GNS.** The simple noise scale `b_noise = tr(Σ)/|G|²` (what the two-batch estimator
  measures, McCandlish §2.3) differs from B_crit by a factor; COPUS calibrates it with
  `c = 2` (COPUS §3.3), so by default `b_noise = B_crit / 2`.
- **Estimator noise.** Per-micro-batch gradients are modelled as `g_i = G + σ z_i`, `z_i ~ N(0,
  I_d)` in an effective dimension `d` (`noise_dim`), `σ² = tr(Σ)/(b·d)`; the statistics the
  trainer all-reduces, `s̄ = mean ‖g_i‖²` and `q = ‖mean g_i‖²`, are sampled exactly from
  their joint law in O(1) per step (see `sample_grad_stats`). A smaller `d` means noisier
  per-step GNS estimates (real LLM gradient noise is strongly anisotropic: small effective d).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

KAPLAN_BCRIT_STAR_TOKENS = 2.0e8
KAPLAN_BCRIT_EXPONENT = 0.21


@dataclass(frozen=True, slots=True, kw_only=True)
class TrajectoryParams:
    """Parameters of the loss / GNS ground truth (module docstring gives the equations)."""

    initial_loss: float = 11.0            # L_0, ≈ ln(vocab_size) at initialisation
    # L(E) defaults: the median of the four COPUS presets' fits (core.presets), which lie in
    # E_0 ∈ [6.5, 250] samples and α ∈ [0.19, 0.27] with L_inf = 1.0.
    final_loss: float = 1.0               # L_inf, irreducible loss of this model on this data
    progress_scale_samples: float = 46.0  # E_0: effective samples where the power law bends
    loss_exponent: float = 0.24           # α of L(E)
    bcrit_star_tokens: float = KAPLAN_BCRIT_STAR_TOKENS  # B* (Kaplan et al. 2020, Eq. 5.2)
    bcrit_exponent: float = KAPLAN_BCRIT_EXPONENT        # α_B
    gns_calibration: float = 2.0          # B_crit / b_noise (COPUS c)
    min_bcrit_samples: float = 1.0        # floor on B_crit, keeps early steps finite
    grad_sqnorm_scale: float = 1.0        # |G|² = scale · (L − L_inf)² (any scale: ratios matter)
    noise_dim: float = 64.0               # effective gradient dimension d of the noise model

    def __post_init__(self) -> None:
        if not self.initial_loss > self.final_loss >= 0:
            raise ValueError(f"initial_loss={self.initial_loss}, final_loss={self.final_loss} are "
                             "invalid; allowed: initial_loss > final_loss >= 0")
        for name in ("progress_scale_samples", "loss_exponent", "bcrit_star_tokens",
                     "bcrit_exponent", "gns_calibration", "min_bcrit_samples",
                     "grad_sqnorm_scale", "noise_dim"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} is invalid; allowed: a finite number > 0")

    def with_(self, **kw) -> TrajectoryParams:
        return replace(self, **kw)


@dataclass(frozen=True, slots=True)
class Trajectory:
    """The ground truth of one model on one data set, with sequences of `seq_len` tokens."""

    params: TrajectoryParams
    seq_len: int

    def loss(self, progress: float) -> float:
        """L(E) = L_inf + (L_0 − L_inf)(1 + E/E_0)^(−α), E in effective samples."""
        p = self.params
        return p.final_loss + (p.initial_loss - p.final_loss) * (
            1.0 + max(progress, 0.0) / p.progress_scale_samples) ** (-p.loss_exponent)

    def progress_for_loss(self, loss: float) -> float:
        """Inverse of `loss`: effective samples needed to reach `loss` (inf if ≤ L_inf)."""
        p = self.params
        if loss <= p.final_loss:
            return math.inf
        if loss >= p.initial_loss:
            return 0.0
        ratio = (loss - p.final_loss) / (p.initial_loss - p.final_loss)
        return p.progress_scale_samples * (ratio ** (-1.0 / p.loss_exponent) - 1.0)

    def critical_batch(self, loss: float) -> float:
        """B_crit(L) = B*/L^(1/α_B) in samples (Kaplan et al. 2020 Eq. 5.2, tokens / seq_len)."""
        p = self.params
        tokens = p.bcrit_star_tokens / max(loss, 1e-6) ** (1.0 / p.bcrit_exponent)
        return max(tokens / self.seq_len, p.min_bcrit_samples)

    def b_noise(self, loss: float) -> float:
        """The simple noise scale tr(Σ)/|G|² the estimator measures: B_crit / c."""
        return self.critical_batch(loss) / self.params.gns_calibration

    def grad_sqnorm(self, loss: float) -> float:
        """True |G|² (arbitrary units): scale · (L − L_inf)²."""
        p = self.params
        return p.grad_sqnorm_scale * max(loss - p.final_loss, 1e-6) ** 2

    def grad_trace_cov(self, loss: float) -> float:
        """True per-sample tr(Σ) = b_noise · |G|²."""
        return self.b_noise(loss) * self.grad_sqnorm(loss)

    def progress_per_step(self, global_batch_size: float, loss: float) -> float:
        """ΔE = B·B_crit/(B_crit + B): one step's effective samples (McCandlish 2018, Eq. 2.11)."""
        bcrit = self.critical_batch(loss)
        return global_batch_size * bcrit / (bcrit + global_batch_size)

    def sample_grad_stats(self, rng: np.random.Generator, loss: float, global_batch_size: int,
                          num_small: int) -> tuple[float, float]:
        """Draw (s̄, q): mean squared norm of `num_small` small gradients and the big one's.

        With g_i = G + σ z_i, z̄ = mean z_i ~ N(0, I/N) and W = Σ‖z_i − z̄‖² ~ χ²_{d(N−1)}
        independent of z̄:  q = ‖G + σ z̄‖²,  s̄ = q + σ² W / N.  Expectations: E[s̄] = |G|² +
        tr(Σ)/b, E[q] = |G|² + tr(Σ)/B, the two-batch estimator's inputs (design §3).
        """
        n = max(int(num_small), 1)
        d = self.params.noise_dim
        g2 = self.grad_sqnorm(loss)
        small_batch = global_batch_size / n
        sigma2 = self.grad_trace_cov(loss) / (small_batch * d)
        u = rng.standard_normal() / math.sqrt(n)             # z̄ along G
        rest = rng.chisquare(max(d - 1.0, 1e-9)) / n          # ‖z̄‖² across G
        q = g2 + 2.0 * math.sqrt(sigma2 * g2) * u + sigma2 * (u * u + rest)
        w = rng.chisquare(d * (n - 1)) if n > 1 else 0.0
        return q + sigma2 * w / n, q
