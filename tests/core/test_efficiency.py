import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from copus.core.stats.efficiency import (
    LR_RULES,
    adascale_gain,
    lr_aware_factor,
    lr_scale,
    statistical_efficiency,
)

phis = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)
batches = st.floats(min_value=1.0, max_value=1e6, allow_nan=False)


@given(phis, batches, batches)
def test_efficiency_in_unit_interval_and_non_increasing(phi, b1, b2):
    lo, hi = min(b1, b2), max(b1, b2)
    e_lo, e_hi = statistical_efficiency(phi, lo), statistical_efficiency(phi, hi)
    assert 0.0 < e_hi <= e_lo <= 1.0


def test_efficiency_values_and_broadcasting():
    assert statistical_efficiency(99.0, 1) == 1.0
    assert statistical_efficiency(99.0, 101) == pytest.approx(0.5)
    assert statistical_efficiency(0.0, 8, ref_batch=2) == pytest.approx(0.25)
    assert statistical_efficiency(math.inf, 1024) == 1.0
    assert math.isnan(statistical_efficiency(math.nan, 8))
    assert statistical_efficiency(-5.0, 4) == pytest.approx(0.25)  # negative phi -> 0
    out = statistical_efficiency(np.array([[10.0], [100.0]]), np.array([1, 10, 100]))
    assert out.shape == (2, 3)
    assert np.allclose(out, [[1, 11 / 20, 11 / 110], [1, 101 / 110, 101 / 200]])
    assert isinstance(statistical_efficiency(3.0, 4), float)


@given(st.floats(1e-6, 1e3), st.floats(0, 1e4), st.floats(1.0, 1e3))
def test_adascale_gain_between_one_and_scale(mu2, tr, scale):
    r = adascale_gain(mu2, tr, scale, ref_batch=4.0)
    assert 1.0 - 1e-12 <= r <= scale * (1 + 1e-12)


def test_adascale_gain_values_and_pollux_identity():
    # E(B) = r/S equals Pollux's (phi + B0)/(phi + B) with phi = tr/|G|²
    mu2, tr, b0, b = 0.5, 40.0, 4.0, 64.0
    r = adascale_gain(mu2, tr, b / b0, b0)
    assert r / (b / b0) == pytest.approx(statistical_efficiency(tr / mu2, b, b0))
    assert adascale_gain(0.0, 1.0, 8.0) == 8.0  # no signal: full linear gain
    assert adascale_gain(1.0, 0.0, 8.0) == 1.0  # no noise: no gain
    assert math.isnan(adascale_gain(math.nan, 1.0, 8.0))


def test_lr_scale_rules():
    assert lr_scale("none", 64, 16) == 1.0
    assert lr_scale("linear", 64, 16) == 4.0
    assert lr_scale("sqrt", 64, 16) == 2.0
    assert lr_scale("adascale", 64, 16, grad_sqnorm=1.0, grad_trace_cov=0.0) == 1.0
    assert lr_scale("adascale", 64, 16, 0.5, 40.0) == pytest.approx(adascale_gain(0.5, 40, 4, 16))
    assert lr_scale("adascale", 64, 16, math.nan, math.nan) == 1.0
    assert np.allclose(lr_scale("sqrt", np.array([16, 64]), 16), [1, 2])
    with pytest.raises(ValueError, match="lr_rule='cubic'.*none, linear, sqrt, adascale"):
        lr_scale("cubic", 64, 16)
    with pytest.raises(ValueError, match="adascale"):
        lr_scale("adascale", 64, 16)
    assert LR_RULES == ("none", "linear", "sqrt", "adascale", "sqrt-gain")


def test_lr_aware_factor():
    assert lr_aware_factor(64, 16) == 2.0
    assert np.allclose(lr_aware_factor(np.array([1, 4, 9])), [1, 2, 3])


def test_sqrt_gain_rule_is_bounded_and_follows_sqrt_below_b_noise():
    """AdaptDL AdamScale: η ∝ sqrt(AdaScale gain). With φ' = b_noise/B0 = trΣ/(B0·|G|²):
    ≈ sqrt(B/B0) while B ≪ b_noise, saturating at sqrt(1 + φ') (plain sqrt keeps growing)."""
    g2, ref = 1.0, 8
    trace = 1000.0 * ref  # b_noise = 8000 samples, φ' = 1000
    assert lr_scale("sqrt-gain", 32, ref, g2, trace) == pytest.approx(2.0, rel=0.01)
    big = lr_scale("sqrt-gain", 8 * 10**6, ref, g2, trace)
    assert big == pytest.approx(math.sqrt(1 + 1000), rel=0.01) and big < lr_scale("sqrt", 8 * 10**6, ref)
    assert lr_scale("sqrt-gain", 64, ref, g2, trace) == pytest.approx(math.sqrt(adascale_gain(g2, trace, 8, ref)))
    assert lr_scale("sqrt-gain", 64, ref, math.nan, math.nan) == 1.0  # no statistics yet
    with pytest.raises(ValueError, match="sqrt-gain"):
        lr_scale("sqrt-gain", 64, ref)
