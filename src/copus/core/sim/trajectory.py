"""Loss and gradient-noise trajectory of a simulated training run (pure; no torch).

The simulator needs a ground truth that the policies do not see: how the loss falls per sample
at a given batch size, and the true gradient statistics |G|² and tr(Σ) at each loss. The model:

- **Progress** is counted in *effective samples* E (McCandlish et al. 2018, "An Empirical Model
  of Large-Batch Training", §2.2 and App. D: `E = E_min · (1 + B/B_crit)` samples at batch B
  buy the progress of `E_min` samples at a tiny batch). One optimizer step at batch B therefore
  adds `ΔE = B · B_crit / (B_crit + B)`, assuming the learning rate is tuned for B (Adam with
  the square-root rule is close to that; the LR-aware factor of COPUS Eq. 8 is the
  *controller's* assumption, not this model's). This is the truth `LR_TUNED`.
- **Untuned, sqrt-scaled LR** (truth `SQRT_LR`, `core.lr_progress`): COPUS runs every method
  at η = η0·sqrt(B/16) from one base LR, constant after an 8M-token warm-up. At x = η/ε_opt(B)
  the quadratic model gives ΔE = B·B_crit/(B_crit + B)·(2x − x²) (McCandlish Eqs. 2.5–2.7),
  with x = x0·w·sqrt(B/16)·[(1 + B_crit/B)/(1 + B_crit/16)]^p (B_noise of Eq. 2.6 taken as
  B_crit, McCandlish §2.3) and x0 = η0/ε_opt(16) the one fitted parameter.
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

from copus.core.stats.lr_progress import sqrt_lr_progress_factor

LR_TUNED = "lr-tuned"  # progress E(B): the LR re-tuned for every batch (McCandlish Eq. 2.11)
SQRT_LR = "sqrt-lr"  # η0·sqrt(B/16), untuned: E(B)·(2x − x²) (core.lr_progress)
LR_MODELS = (LR_TUNED, SQRT_LR)
KAPLAN_BCRIT_STAR_TOKENS = 2.0e8
KAPLAN_BCRIT_EXPONENT = 0.21


@dataclass(frozen=True, slots=True, kw_only=True)
class TrajectoryParams:
    """Parameters of the loss / GNS ground truth (module docstring gives the equations)."""

    initial_loss: float = 11.0  # L_0, ≈ ln(vocab_size) at initialisation
    # L(E) defaults: the median of the four COPUS presets' fits (core.presets), which lie in
    # E_0 ∈ [6.5, 250] samples and α ∈ [0.19, 0.27] with L_inf = 1.0.
    final_loss: float = 1.0  # L_inf, irreducible loss of this model on this data
    progress_scale_samples: float = 46.0  # E_0: effective samples where the power law bends
    loss_exponent: float = 0.24  # α of L(E)
    bcrit_star_tokens: float = KAPLAN_BCRIT_STAR_TOKENS  # B* (Kaplan et al. 2020, Eq. 5.2)
    bcrit_exponent: float = KAPLAN_BCRIT_EXPONENT  # α_B
    gns_calibration: float = 2.0  # B_crit / b_noise (COPUS c)
    min_bcrit_samples: float = 1.0  # floor on B_crit, keeps early steps finite
    grad_sqnorm_scale: float = 1.0  # |G|² = scale · (L − L_inf)² (any scale: ratios matter)
    noise_dim: float = 64.0  # effective gradient dimension d of the noise model
    # How the LR meets the batch (module docstring): LR_TUNED or SQRT_LR; the fields below
    # matter only for SQRT_LR.
    lr_model: str = LR_TUNED
    lr_fraction_x0: float = 1.0  # x0 = η0/ε_opt(B_ref): base LR over its optimum
    lr_opt_exponent: float = 1.0  # p of ε_opt ∝ (1 + B_noise/B)^(−p): 1 SGD, ½ Adam
    lr_ref_batch: float = 16.0  # B_ref of η0·sqrt(B/B_ref) (COPUS §6.1)
    lr_warmup_tokens: float = 0.0  # linear warm-up (COPUS: 8M tokens); 0 = none

    def __post_init__(self) -> None:
        if self.lr_model not in LR_MODELS:
            raise ValueError(f"lr_model={self.lr_model!r} is invalid; allowed: {', '.join(LR_MODELS)}")
        if not (math.isfinite(self.lr_warmup_tokens) and self.lr_warmup_tokens >= 0):
            raise ValueError(f"lr_warmup_tokens={self.lr_warmup_tokens!r} is invalid; allowed: a finite number >= 0")
        if not self.initial_loss > self.final_loss >= 0:
            raise ValueError(
                f"initial_loss={self.initial_loss}, final_loss={self.final_loss} are "
                "invalid; allowed: initial_loss > final_loss >= 0"
            )
        for name in (
            "progress_scale_samples",
            "loss_exponent",
            "bcrit_star_tokens",
            "bcrit_exponent",
            "gns_calibration",
            "min_bcrit_samples",
            "grad_sqnorm_scale",
            "noise_dim",
            "lr_fraction_x0",
            "lr_opt_exponent",
            "lr_ref_batch",
        ):
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
            1.0 + max(progress, 0.0) / p.progress_scale_samples
        ) ** (-p.loss_exponent)

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

    def progress_per_step(self, global_batch_size: float, loss: float, tokens: float = math.inf) -> float:
        """One step's effective samples after `tokens` tokens of training.

        LR_TUNED: ΔE = B·B_crit/(B_crit + B) (McCandlish 2018, Eq. 2.11).
        SQRT_LR:  the same times 2x − x², x = `lr_progress.lr_fraction`.
        """
        bcrit = self.critical_batch(loss)
        tuned = global_batch_size * bcrit / (bcrit + global_batch_size)
        p = self.params
        if p.lr_model == LR_TUNED:
            return tuned
        return tuned * sqrt_lr_progress_factor(
            global_batch_size,
            bcrit,
            p.lr_fraction_x0,
            ref_batch=p.lr_ref_batch,
            exponent=p.lr_opt_exponent,
            tokens=tokens,
            warmup_tokens=p.lr_warmup_tokens,
        )

    def sample_grad_stats(
        self, rng: np.random.Generator, loss: float, global_batch_size: int, num_small: int
    ) -> tuple[float, float]:
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
        u = rng.standard_normal() / math.sqrt(n)  # z̄ along G
        rest = rng.chisquare(max(d - 1.0, 1e-9)) / n  # ‖z̄‖² across G
        q = g2 + 2.0 * math.sqrt(sigma2 * g2) * u + sigma2 * (u * u + rest)
        w = rng.chisquare(d * (n - 1)) if n > 1 else 0.0
        return q + sigma2 * w / n, q
