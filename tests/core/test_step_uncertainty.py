"""The throughput side's confidence bound (core/stats/step_uncertainty.py) and its use in decisions."""

import math

import numpy as np
import pytest

from copus.core.plan.search import search
from copus.core.stats.step_uncertainty import (
    PRIOR_MODEL_ERROR,
    median_error,
    model_error,
    relative_spread,
    required_gain,
)

from test_search import CANDS, Table, _plan


def test_relative_spread_and_the_median_error():
    rng = np.random.default_rng(0)
    times = 0.5 * (1 + 0.2 * rng.standard_normal(4000))
    assert relative_spread(times) == pytest.approx(0.2, rel=0.05)  # σ of one step
    assert median_error(times[:100]) == pytest.approx(1.2533 * 0.2 / 10, rel=0.2)
    assert math.isnan(relative_spread([0.5])) and math.isnan(median_error([]))
    # three identical probe steps: no spread of their own -> the machine's floor
    assert median_error([0.3, 0.3, 0.3], noise_floor=0.15) == pytest.approx(1.2533 * 0.15 / 3**0.5)
    assert median_error([0.3], noise_floor=0.15) == pytest.approx(1.2533 * 0.15)


def test_model_error_is_the_median_checked_miss():
    assert model_error([]) == PRIOR_MODEL_ERROR
    assert model_error([0.3, -0.25, 0.02, math.nan]) == pytest.approx(0.25)
    assert required_gain(0.10, 0.0, 0.0, 1.645) == 0.10  # COPUS's rule
    assert required_gain(0.10, 0.03, 0.04, 2.0) == pytest.approx(0.20)
    with pytest.raises(ValueError, match="z=-1"):
        required_gain(0.1, 0.1, 0.1, -1)


def test_a_gain_within_the_noise_is_refused_and_a_clear_one_taken():
    a, b = _plan(8, 1, 1, 2, 2), _plan(4, 1, 2, 2, 4)  # both B = 32
    model = Table({(*a.layout, 2, 2): 1.0, (*b.layout, 2, 4): 0.8})  # b +25 %
    u = np.full(len(CANDS), 0.25)  # b never measured: model miss 25 %
    kw = dict(reconfig_cost_s=0.0, uncertainty=u, current_uncertainty=0.02)
    assert search(CANDS, model, 50.0, a, step_confidence=0.0, **kw).plan == b  # margin alone
    assert search(CANDS, model, 50.0, a, step_confidence=1.645, **kw) is None  # 25 % < 51 %
    u[:] = 0.03  # a model that predicted well
    d = search(CANDS, model, 50.0, a, step_confidence=1.645, **kw)
    assert d is not None and d.plan == b and "margin 10% + 1.645·u 6%" in d.reason
