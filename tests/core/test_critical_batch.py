"""Critical-batch read-off and McCandlish B_noise fit on synthetic loss tables with known answers."""

from __future__ import annotations

import math

import pytest

from copus.core.stats.critical_batch import (
    ema_smooth,
    fit_b_noise,
    fit_b_noise_pair,
    measured_calibration,
    noise_floor,
    read_off_critical_batch,
    smoothed_final,
)


def test_ema_alpha_half():
    assert ema_smooth([4.0, 2.0, 2.0]) == [4.0, 3.0, 2.5]
    assert smoothed_final([1.0]) == 1.0
    with pytest.raises(ValueError):
        ema_smooth([1.0], alpha=0.0)


def test_noise_floor_twice_the_gap():
    assert noise_floor({8: [2.50, 2.53]}) == pytest.approx(0.06)
    # pooled over branches and pairs: gaps 0.02 (k=8), 0.04 (k=16) → mean 0.03 → ε = 0.06
    assert noise_floor({8: [2.0, 2.02], 16: [2.1, 2.14]}) == pytest.approx(0.06)
    with pytest.raises(ValueError):
        noise_floor({8: [2.0], 16: [2.1]})


def _mccandlish_table(batch: float, b_noise: float, ks, c: float = 1.0, start: float = 3.0):
    """Loss after the same tokens: L = start − c/(k·B + B_noise) (progress ∝ 1/(b + B_noise))."""
    return {k * batch: start - c / (k * batch + b_noise) for k in ks}


def test_read_off_known_answer():
    # Losses: flat up to 32, then a clear rise: the critical batch lies in [32, 64).
    losses = {8: 2.000, 16: 2.004, 32: 2.009, 64: 2.100, 128: 2.300}
    cb = read_off_critical_batch(losses, epsilon=0.01)
    assert (cb.lower, cb.upper) == (32, 64)
    assert cb.value == pytest.approx(math.sqrt(32 * 64))
    # A smaller ε puts it lower: 16 is within 0.005 of 8, 32 is not (2.009 > 2.005).
    assert read_off_critical_batch(losses, epsilon=0.005).lower == 16
    # ε = 0: only a branch at least as good as every smaller one
    assert read_off_critical_batch(losses, epsilon=0.0).lower == 8


def test_read_off_must_beat_every_smaller_batch():
    # 64 is within ε of 32 but not of 8: "within ε of every smaller one".
    losses = {8: 2.00, 16: 2.02, 32: 2.04, 64: 2.06}
    cb = read_off_critical_batch(losses, epsilon=0.045)
    assert cb.lower == 32 and cb.upper == 64


def test_read_off_unbounded_when_largest_passes():
    cb = read_off_critical_batch({4: 2.0, 8: 1.99, 16: 1.995}, epsilon=0.01)
    assert cb.lower == 16 and cb.upper is None and not cb.bounded and cb.value == 16


@pytest.mark.parametrize("b_noise", [10.0, 40.0, 200.0])
def test_read_off_from_mccandlish_model(b_noise):
    # L(b) = 3 − C/(b + B_n) rises with b; the binding comparison is with the smallest batch 4:
    # within ε of it ⇔ C/(4 + B_n) − C/(b + B_n) ≤ ε ⇔ b ≤ C/(C/(4 + B_n) − ε) − B_n.
    C, eps = 20.0, 0.05
    tested = [4, 8, 16, 32, 64, 128, 256]
    table = _mccandlish_table(8, b_noise=b_noise, ks=[b / 8 for b in tested], c=C)
    threshold = C / (C / (4 + b_noise) - eps) - b_noise
    expected = max(b for b in tested if b <= threshold)
    cb = read_off_critical_batch(table, epsilon=eps)
    assert cb.lower == expected
    assert cb.upper == tested[tested.index(expected) + 1]
    # the read-off grows with the noise scale
    assert threshold > 4


@pytest.mark.parametrize("k", [0.5, 2, 4, 8])
@pytest.mark.parametrize("b_noise", [3.0, 40.0, 500.0])
def test_pair_fit_recovers_b_noise(k, b_noise):
    B, C = 8.0, 5.0
    drop_base, drop_k = C / (B + b_noise), C / (k * B + b_noise)
    assert fit_b_noise_pair(B, k, drop_base, drop_k) == pytest.approx(b_noise, rel=1e-9)


