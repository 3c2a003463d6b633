"""The sqrt-scaled-LR ground truth (core.lr_progress, Trajectory SQRT_LR) and its fit (core.truth_fit)."""

import math

import numpy as np
import pytest

from copus.core.stats.lr_progress import (
    LR_EXPONENT_ADAM,
    LR_EXPONENT_SGD,
    lr_fraction,
    optimal_lr,
    progress_factor,
    sqrt_lr_progress_factor,
    warmup_factor,
)
from copus.core.sim.trajectory import LR_TUNED, SQRT_LR, Trajectory, TrajectoryParams
from copus.core.sim.truth_fit import StaticRow, fit_loss_curve, fit_truth, static_minutes


def test_progress_factor_is_the_quadratic_law_2x_minus_x2():
    """McCandlish Eq. 2.5: ΔL(x·ε_opt) = ΔL_opt·(2x − x²)."""
    assert progress_factor(1.0) == 1.0  # the optimum
    assert progress_factor(0.5) == pytest.approx(0.75)
    assert progress_factor(1.5) == pytest.approx(0.75)  # symmetric around x = 1
    assert progress_factor(0.01) == pytest.approx(0.0199)  # ≈ 2x for small x
    assert progress_factor(2.0) == 0.0 and progress_factor(3.0) == 0.0  # diverged: no progress
    xs = np.linspace(0.0, 2.0, 41)
    assert max(xs, key=progress_factor) == pytest.approx(1.0)


def test_optimal_lr_follows_mccandlish_eq_2_6():
    assert optimal_lr(64, 64, lr_max=2.0) == pytest.approx(1.0)  # ε_max/(1 + 1)
    assert optimal_lr(1e9, 64, lr_max=2.0) == pytest.approx(2.0)  # B ≫ B_noise: ε_max
    assert optimal_lr(64, 192, exponent=LR_EXPONENT_ADAM) == pytest.approx(0.5)  # 1/sqrt(4)


def test_lr_fraction_at_the_reference_batch_is_x0_and_sqrt_rule_is_exact_for_adam_when_noise_dominates():
    assert lr_fraction(16, 300.0, 0.7) == pytest.approx(0.7)
    # p = ½, B ≪ B_noise: sqrt(B/16) is the optimal ratio, x stays x0 (Malladi et al. 2022)
    assert lr_fraction(64, 1e7, 0.7, exponent=LR_EXPONENT_ADAM) == pytest.approx(0.7, rel=1e-4)
    # ... and over-scales when B ≫ B_noise: x grows as sqrt(B/(16 + B_noise))
    assert lr_fraction(4096, 48.0, 0.5, exponent=LR_EXPONENT_ADAM) == pytest.approx(
        0.5 * math.sqrt((4096 + 48) / (16 + 48))
    )
    # p = 1 (SGD), B ≪ B_noise: sqrt scaling lags the linear rule, x falls as sqrt(16/B)
    assert lr_fraction(256, 1e9, 1.0, exponent=LR_EXPONENT_SGD) == pytest.approx(0.25, rel=1e-4)
    assert warmup_factor(2e6, 8e6) == 0.25 and warmup_factor(9e6, 8e6) == 1.0
    assert warmup_factor(0.0, 0.0) == 1.0
    half = sqrt_lr_progress_factor(16, 10.0, 1.0, tokens=4e6, warmup_tokens=8e6)
    assert half == pytest.approx(progress_factor(0.5))


def test_sqrt_lr_truth_recovers_the_tuned_truth_at_the_optimum_and_rewards_big_batches_below_it():
    tuned = Trajectory(TrajectoryParams(), 2048)
    loss = 3.0
    bc = tuned.critical_batch(loss)
    # x0 = 1 and B = B_ref: the LR is the optimal one, progress is E(B)'s
    at_opt = Trajectory(TrajectoryParams(lr_model=SQRT_LR, lr_fraction_x0=1.0), 2048)
    assert at_opt.progress_per_step(16, loss) == pytest.approx(tuned.progress_per_step(16, loss))
    # x0 chosen so that x(B) = 1 at B = 256 recovers E(256) exactly
    x0 = 1.0 / lr_fraction(256, bc, 1.0, exponent=0.5)
    there = Trajectory(TrajectoryParams(lr_model=SQRT_LR, lr_fraction_x0=x0, lr_opt_exponent=0.5), 2048)
    assert there.progress_per_step(256, loss) == pytest.approx(tuned.progress_per_step(256, loss))
    # below the optimum (x0 = 0.5, Adam): the bigger batch's per-sample progress, relative to
    # E(B)'s, is larger (the LR-aware factor's direction)
    low = Trajectory(TrajectoryParams(lr_model=SQRT_LR, lr_fraction_x0=0.5, lr_opt_exponent=0.5), 2048)
    rel = [low.progress_per_step(b, loss) / tuned.progress_per_step(b, loss) for b in (16, 64, 256)]
    assert rel[0] == pytest.approx(0.75) and rel[0] < rel[1] < rel[2] <= 1.0
    assert TrajectoryParams().lr_model == LR_TUNED
    with pytest.raises(ValueError, match="lr_model"):
        TrajectoryParams(lr_model="cosine")
    with pytest.raises(ValueError, match="lr_fraction_x0"):
        TrajectoryParams(lr_fraction_x0=0.0)


