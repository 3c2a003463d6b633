import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from copus.core.stats.batch_tests import (
    BatchTestResult,
    augmented_test,
    decide,
    inner_product_statistic,
    inner_product_test,
    norm_test,
    norm_test_statistic,
    orthogonality_statistic,
    orthogonality_test,
    per_sample_trace_cov,
)


def _synthetic(num_small, small_batch, d=12, seed=0):
    """Per-sample gradients and the scalars the runtime would measure from them."""
    rng = np.random.default_rng(seed)
    G = rng.normal(size=d) * 0.5
    per_sample = G + rng.normal(size=(num_small * small_batch, d)) * rng.uniform(0.5, 2, d)
    g = per_sample.reshape(num_small, small_batch, d).mean(1)  # small gradients g_j
    gbar = g.mean(0)
    scalars = dict(
        small_sqnorm=float((g * g).sum(1).mean()),
        big_sqnorm=float(gbar @ gbar),
        num_small=num_small,
        small_batch=small_batch,
    )
    ip_sq_mean = float(((g @ gbar) ** 2).mean())
    return per_sample, g, gbar, scalars, ip_sq_mean


@pytest.mark.parametrize("seed", [0, 1])
def test_per_sample_forms_equal_brute_force_per_sample_tests(seed):
    """b = 1: every small gradient is one sample; compare with Lau et al. §1.2/§1.3 and the
    AdAdaGrad per-sample code (np.var with ddof=1, summed over coordinates)."""
    per_sample, _, gbar, sc, ip = _synthetic(num_small=32, small_batch=1, seed=seed)
    q = gbar @ gbar
    var_l1 = np.var(per_sample, axis=0, ddof=1).sum()
    assert norm_test_statistic(**sc, eta=0.5) == pytest.approx(var_l1 / (0.25 * q))
    proj = per_sample @ gbar
    assert inner_product_statistic(**sc, ip_sq_mean=ip, theta=0.7) == pytest.approx(
        np.var(proj, ddof=1) / (0.49 * q * q)
    )
    orth = per_sample - np.outer(proj / q, gbar)
    assert orthogonality_statistic(**sc, ip_sq_mean=ip, nu=2.0) == pytest.approx(
        np.var(orth, axis=0, ddof=1).sum() / (4.0 * q)
    )


def test_small_gradient_forms_equal_brute_force():
    """b > 1: the paper's per-worker DDP-Norm statistic and the calibrated forms, computed from
    the small gradients themselves."""
    _, g, gbar, sc, ip = _synthetic(num_small=4, small_batch=16, seed=3)
    J, b, q = 4, 16, gbar @ gbar
    var_hat = np.mean([np.sum((gj - gbar) ** 2) for gj in g])  # Lau eq. 5 as printed
    assert norm_test_statistic(**sc, eta=0.1, form="paper") == pytest.approx(var_hat / (0.01 * q))
    tr = b / (J - 1) * sum(np.sum((gj - gbar) ** 2) for gj in g)
    assert per_sample_trace_cov(**sc) == pytest.approx(tr)
    assert norm_test_statistic(**sc, eta=0.5) == pytest.approx(tr / (0.25 * q))
    # design.md's forms at the current batch B = J·b
    B = J * b
    ip_var = np.var(g @ gbar, ddof=1)
    assert inner_product_statistic(**sc, ip_sq_mean=ip, theta=0.5) / B == pytest.approx(ip_var / J / (0.25 * q * q))
    orth = sum(np.sum((gj - (gj @ gbar / q) * gbar) ** 2) for gj in g) / J / (J - 1)
    assert orthogonality_statistic(**sc, ip_sq_mean=ip, nu=2.0) / B == pytest.approx(orth / (4.0 * q))


