"""Adaptive batch-size tests from scalar statistics: the norm test (Byrd, Chin, Nocedal, Wu 2012;
in distributed form Lau et al., CPAL 2025, arXiv 2412.21124, eq. 5) and the inner-product,
orthogonality and augmented inner-product tests (Bollapragada, Byrd, Nocedal 2018, "Adaptive
sampling strategies for stochastic optimization", SIAM J. Optim.; per-sample code in the first
author's AdAdaGrad work, Lau et al. 2024, arXiv 2402.11215). Lau et al. 2025 use the norm test only.

Inputs are what the runtime measures per step without a second backward (design.md §3), over
J = `num_small` "small" gradients g_j of b = `small_batch` samples each (one per micro-batch
per dp rank, or one per dp rank), whose mean is ḡ over the current batch B = J·b:

    small_sqnorm  s̄ = (1/J) Σ_j ‖g_j‖²
    big_sqnorm    q = ‖ḡ‖²
    ip_sq_mean    (1/J) Σ_j (g_jᵀḡ)²   (inner-product / orthogonality tests only; note
                  (1/J) Σ_j g_jᵀḡ = q, so Var_j(g_jᵀḡ) needs only this and q)

Each test computes a statistic T, in samples: the smallest batch at which the test passes. It
passes when T ≤ B; otherwise the next batch is ⌈T⌉ rounded up to a multiple of dp·micro_batch_size
and capped (`decide`). Since a small gradient averages b samples, a per-sample variance is
b times the variance across small gradients; with b = 1 the "per-sample" forms below are exactly
the per-sample tests of Lau et al. §3.1 (Bollapragada et al. 2018 for inner product/orthogonality).

Normalisation of the norm test (`NORM_TEST_FORMS`, the key `batch.norm_test_form`; docs/lau.md):
- "per-sample": variance of one sample's gradient, b·J/(J−1)·(s̄ − q); η is the classic tolerance
  (T ≈ b_noise/η²), independent of how the batch is split into small gradients.
- "micro-batch": (1/J) Σ_j ‖g_j − ḡ‖² = s̄ − q over micro-batch gradients (J = dp·K, b = micro-batch
  size): the variance of one micro-batch gradient; T ≈ (J−1)/J·b_noise/(b·η²).
- "paper": the same formula over per-worker gradients (J = dp, b = per-worker batch): Lau et al.
  eq. 5 and Algorithm 1 as printed; T ≈ (J−1)/J·b_noise/(b·η²) with b = B/J, so the batch it
  asks for grows like sqrt(b_noise) and, as ‖ḡ‖² ≥ tr(Σ)/B on average, E[T] ≲ (J−1)/η²: at
  J = 4 and η = 0.2 below 75, under the paper's starting batch of 256. Needs dp ≥ 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NORM_TEST_FORMS = ("per-sample", "micro-batch", "paper")
# the small gradients each form is defined over: None = any split (b·J/(J−1) rescales it)
FORM_SMALL_GRADIENTS = {"per-sample": None, "micro-batch": "microbatch", "paper": "rank"}


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchTestResult:
    """`statistic`: batch (samples) the test asks for; `requested_batch`: rounded and capped."""

    statistic: float
    requested_batch: int
    passed: bool


def _check(
    small_sqnorm: float, big_sqnorm: float, num_small: int, small_batch: float, ip_sq_mean: float | None = None
) -> None:
    for name, value in (
        ("small_sqnorm", small_sqnorm),
        ("big_sqnorm", big_sqnorm),
        ("small_batch", small_batch),
        ("ip_sq_mean", ip_sq_mean),
    ):
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name}={value!r} is invalid; allowed: a finite number")
    if num_small < 2:
        raise ValueError(f"num_small={num_small!r} is invalid; allowed: >= 2 small gradients")
    if small_batch <= 0:
        raise ValueError(f"small_batch={small_batch!r} is invalid; allowed: > 0")


def _ratio(numerator: float, denominator: float) -> float:
    """numerator/denominator for a test statistic: a zero gradient asks for an infinite batch."""
    numerator = max(numerator, 0.0)
    if denominator <= 0:
        return math.inf if numerator > 0 else 0.0
    return numerator / denominator


def per_sample_trace_cov(small_sqnorm: float, big_sqnorm: float, num_small: int, small_batch: float) -> float:
    """tr(Σ) of one sample's gradient: b·(1/(J−1)) Σ_j ‖g_j − ḡ‖² = b·J/(J−1)·(s̄ − q).

    Lau et al. notes §1.6 ("calibrated DDP-Norm"); equals McCandlish's two-batch estimator.
    """
    return small_batch * num_small / (num_small - 1) * (small_sqnorm - big_sqnorm)


def statistic_from_terms(numerator: float, denominator: float, tolerance: float) -> float:
    """T = numerator/(tolerance²·denominator) from a test's terms (possibly window means).

    A negative numerator (noise estimate below zero) gives 0; a zero gradient gives inf.
    """
    if not tolerance > 0:
        raise ValueError(f"tolerance={tolerance!r} is invalid; allowed: a number > 0")
    return _ratio(numerator, tolerance * tolerance * denominator)


def norm_test_terms(
    small_sqnorm: float, big_sqnorm: float, num_small: int, small_batch: float, *, form: str = "per-sample"
) -> tuple[float, float]:
    """(variance, ‖ḡ‖²) of the norm test; T = variance/(η²·‖ḡ‖²) (see `norm_test_statistic`)."""
    _check(small_sqnorm, big_sqnorm, num_small, small_batch)
    if form == "per-sample":
        variance = per_sample_trace_cov(small_sqnorm, big_sqnorm, num_small, small_batch)
    elif form in ("paper", "micro-batch"):
        variance = small_sqnorm - big_sqnorm
    else:
        raise ValueError(f"norm_test_form={form!r} is invalid; allowed: {', '.join(NORM_TEST_FORMS)}")
    return variance, big_sqnorm


def norm_test_statistic(
    small_sqnorm: float, big_sqnorm: float, num_small: int, small_batch: float, *, eta: float, form: str = "per-sample"
) -> float:
    """Norm test (Byrd et al. 2012; Lau et al. eqs. 3–5): the batch B at which it passes.

    form "per-sample": T = tr(Σ)^/(η²·q) with tr(Σ)^ = `per_sample_trace_cov`. The test is
      E‖g_B − G‖² ≤ η²‖G‖²: η is the classic tolerance on the relative error of the batch
      gradient (0.5–0.9 in Byrd/Bollapragada); T ≈ b_noise/η².
    form "paper" (per-worker small gradients) and "micro-batch" (micro-batch small gradients):
      Lau et al. eq. 5 / Algorithm 1 as printed, T = Var̂/(η²·q) with
      Var̂ = (1/J) Σ_j ‖g_j − ḡ‖² = s̄ − q, the variance of a *small gradient*, not of a sample.
      This is the per-sample test with η_eff² = η²·J·b/(J−1), so η here is far smaller
      (Lau et al. use 0.05–0.275) and the fixed point grows like sqrt(b_noise), not b_noise.
      The formula is the same for both; which small gradients the caller passes decides
      (`FORM_SMALL_GRADIENTS`).
    """
    if not eta > 0:
        raise ValueError(f"norm_test_eta={eta!r} is invalid; allowed: a number > 0")
    terms = norm_test_terms(small_sqnorm, big_sqnorm, num_small, small_batch, form=form)
    return statistic_from_terms(*terms, eta)


def inner_product_terms(
    small_sqnorm: float, big_sqnorm: float, num_small: int, small_batch: float, ip_sq_mean: float
) -> tuple[float, float]:
    """(per-sample Var(∇ℓᵀḡ), ‖ḡ‖⁴): b·J/(J−1)·(ip_sq_mean − q²) and q²."""
    _check(small_sqnorm, big_sqnorm, num_small, small_batch, ip_sq_mean)
    var = small_batch * num_small / (num_small - 1) * (ip_sq_mean - big_sqnorm * big_sqnorm)
    return var, big_sqnorm * big_sqnorm


def inner_product_statistic(
    small_sqnorm: float, big_sqnorm: float, num_small: int, small_batch: float, ip_sq_mean: float, *, theta: float
) -> float:
    """Inner-product test (Bollapragada et al. 2018): Var_i(∇ℓ_iᵀḡ)/B ≤ θ²‖ḡ‖⁴.

    Per-sample variance of the projection ≈ b·Var_j(g_jᵀḡ) = b·J/(J−1)·(ip_sq_mean − q²);
    T = that/(θ²·q²). At B = J·b this is design.md's Var_j(g_jᵀḡ)/J ≤ θ²‖ḡ‖⁴.
    """
    if not theta > 0:
        raise ValueError(f"ip_theta={theta!r} is invalid; allowed: a number > 0")
    terms = inner_product_terms(small_sqnorm, big_sqnorm, num_small, small_batch, ip_sq_mean)
    return statistic_from_terms(*terms, theta)


def orthogonality_terms(
    small_sqnorm: float, big_sqnorm: float, num_small: int, small_batch: float, ip_sq_mean: float
) -> tuple[float, float]:
    """(per-sample orthogonal variance, ‖ḡ‖²): b·J/(J−1)·(s̄ − ip_sq_mean/q) and q."""
    _check(small_sqnorm, big_sqnorm, num_small, small_batch, ip_sq_mean)
    scale = small_batch * num_small / (num_small - 1)
    if big_sqnorm <= 0:
        return scale * small_sqnorm, 0.0
    return scale * (small_sqnorm - ip_sq_mean / big_sqnorm), big_sqnorm


def orthogonality_statistic(
    small_sqnorm: float, big_sqnorm: float, num_small: int, small_batch: float, ip_sq_mean: float, *, nu: float
) -> float:
    """Orthogonality test (Bollapragada et al. 2018): E‖g_B − proj_ḡ g_B‖² ≤ ν²‖ḡ‖².

    Σ_j ‖g_j − (g_jᵀḡ/q)ḡ‖² = J·(s̄ − ip_sq_mean/q) (the components have mean 0), so the
    per-sample orthogonal variance is b·J/(J−1)·(s̄ − ip_sq_mean/q); T = that/(ν²·q).
    At B = J·b this is design.md's (1/J) Σ_j ‖…‖²/(J−1) ≤ ν²‖ḡ‖².
    """
    if not nu > 0:
        raise ValueError(f"orth_nu={nu!r} is invalid; allowed: a number > 0")
    terms = orthogonality_terms(small_sqnorm, big_sqnorm, num_small, small_batch, ip_sq_mean)
    return statistic_from_terms(*terms, nu)


def round_up(value: float, multiple: int) -> int:
    """Smallest multiple of `multiple` that is ≥ value (and ≥ `multiple`): Lau et al.'s
    Algorithm 1 rounding (⌈b/(J·M)⌉ per micro-batch, times J·M), with J·M = `multiple`."""
    if math.isinf(value):
        raise ValueError("value=inf is invalid; allowed: a finite number (cap it first)")
    return max(multiple, math.ceil(value / multiple - 1e-9) * multiple)


def decide(
    statistic: float, current_batch: int, *, multiple: int = 1, max_batch: int, allow_shrink: bool = False
) -> BatchTestResult:
    """Turn a test statistic into a batch request.

    passed = statistic ≤ current_batch. The request is ⌈statistic⌉ rounded up to a multiple of
    `multiple` (dp·micro_batch_size), capped at the largest multiple ≤ `max_batch`; it is never
    below `current_batch` unless `allow_shrink` (a passed test without shrinking keeps the
    current batch, which then need not be a multiple). A current batch above the cap is kept.
    """
    if multiple < 1:
        raise ValueError(f"multiple={multiple!r} is invalid; allowed: an integer >= 1")
    if max_batch < multiple:
        raise ValueError(f"max_batch={max_batch!r} is invalid; allowed: >= multiple={multiple}")
    if math.isnan(statistic):
        raise ValueError("statistic=nan is invalid; allowed: a number >= 0 or inf")
    passed = statistic <= current_batch
    if passed and not allow_shrink:
        return BatchTestResult(statistic=statistic, requested_batch=current_batch, passed=True)
    cap = max_batch // multiple * multiple
    requested = cap if statistic >= cap else min(round_up(statistic, multiple), cap)
    if not allow_shrink:
        requested = max(requested, current_batch)
    return BatchTestResult(statistic=statistic, requested_batch=requested, passed=passed)


def norm_test(
    small_sqnorm: float,
    big_sqnorm: float,
    num_small: int,
    small_batch: float,
    *,
    eta: float,
    form: str = "per-sample",
    multiple: int = 1,
    max_batch: int,
    allow_shrink: bool = False,
) -> BatchTestResult:
    """Norm test at the current batch J·b (see `norm_test_statistic` for η in each form)."""
    t = norm_test_statistic(small_sqnorm, big_sqnorm, num_small, small_batch, eta=eta, form=form)
    return decide(
        t, _current(num_small, small_batch), multiple=multiple, max_batch=max_batch, allow_shrink=allow_shrink
    )


def inner_product_test(
    small_sqnorm: float,
    big_sqnorm: float,
    num_small: int,
    small_batch: float,
    ip_sq_mean: float,
    *,
    theta: float,
    multiple: int = 1,
    max_batch: int,
    allow_shrink: bool = False,
) -> BatchTestResult:
    t = inner_product_statistic(small_sqnorm, big_sqnorm, num_small, small_batch, ip_sq_mean, theta=theta)
    return decide(
        t, _current(num_small, small_batch), multiple=multiple, max_batch=max_batch, allow_shrink=allow_shrink
    )


def orthogonality_test(
    small_sqnorm: float,
    big_sqnorm: float,
    num_small: int,
    small_batch: float,
    ip_sq_mean: float,
    *,
    nu: float,
    multiple: int = 1,
    max_batch: int,
    allow_shrink: bool = False,
) -> BatchTestResult:
    t = orthogonality_statistic(small_sqnorm, big_sqnorm, num_small, small_batch, ip_sq_mean, nu=nu)
    return decide(
        t, _current(num_small, small_batch), multiple=multiple, max_batch=max_batch, allow_shrink=allow_shrink
    )


def augmented_statistic(
    small_sqnorm: float,
    big_sqnorm: float,
    num_small: int,
    small_batch: float,
    ip_sq_mean: float,
    *,
    theta: float,
    nu: float,
) -> float:
    """Augmented inner-product test: both tests must pass, so the larger batch wins."""
    return max(
        inner_product_statistic(small_sqnorm, big_sqnorm, num_small, small_batch, ip_sq_mean, theta=theta),
        orthogonality_statistic(small_sqnorm, big_sqnorm, num_small, small_batch, ip_sq_mean, nu=nu),
    )


def augmented_test(
    small_sqnorm: float,
    big_sqnorm: float,
    num_small: int,
    small_batch: float,
    ip_sq_mean: float,
    *,
    theta: float,
    nu: float,
    multiple: int = 1,
    max_batch: int,
    allow_shrink: bool = False,
) -> BatchTestResult:
    t = augmented_statistic(small_sqnorm, big_sqnorm, num_small, small_batch, ip_sq_mean, theta=theta, nu=nu)
    return decide(
        t, _current(num_small, small_batch), multiple=multiple, max_batch=max_batch, allow_shrink=allow_shrink
    )


def _current(num_small: int, small_batch: float) -> int:
    return int(round(num_small * small_batch))
