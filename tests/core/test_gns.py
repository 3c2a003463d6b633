import json
import math

import numpy as np
import pytest

from copus.core.stats.gns import DecaySchedule, GnsEstimator, two_batch_estimate


def _problem(d=16, seed=0):
    """A true gradient G and a per-sample covariance Σ (full rank, anisotropic)."""
    rng = np.random.default_rng(seed)
    G = rng.normal(size=d) * 0.3
    A = rng.normal(size=(d, d)) / math.sqrt(d)
    Sigma = A @ A.T + np.diag(rng.uniform(0.1, 1.0, size=d))
    return G, Sigma


def _draw_stats(rng, G, Sigma, num_small, small_batch, reps):
    """(s̄, q) per repetition: J small gradients, each the mean of b per-sample gradients."""
    L = np.linalg.cholesky(Sigma / small_batch)
    z = rng.normal(size=(reps, num_small, G.size))
    g = G + z @ L.T  # small gradients ~ N(G, Σ/b)
    small = (g * g).sum(-1).mean(-1)  # s̄ = mean_j ‖g_j‖²
    gbar = g.mean(1)
    big = (gbar * gbar).sum(-1)  # q = ‖ḡ‖²
    return small, big


@pytest.mark.parametrize("num_small,small_batch", [(2, 1), (4, 8), (16, 3)])
def test_two_batch_estimate_is_unbiased(num_small, small_batch):
    G, Sigma = _problem()
    rng = np.random.default_rng(1)
    reps = 6000
    small, big = _draw_stats(rng, G, Sigma, num_small, small_batch, reps)
    est = np.array([two_batch_estimate(s, small_batch, q, num_small * small_batch) for s, q in zip(small, big)])
    for col, truth in ((0, G @ G), (1, np.trace(Sigma))):
        mean = est[:, col].mean()
        se = est[:, col].std(ddof=1) / math.sqrt(reps)
        assert abs(mean - truth) < 4 * se, (col, mean, truth, se)


def test_two_batch_estimate_closed_forms_and_errors():
    # N = 4 small gradients: |G|² = (N q − s̄)/(N − 1), tr Σ = (s̄ − q)·B/(N − 1)
    g2, tr = two_batch_estimate(small_sqnorm=5.0, small_batch=2, big_sqnorm=2.0, big_batch=8)
    assert g2 == pytest.approx((4 * 2.0 - 5.0) / 3)
    assert tr == pytest.approx((5.0 - 2.0) * 8 / 3)
    with pytest.raises(ValueError, match="big_batch=4"):
        two_batch_estimate(1.0, 4, 1.0, 4)
    with pytest.raises(ValueError, match="small_batch=0"):
        two_batch_estimate(1.0, 0, 1.0, 4)


def test_decay_schedule_switches_on_tokens():
    d = DecaySchedule()
    assert (d.decay, d.decay_late, d.switch_tokens) == (0.95, 0.99, 8_000_000)
    assert d(0) == 0.95 and d(7_999_999) == 0.95 and d(8_000_000) == 0.99
    with pytest.raises(ValueError, match="decay=1.0"):
        DecaySchedule(decay=1.0)


def test_first_update_equals_the_sample_and_bias_correction():
    est = GnsEstimator()
    assert math.isnan(est.b_noise) and math.isnan(est.grad_sqnorm) and est.rel_err == math.inf
    assert est.update(5.0, 2, 2.0, 8)
    g2, tr = two_batch_estimate(5.0, 2, 2.0, 8)
    assert est.grad_sqnorm == pytest.approx(g2) and est.grad_trace_cov == pytest.approx(tr)
    assert est.b_noise == pytest.approx(tr / g2)
    assert est.num_updates == 1 and est.rel_err == math.inf
    # second update: bias-corrected weighted mean with weights (1-a)a and (1-a)
    assert est.update(6.0, 2, 3.0, 8)
    g2b, _ = two_batch_estimate(6.0, 2, 3.0, 8)
    a = 0.95
    assert est.grad_sqnorm == pytest.approx((a * g2 + g2b) / (a + 1))


@pytest.mark.parametrize(
    "bad", [(math.nan, 2, 1.0, 8), (1.0, 2, math.inf, 8), (1.0, 8, 1.0, 8), (1.0, math.nan, 1.0, 8), (None, 2, 1.0, 8)]
)
def test_non_finite_or_single_gradient_is_skipped(bad):
    est = GnsEstimator()
    est.update(5.0, 2, 2.0, 8)
    before = est.state_dict()
    assert est.update(*bad) is False
    after = est.state_dict()
    assert after.pop("num_skipped") == 1 and before.pop("num_skipped") == 0
    assert after == before


def test_state_round_trip_continues_identically():
    rng = np.random.default_rng(3)
    G, Sigma = _problem(d=8)
    small, big = _draw_stats(rng, G, Sigma, 4, 4, 60)
    a, tokens = GnsEstimator(DecaySchedule(switch_tokens=30 * 1000)), 0
    for s, q in zip(small[:30], big[:30]):
        tokens += 1000
        a.update(s, 4, q, 16, tokens)
    state = json.loads(json.dumps(a.state_dict()))
    b = GnsEstimator(DecaySchedule(switch_tokens=30 * 1000))
    b.load_state_dict(state)
    for s, q in zip(small[30:], big[30:]):
        tokens += 1000
        a.update(s, 4, q, 16, tokens)
        b.update(s, 4, q, 16, tokens)
        assert (a.b_noise, a.rel_err, a.grad_sqnorm) == (b.b_noise, b.rel_err, b.grad_sqnorm)
    assert b.num_updates == 60
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({"version": 7})


def test_b_noise_edge_cases():
    est = GnsEstimator(0.9)
    # q > s̄ with N = 2: |G|² = 2q − s̄ > 0, tr Σ < 0  -> b_noise clamps to 0
    est.update(1.0, 1, 1.5, 2)
    assert est.grad_trace_cov < 0 and est.b_noise == 0.0 and est.rel_err == math.inf
    noise = GnsEstimator(0.9)
    # s̄ ≫ q: |G|² estimate negative -> no measurable signal -> inf
    noise.update(10.0, 1, 1.0, 2)
    assert noise.grad_sqnorm < 0 and noise.b_noise == math.inf


def test_b_noise_converges_and_rel_err_matches_spread():
    """Independent estimators on a stationary feed: the reported rel_err predicts the actual
    spread of b_noise across them (within 35%), and the mean is near tr(Σ)/|G|²."""
    G, Sigma = _problem(d=12, seed=5)
    truth = np.trace(Sigma) / (G @ G)
    rng = np.random.default_rng(7)
    runs, steps = 150, 120
    small, big = _draw_stats(rng, G, Sigma, 8, 4, runs * steps)
    small, big = small.reshape(runs, steps), big.reshape(runs, steps)
    finals, errs = [], []
    for r in range(runs):
        est = GnsEstimator(0.95)
        for s, q in zip(small[r], big[r]):
            est.update(s, 4, q, 32)
        finals.append(est.b_noise)
        errs.append(est.rel_err)
    finals = np.array(finals)
    spread = finals.std(ddof=1) / finals.mean()
    assert abs(finals.mean() / truth - 1) < 0.1
    assert 0.65 < np.median(errs) / spread < 1.35, (np.median(errs), spread)