def test_norm_test_target_is_about_b_noise_over_eta_squared():
    """Per-sample form: E[T] ≈ (tr Σ/(|G|² + trΣ/B))/η²; here averaged over many draws."""
    rng = np.random.default_rng(0)
    d, J, b, eta = 10, 8, 4, 0.5
    G, sd = np.full(d, 0.3), np.full(d, 1.0)  # |G|² = 0.9, tr Σ = 10
    num, den = [], []
    for _ in range(3000):
        g = G + rng.normal(size=(J, d)) * sd / math.sqrt(b)
        gbar = g.mean(0)
        num.append(per_sample_trace_cov((g * g).sum(1).mean(), gbar @ gbar, J, b))
        den.append(gbar @ gbar)
    t = np.mean(num) / (eta**2 * np.mean(den))
    expected = 10.0 / (0.9 + 10.0 / (J * b)) / eta**2
    assert t == pytest.approx(expected, rel=0.05)


def test_test_results_and_errors():
    _, _, _, sc, ip = _synthetic(num_small=8, small_batch=2, seed=1)
    r = norm_test(**sc, eta=0.05, multiple=4, max_batch=100_000)
    assert isinstance(r, BatchTestResult) and not r.passed
    assert r.requested_batch % 4 == 0 and r.requested_batch >= r.statistic
    assert r.requested_batch - r.statistic < 4
    r = norm_test(**sc, eta=100.0, multiple=4, max_batch=1000)
    assert r.passed and r.requested_batch == 16
    a = augmented_test(**sc, ip_sq_mean=ip, theta=0.3, nu=0.5, multiple=2, max_batch=10**6)
    i = inner_product_test(**sc, ip_sq_mean=ip, theta=0.3, multiple=2, max_batch=10**6)
    o = orthogonality_test(**sc, ip_sq_mean=ip, nu=0.5, multiple=2, max_batch=10**6)
    assert a.statistic == max(i.statistic, o.statistic)
    assert a.requested_batch == max(i.requested_batch, o.requested_batch)
    assert a.passed == (i.passed and o.passed)
    with pytest.raises(ValueError, match="norm_test_form='exact'"):
        norm_test(**sc, eta=0.5, form="exact", max_batch=64)
    with pytest.raises(ValueError, match="num_small=1"):
        norm_test(1.0, 1.0, 1, 4, eta=0.5, max_batch=64)
    with pytest.raises(ValueError, match="big_sqnorm=nan"):
        norm_test(1.0, math.nan, 2, 4, eta=0.5, max_batch=64)
    with pytest.raises(ValueError, match="norm_test_eta=0"):
        norm_test(1.0, 1.0, 2, 4, eta=0, max_batch=64)


def test_zero_gradient_asks_for_the_cap():
    r = norm_test(small_sqnorm=1.0, big_sqnorm=0.0, num_small=4, small_batch=2, eta=0.5, multiple=8, max_batch=100)
    assert r.statistic == math.inf and r.requested_batch == 96 and not r.passed


@given(
    statistic=st.one_of(st.floats(0, 1e6), st.just(math.inf)),
    current=st.integers(1, 5000),
    multiple=st.integers(1, 64),
    max_batch=st.integers(64, 4096),
    allow_shrink=st.booleans(),
)
def test_decide_rounds_caps_and_never_shrinks(statistic, current, multiple, max_batch, allow_shrink):
    r = decide(statistic, current, multiple=multiple, max_batch=max_batch, allow_shrink=allow_shrink)
    assert r.passed == (statistic <= current)
    if not allow_shrink:
        assert r.requested_batch >= current
    cap = max_batch // multiple * multiple
    if r.requested_batch != current:
        # a change: the smallest multiple that covers the statistic, within the cap
        assert r.requested_batch % multiple == 0 and r.requested_batch <= cap
        assert r.requested_batch >= min(statistic, cap) - 1e-6
        assert r.requested_batch == multiple or r.requested_batch == cap or (r.requested_batch - multiple < statistic)
    if r.passed and not allow_shrink:
        assert r.requested_batch == current
    if statistic > current * (1 + 1e-6) and not allow_shrink and current < cap:
        assert r.requested_batch > current
    assert r.requested_batch <= max(current, max_batch)


def test_decide_errors():
    with pytest.raises(ValueError, match="max_batch=4"):
        decide(10.0, 8, multiple=8, max_batch=4)
    with pytest.raises(ValueError, match="multiple=0"):
        decide(10.0, 8, multiple=0, max_batch=64)
