"""The posterior over c = B_crit/b_noise learnt from the loss around batch changes (issue 26)."""

import math

import numpy as np
import pytest

from copus.core.stats.calibration_posterior import CalibrationPosterior


def _run(
    c_true: float, seed: int, noise: float = 1.0, estimator_bias: float = 1.0, post: CalibrationPosterior | None = None
) -> CalibrationPosterior:
    """A synthetic run: φ rises linearly, B doubles three times, progress per step
    B·cφ/(cφ + B), loss a power law in effective samples, noise 2.1/sqrt(B·2048)."""
    rng = np.random.default_rng(seed)
    post = post or CalibrationPosterior()
    progress, batch = 0.0, 16
    for t in range(600):
        phi = 5.0 * (1 + t / 100)
        if t in (150, 300, 450):
            batch *= 2
        bc = c_true * phi
        progress += batch * bc / (bc + batch)
        loss = 1 + 10 * (1 + progress / 50) ** -0.24
        post.observe(loss + noise * 2.1 / math.sqrt(batch * 2048) * rng.standard_normal(), batch, phi / estimator_bias)
    return post


@pytest.mark.parametrize("c_true", [0.5, 2.0, 8.0])
def test_recovers_c_within_its_interval(c_true):
    for seed in (0, 1):
        s = _run(c_true, seed).summary()
        assert s["experiments"] == 3
        assert s["p05"] <= c_true <= s["p95"]
        assert abs(math.log2(s["median"] / c_true)) < 0.5  # within 1.4x


def test_noiseless_maximum_is_the_truth():
    s = _run(4.0, 0, noise=0.0).summary()
    assert abs(math.log2(s["median"] / 4.0)) < 0.25
    assert s["p95"] / s["p05"] < 1.5


def test_learns_c_relative_to_the_estimator():
    # an estimator that reads φ 2x low: the c that makes c·φ_est = B_crit is twice the truth's
    s = _run(2.0, 0, estimator_bias=2.0).summary()
    assert abs(math.log2(s["median"] / 4.0)) < 0.5


def test_no_change_no_evidence():
    post = CalibrationPosterior(prior_c=2.0)
    for t in range(500):
        assert post.observe(5.0 - t * 1e-3, 16, 10.0 + t) is None
    assert post.experiments == []
    assert post.value() == pytest.approx(2.0, rel=0.03)  # the grid truncates the prior


def test_state_round_trip_and_bad_values():
    post = _run(2.0, 0)
    other = CalibrationPosterior()
    other.load_state_dict(post.state_dict())
    assert other.summary() == post.summary()
    with pytest.raises(ValueError, match="quantile"):
        CalibrationPosterior(quantile=1.0)
    with pytest.raises(ValueError, match="batch"):
        CalibrationPosterior().observe(3.0, 0, 1.0)
    # a non-finite loss or noise scale ends the window without evidence
    assert CalibrationPosterior().observe(float("nan"), 16, 1.0) is None


def _run_lr(gamma: float, seed: int) -> CalibrationPosterior:
    """Progress per sample with an LR factor B^γ (an LR below its optimum, raised by sqrt(B))."""
    rng = np.random.default_rng(seed)
    post, progress, batch = CalibrationPosterior(lr_exponents=(0.0, 0.5)), 0.0, 16
    for t in range(600):
        phi = 5.0 * (1 + t / 100)
        if t in (150, 300, 450):
            batch *= 2
        bc = 2.0 * phi
        progress += (batch / 16) ** gamma * batch * bc / (bc + batch)
        loss = 1 + 10 * (1 + progress / 50) ** -0.24
        post.observe(loss + 2.1 / math.sqrt(batch * 2048) * rng.standard_normal(), batch, phi)
    return post


def test_tells_whether_the_lr_factor_holds():
    for seed in (0, 1):
        with_lr = _run_lr(0.5, seed)
        assert with_lr.p_lr_aware() > 0.7 and with_lr.lr_exponent() == 0.5
        assert abs(math.log2(with_lr.value() / 2.0)) < 0.5
        without = _run_lr(0.0, seed)
        assert without.p_lr_aware() < 0.1 and without.lr_exponent() == 0.0
        assert abs(math.log2(without.value() / 2.0)) < 0.5


def test_only_moves_of_min_ratio_are_experiments():
    """min_ratio 1.3: a 16 -> 18 move stays inside the window (no experiment closes); a move
    to 24 (1.5x the last experiment's batch) opens one that closes after skip + window steps."""
    post = CalibrationPosterior(prior_c=2.0, min_ratio=1.3)
    rows = []
    for step in range(400):
        batch = 16 if step < 100 else 18 if step < 250 else 24
        loss = 3.0 - 0.001 * step
        rows.append(post.observe(loss, batch, 20.0))
    closed = [i for i, r in enumerate(rows) if r is not None]
    assert closed == [250 + post.skip_steps + post.window_steps]
    assert rows[closed[0]]["batches"] == [18.0, 24.0]  # the pre-window: 60 steps


def test_loss_trend_reads_the_slope_and_noise_an_experiment_would_see():
    """`loss_trend`: |dL/dstep| at the last step and the per-step loss noise, from the steps kept
    at the current batch (what `core.control.experiment_value` prices an experiment with)."""
    post = CalibrationPosterior(prior_c=4.0)
    rng = np.random.default_rng(0)
    assert post.loss_trend(130) is None  # nothing kept yet
    de = 16.0 * 40.0 / (40.0 + 16.0)  # ΔE per step at B = 16, b_noise 10, c = 4 (the prior median)
    curve = lambda e: 2.0 + 9.0 * (1.0 + e / 50.0) ** -0.24  # noqa: E731  a power law in E
    for t in range(1, 181):  # the last `window_steps` = 60 are kept
        post.observe(curve(de * t) + 0.02 * rng.standard_normal(), 16.0, 10.0)
    slope, sigma, misfit = post.loss_trend(130)
    true = curve(de * 179.5) - curve(de * 180.5)
    assert abs(slope / true - 1.0) < 0.3 and abs(sigma / 0.02 - 1.0) < 0.3 and 0.0 <= misfit < 0.02
