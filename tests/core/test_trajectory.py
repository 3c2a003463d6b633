import math

import numpy as np
import pytest

from copus.core.stats.gns import two_batch_estimate
from copus.core.sim.presets import PRESETS, get_preset
from copus.core.sim.trajectory import Trajectory, TrajectoryParams


def _traj(**kw) -> Trajectory:
    return Trajectory(TrajectoryParams(**kw), 2048)


def test_loss_is_decreasing_and_inverse_is_consistent():
    t = _traj()
    progress = np.geomspace(1.0, 1e9, 50)
    losses = [t.loss(e) for e in progress]
    assert losses[0] < t.params.initial_loss and all(np.diff(losses) < 0)
    assert losses[-1] > t.params.final_loss
    for e in (10.0, 1e4, 1e7):
        assert t.progress_for_loss(t.loss(e)) == pytest.approx(e, rel=1e-9)
    assert t.progress_for_loss(t.params.final_loss) == math.inf
    assert t.progress_for_loss(t.params.initial_loss + 1) == 0.0


def test_critical_batch_follows_kaplan_power_law():
    """B_crit(L) = 2e8 tokens / L^(1/0.21): ≈ 2.7e5 tokens at L = 4 (Kaplan et al. 2020 Fig. 10)."""
    t = _traj()
    assert t.critical_batch(4.0) * 2048 == pytest.approx(2e8 / 4.0 ** (1 / 0.21), rel=1e-12)
    losses = [6.0, 5.0, 4.0, 3.0, 2.5]
    bcrit = [t.critical_batch(x) for x in losses]
    assert all(np.diff(bcrit) > 0)  # b_noise grows as the loss falls
    assert t.b_noise(3.0) == pytest.approx(t.critical_batch(3.0) / 2.0)


def test_bigger_batch_never_more_efficient_per_sample():
    t = _traj()
    for loss in (8.0, 4.0, 3.0):
        per_sample = [t.progress_per_step(b, loss) / b for b in (1, 16, 64, 256, 1024, 8192)]
        assert all(np.diff(per_sample) < 0)
        per_step = [t.progress_per_step(b, loss) for b in (1, 16, 64, 256, 1024, 8192)]
        assert all(np.diff(per_step) > 0)
        # McCandlish: at B = B_crit a step buys half of its samples' worth of progress
        bc = t.critical_batch(loss)
        assert t.progress_per_step(bc, loss) == pytest.approx(bc / 2)


@pytest.mark.parametrize("num_small", [2, 8, 64])
def test_sampled_grad_stats_are_unbiased_for_the_two_batch_estimator(num_small):
    t = _traj(noise_dim=32.0)
    rng = np.random.default_rng(0)
    loss, batch = 3.5, 128
    draws = np.array([t.sample_grad_stats(rng, loss, batch, num_small) for _ in range(20000)])
    s_bar, q = draws.mean(axis=0)
    g2, tr = t.grad_sqnorm(loss), t.grad_trace_cov(loss)
    b = batch / num_small
    assert s_bar == pytest.approx(g2 + tr / b, rel=0.02)
    assert q == pytest.approx(g2 + tr / batch, rel=0.02)
    est = np.array([two_batch_estimate(s, b, qq, batch) for s, qq in draws])
    assert est[:, 1].mean() == pytest.approx(tr, rel=0.03)
    assert est[:, 0].mean() == pytest.approx(g2, rel=0.1, abs=0.05 * tr / batch)
    assert (draws[:, 0] >= draws[:, 1]).all()  # s̄ ≥ q always (Jensen)


def test_noise_dim_controls_estimator_noise():
    rng = np.random.default_rng(1)
    spreads = []
    for d in (8.0, 512.0):
        t = _traj(noise_dim=d)
        tr = [two_batch_estimate(*_args(t.sample_grad_stats(rng, 3.0, 64, 8), 64, 8))[1] for _ in range(2000)]
        spreads.append(np.std(tr) / np.mean(tr))
    assert spreads[0] > 4 * spreads[1]


def _args(stats, batch, n):
    s, q = stats
    return s, batch / n, q, batch


def test_bad_params_raise_value_error_naming_them():
    with pytest.raises(ValueError, match="noise_dim"):
        TrajectoryParams(noise_dim=0)
    with pytest.raises(ValueError, match="initial_loss"):
        TrajectoryParams(initial_loss=2.0, final_loss=3.0)


def test_presets_match_copus_settings():
    assert set(PRESETS) == {"3b-8xh100", "13b-16xh100", "32b-32xh100", "7b-32xmi210"}
    for p in PRESETS.values():
        assert p.initial_batch == 16 and len(p.target_losses) == 5
        assert len(p.published_speedup_pct) == 5
        assert np.mean(p.published_speedup_pct) == pytest.approx(p.published_avg_speedup_pct, abs=0.06)
        assert all(len(v) == 5 for v in p.published_minutes.values())
        for layout in p.cbs_layouts:
            assert math.prod(layout) == p.world_size
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("70b")