def test_pair_fit_rejects_data_outside_the_model():
    # ρ ≥ 1 for k > 1 (the big batch made more progress per token): no finite B_noise
    assert math.isnan(fit_b_noise_pair(8, 2, 0.1, 0.12))
    # ρ ≤ 1/k: less than linear-scaling progress → negative B_noise
    assert math.isnan(fit_b_noise_pair(8, 2, 0.1, 0.04))
    assert math.isnan(fit_b_noise_pair(8, 2, 0.0, 0.04))
    with pytest.raises(ValueError):
        fit_b_noise_pair(8, 1, 0.1, 0.1)


def test_least_squares_fit_recovers_b_noise():
    B, b_noise, C = 8.0, 60.0, 3.0
    drops = {k * B: C / (k * B + b_noise) for k in (0.5, 1, 2, 4, 8)}
    fit = fit_b_noise(drops)
    assert fit.b_noise == pytest.approx(b_noise, rel=1e-6)
    assert fit.scale == pytest.approx(C, rel=1e-6)
    assert fit.num_points == 5 and fit.residual_rms < 1e-9


def test_least_squares_fit_noisy_is_close():
    import numpy as np

    rng = np.random.default_rng(0)
    B, b_noise, C = 8.0, 30.0, 2.0
    drops = {k * B: C / (k * B + b_noise) * (1 + 0.01 * rng.standard_normal()) for k in (0.5, 1, 2, 4, 8)}
    assert fit_b_noise(drops).b_noise == pytest.approx(b_noise, rel=0.25)


def test_least_squares_fit_degenerate():
    assert math.isnan(fit_b_noise({8: 0.1}).b_noise)  # one point
    assert math.isnan(fit_b_noise({8: 0.1, 16: 0.2}).b_noise)  # bigger batch, more progress
    assert math.isnan(fit_b_noise({8: -0.1, 16: 0.2}).b_noise)  # only one point with progress


def test_measured_calibration():
    assert measured_calibration(30.0, 15.0) == 2.0
    assert math.isnan(measured_calibration(math.nan, 15.0))
    assert math.isnan(measured_calibration(30.0, 0.0))


def test_summarize_branches_known_answer():
    from copus.core.stats.critical_batch import summarize_branches

    B, b_noise, C, start = 8.0, 24.0, 2.0, 3.0
    # two repeats: the model's losses ± 0.005 (gap 0.01 → ε = 0.02)
    losses = {k * B: [start - C / (k * B + b_noise) + d for d in (-0.005, 0.005)] for k in (1, 2, 4, 8)}
    s = summarize_branches(base_batch=B, losses=losses, start_loss=start, b_noise_online=12.0)
    assert s["epsilon"] == pytest.approx(0.02)
    assert s["b_noise_fit"] == pytest.approx(b_noise, rel=1e-6)
    assert s["c"] == pytest.approx(2.0, rel=1e-6)
    assert all(v == pytest.approx(b_noise, rel=1e-6) for v in s["b_noise_pairs"].values())
    # within 0.02 of L(8) = 3 − 2/32: 2/32 − 2/(b + 24) ≤ 0.02 ⇔ b ≤ 23.1 → 16 passes, 32 not
    assert s["critical_batch"]["lower"] == 16 and s["critical_batch"]["upper"] == 32
    assert len(s["c_repeats"]) == 2 and s["c_spread"] >= 0


def test_probe_multipliers_and_auto_calibration_config():
    from copus.config import load_config
    from copus.core.stats.critical_batch import parse_probe_multipliers
    from copus.core.control.policies import AUTO_CALIBRATION_PRIOR, POSTERIOR_PRIOR_C, PolicySettings

    assert parse_probe_multipliers("4,1,2") == [1.0, 2.0, 4.0]
    for bad in ("2,4", "1", "1,-2", "1,x"):
        with pytest.raises(ValueError, match="probe_multipliers"):
            parse_probe_multipliers(bad)
    cfg = load_config(None, ["gns.calibration='probe'"])  # the branch probe: its prior until measured
    assert cfg.gns.calibration == "probe"
    assert PolicySettings.from_config(cfg).calibration == AUTO_CALIBRATION_PRIOR
    auto = PolicySettings.from_config(load_config(None, ["gns.calibration='auto'"]))  # learnt in the run
    assert (auto.calibration, auto.calibration_mode) == (POSTERIOR_PRIOR_C, "auto")
    assert load_config(None, ["gns.calibration=2"]).gns.calibration == 2.0
    for bad in ("gns.calibration='sometimes'", "gns.calibration=0", "gns.probe_multipliers='2,4'"):
        with pytest.raises(ValueError, match="gns"):
            load_config(None, [bad])