TRUE = TrajectoryParams(
    initial_loss=10.4,
    progress_scale_samples=40.0,
    loss_exponent=0.24,
    bcrit_star_tokens=2e8,
    lr_model=SQRT_LR,
    lr_fraction_x0=0.6,
    lr_opt_exponent=0.5,
    lr_warmup_tokens=2e6,
)
TARGETS = (5.0, 4.0, 3.5)


def _rows(params: TrajectoryParams) -> list[StaticRow]:
    rows = []
    for batch, step_s in ((16, 0.6), (32, 0.9), (64, 1.6)):
        stub = StaticRow(batch, step_s, (None,) * len(TARGETS))
        rows.append(StaticRow(batch, step_s, tuple(static_minutes(params, 2048, stub, TARGETS))))
    return rows


def test_static_minutes_match_a_step_by_step_run():
    row = StaticRow(64, 1.6, (None,) * 3)
    got = static_minutes(TRUE, 2048, row, TARGETS)
    traj, e, step, hit = Trajectory(TRUE, 2048), 0.0, 0, {}
    while len(hit) < len(TARGETS):
        e += traj.progress_per_step(64, traj.loss(e), step * 64 * 2048)
        step += 1
        for t in TARGETS:
            hit.setdefault(t, step) if traj.loss(e) <= t else None
    assert got == pytest.approx([hit[t] * 1.6 / 60 for t in TARGETS], rel=0.02)  # ±1-2 steps


def test_fit_on_synthetic_rows_recovers_the_loss_curve_and_x0():
    rows = _rows(TRUE)
    start = TrajectoryParams(
        initial_loss=10.4,
        progress_scale_samples=80.0,
        loss_exponent=0.3,
        bcrit_star_tokens=1e8,
        lr_model=SQRT_LR,
        lr_fraction_x0=0.6,
        lr_opt_exponent=0.5,
        lr_warmup_tokens=2e6,
    )
    fitted = fit_loss_curve(start, 2048, rows, TARGETS, good_rms=0.02)
    for row in rows:  # the loss curve reproduces every synthetic static time
        assert static_minutes(fitted, 2048, row, TARGETS) == pytest.approx(row.minutes, rel=0.05)
    fits = fit_truth(
        start, 2048, rows, TARGETS, [{"lr_fraction_x0": x} for x in (0.25, 0.6, 1.2)], cbs_errors=lambda p: []
    )
    assert fits[0].params.lr_fraction_x0 == 0.6 and fits[0].rms < 0.05
    assert fits[-1].rms > 3 * fits[0].rms


def test_oracle_is_never_slower_than_any_fixed_candidate_and_equals_a_lone_one():
    from copus.core.sim.oracle import oracle_minutes, speedup_pct

    batches, step_s = np.array([16, 64, 256]), np.array([0.6, 1.6, 5.5])  # 256: x > 2 early
    fixed = [
        static_minutes(TRUE, 2048, StaticRow(int(b), float(t), (None,) * 3), TARGETS) for b, t in zip(batches, step_s)
    ]
    best = oracle_minutes(TRUE, 2048, batches, step_s, TARGETS)
    for i in range(len(TARGETS)):
        assert best[i] <= min(f[i] for f in fixed) * 1.02
    assert fixed[2][0] > 1e5  # B = 256 alone stalls (x ≥ 2 before B_crit grows) ...
    assert best[0] < fixed[1][0]  # ... and the oracle, free to mix batches, beats every fixed one
    lone = oracle_minutes(TRUE, 2048, batches[1:2], step_s[1:2], TARGETS)
    assert lone == pytest.approx(fixed[1], rel=0.02)
    assert speedup_pct(10.0, 9.0) == pytest.approx(10.0) and speedup_pct(None, 9.0) is None
