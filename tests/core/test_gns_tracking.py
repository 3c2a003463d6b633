"""The noise scale that keeps up (issue 14 part 4): tracking estimator, lower confidence bound,
and the transient after a batch change, on synthetic streams with a known truth."""

import math

import numpy as np
import pytest

from copus.core.stats.gns import DecaySchedule, GnsEstimator, lower_bound
from copus.core.stats.gns_tracking import TrackingGnsEstimator, make_estimator
from copus.core.plan.plan import ParallelPlan
from copus.core.control.policies import GnsPolicy, PolicySettings
from copus.core.plan.records import StepRecord


def _falling_stream(seed, cv=0.05, big=64, small=8, steady=100, fall=100):
    """(step, true b_noise, s̄, b, q, B): tr Σ = 100 fixed; |G|² steady, then falling 100× over
    `fall` steps (e-folding time 21.7 steps), then steady. The per-step estimates of |G|² and
    tr Σ carry independent relative noise `cv`; s̄ and q are what the two-batch estimator
    inverts them from (s̄ = |G|² + trΣ/b, q = |G|² + trΣ/B)."""
    rng = np.random.default_rng(seed)
    trace = 100.0
    for t in range(2 * steady + fall):
        g2 = 100.0 ** -(min(max(t - steady, 0), fall) / fall)
        x, y = g2 * (1 + cv * rng.normal()), trace * (1 + cv * rng.normal())
        yield t, trace / g2, x + y / small, small, x + y / big, big


def _lagged_error(estimator, seed):
    """Worst over t ≥ 20 of min over t' ∈ [t−20, t] of |estimate(t)/truth(t') − 1|."""
    truth, est = [], []
    for _, true, s, b, q, big in _falling_stream(seed):
        estimator.update(s, b, q, big)
        truth.append(true)
        est.append(estimator.b_noise)
    truth, est = np.array(truth), np.array(est)
    return max(np.min(np.abs(est[t] / truth[t - 20 : t + 1] - 1)) for t in range(20, len(truth)))


@pytest.mark.parametrize("seed", range(4))
def test_tracking_follows_a_100x_fall_of_grad_sqnorm(seed):
    # the estimate is within 20 % of the truth of at most 20 steps earlier, at every time
    assert _lagged_error(TrackingGnsEstimator(64), seed) <= 0.2
    # one per-step EMA (COPUS, 0.95) lags by far more on the same stream: the test can fail
    assert _lagged_error(GnsEstimator(DecaySchedule()), seed) > 0.4


def test_tracking_uses_a_long_window_while_steady():
    est, steady, falling = TrackingGnsEstimator(64), [], []
    for t, _, s, b, q, big in _falling_stream(0, cv=0.3):
        est.update(s, b, q, big)
        if 40 <= t < 100:  # steady: long levels agree with short ones
            steady.append(est.timescale_samples / 64)
        elif 130 <= t < 200:  # falling: the long levels are left behind
            falling.append(est.timescale_samples / 64)
    assert np.median(steady) == 256 and np.mean(np.array(steady) >= 64) >= 0.8
    assert max(falling) <= 16 and est.num_updates == 300


def test_decay_is_tied_to_samples():
    """Each level forgets per sample (decay exp(−B/τ)), so at twice the batch a level holds the
    same number of samples: n_eff(steps)·B is the same (AdaptDL: θ = 0.999^(B/B0))."""
    held = {}
    for big in (64, 128):
        est = TrackingGnsEstimator(64)
        for _ in range(4000 // (big // 64)):
            est.update(2.0, 8, 1.2, big)
        held[big] = [lv.num_effective * big for lv in est.levels]
    for k in range(3, 9):  # τ ≥ 8 B0: the continuous-time limit
        assert held[128][k] == pytest.approx(held[64][k], rel=0.15)
    assert held[64][8] > 100 * held[64][0] / 2


def test_a_short_level_without_signal_is_passed_over():
    """|G|² truly 1, tr Σ = 100; the last step's |G|² estimate is −5 (noise): the 1-step level
    has no signal (φ = inf), the longer levels still measure ≈ 100 and are used."""
    est = TrackingGnsEstimator(64)
    for _ in range(200):
        est.update(1.0 + 100 / 8, 8, 1.0 + 100 / 64, 64)
    est.update(-5.0 + 100 / 8, 8, -5.0 + 100 / 64, 64)
    assert est.levels[0].b_noise == math.inf
    assert est.chosen_level() > 0 and est.b_noise == pytest.approx(100, rel=0.1)
    empty = TrackingGnsEstimator(64)
    assert empty.chosen_level() == 8 and math.isnan(empty.b_noise)


def test_tracking_state_round_trip_and_errors():
    a, b = TrackingGnsEstimator(8), TrackingGnsEstimator(8)
    stream = list(_falling_stream(1, cv=0.2))
    for _, _, s, sb, q, big in stream[:150]:
        a.update(s, sb, q, big)
    b.load_state_dict(a.state_dict())
    for _, _, s, sb, q, big in stream[150:]:
        a.update(s, sb, q, big)
        b.update(s, sb, q, big)
    assert (a.b_noise, a.rel_err, a.chosen_level()) == (b.b_noise, b.rel_err, b.chosen_level())
    with pytest.raises(ValueError, match="9 levels at ref_batch=8"):
        TrackingGnsEstimator(16).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="kind=.ema.*--set gns.estimator=ema"):
        a.load_state_dict(GnsEstimator().state_dict())
    with pytest.raises(ValueError, match="ref_batch=0"):
        TrackingGnsEstimator(0)
    assert not a.update(math.nan, 8, 1.0, 64) and a.num_skipped == 1
    with pytest.raises(ValueError, match="gns.estimator='best'.*tracking, ema"):
        make_estimator("best", ref_batch=8)
    assert isinstance(make_estimator("ema", ref_batch=8), GnsEstimator)


def test_lower_bound():
    assert lower_bound(100.0, 0.0, 1.645) == 100.0
    assert lower_bound(100.0, 0.5, 1.645) == pytest.approx(100 * math.exp(-0.8225))
    assert lower_bound(100.0, math.inf, 1.645) == 0.0  # unknown error: nothing to act on
    assert lower_bound(100.0, math.inf, 0.0) == 100.0  # z = 0: the point estimate
    assert math.isnan(lower_bound(math.nan, 0.1, 1.645))
    assert lower_bound(math.inf, 0.3, 1.645) == math.inf


# --------------------------------------------------------------------------- policies
D = 16


class GradientFeed:
    """Per step J = dp·num_microbatches small gradients g_j ~ N(G, Σ/b) (|G|² = g2,
    tr Σ = trace, isotropic in D dims) → a real estimator → StepRecords like the trainer's.
    `trace_at(step)` may change tr Σ (a transient)."""

    def __init__(self, plan, estimator, g2=1.0, trace=24.0, seed=0, trace_at=None):
        self.plan, self.est, self.rng = plan, estimator, np.random.default_rng(seed)
        self.G = np.full(D, math.sqrt(g2 / D))
        self.trace, self.trace_at = trace, trace_at or (lambda step: None)
        self.step = self.samples = 0

    def record(self):
        p = self.plan
        J, b = p.dp * p.num_microbatches, p.micro_batch_size
        self.step += 1
        trace = self.trace_at(self.step) or self.trace
        g = self.G + self.rng.normal(size=(J, D)) * math.sqrt(trace / D / b)
        gbar = g.mean(0)
        self.samples += p.global_batch_size
        s, q = float((g * g).sum(1).mean()), float(gbar @ gbar)
        self.est.update(s, b, q, p.global_batch_size)
        return StepRecord(
            step=self.step,
            samples=self.samples,
            tokens=self.samples * 16,
            plan=p,
            step_s=1.0,
            loss=3.0,
            small_sqnorm=s,
            small_batch=float(b),
            num_small=J,
            big_sqnorm=q,
            grad_sqnorm=self.est.grad_sqnorm,
            grad_trace_cov=self.est.grad_trace_cov,
            b_noise=self.est.b_noise,
            b_noise_rel_err=self.est.rel_err,
        )

    def run(self, policy, steps):
        out = []
        for _ in range(steps):
            d = policy.observe(self.record())
            if d is not None:
                out.append(d)
                self.plan = d.plan
        return out


def _plan(nmb, mbs=2):
    return ParallelPlan(dp=1, tp=1, pp=1, micro_batch_size=mbs, num_microbatches=nmb)


def _settings(**kw):
    base = dict(initial=8, min=8, max=1024, warmup_steps=10, interval_steps=10, gns_c=1.0)
    return PolicySettings(**{**base, **kw})


def _records(plan, steps, b_noise, rel_err):
    return [
        StepRecord(
            step=k,
            samples=8 * k,
            tokens=128 * k,
            plan=plan,
            step_s=1.0,
            loss=3.0,
            b_noise=b_noise,
            b_noise_rel_err=rel_err,
        )
        for k in range(1, steps + 1)
    ]


def _sizes(policy, records):
    out, plan = [], records[0].plan
    for r in records:
        d = policy.observe(StepRecord(**{**{f: getattr(r, f) for f in r.__slots__}, "plan": plan}))
        if d is not None:
            plan = d.plan
            out.append(plan.global_batch_size)
    return out


def test_lower_bound_policy_acts_where_the_rel_err_gate_freezes():
    """b_noise = 400 with rel_err 0.8 for a whole run: the old rule (rel_err ≤ max_rel_err =
    0.5, then the point estimate) never acts — gns-start seed 0 stayed at B = 8 this way; the
    lower bound 400·exp(−1.645·0.8) = 107 grows the batch 2× per decision up to it."""
    start = _plan(nmb=2, mbs=4)
    recs = _records(start, 100, 400.0, 0.8)
    assert _sizes(GnsPolicy(_settings(confidence=0.0, recovery_steps=0), start), recs) == []
    assert _sizes(GnsPolicy(_settings(recovery_steps=0), start), recs) == [16, 32, 64, 108]
    # a tighter estimate raises the bound; the recovery hold spaces the decisions
    tight = _sizes(GnsPolicy(_settings(), start), _records(start, 200, 400.0, 0.1))
    assert tight == [16, 32, 64, 128, 256, 340]


@pytest.mark.parametrize("seed", range(3))
def test_lower_bound_rarely_grows_past_the_truth(seed):
    """True b_noise = 12 at B = 16 (c = 1): no growth is due. The point estimate of a noisy
    stream crosses 16 now and then; the lower bound does not."""
    start = _plan(nmb=4, mbs=4)
    point = GradientFeed(start, TrackingGnsEstimator(16), trace=12.0, seed=seed)
    bound = GradientFeed(start, TrackingGnsEstimator(16), trace=12.0, seed=seed)
    n_point = len(point.run(GnsPolicy(_settings(initial=16, min=16, confidence=0.0, max_rel_err=10.0), start), 400))
    n_bound = len(bound.run(GnsPolicy(_settings(initial=16, min=16), start), 400))
    assert n_bound == 0 and n_bound <= n_point


def test_a_doubling_alone_does_not_trigger_growth():
    """B is doubled 16 → 32 from outside at step 200 with c·b_noise = 24 < 32 throughout;
    the change brings a 10-step transient (tr Σ × 4: the loss bump of COPUS App. E). The
    recovery hold plus the lower bound keep the batch; COPUS's rule (point estimate, no hold,
    one per-step EMA) grows on the transient."""

    def bump(step):
        return 96.0 if 200 < step <= 210 else None

    def run(policy, estimator):
        start = _plan(nmb=8)
        feed = GradientFeed(start, estimator, trace=24.0, seed=5, trace_at=bump)
        before = feed.run(policy, 200)
        feed.plan = _plan(nmb=16)  # the doubling, decided elsewhere
        return before, feed.run(policy, 200)

    before, after = run(
        GnsPolicy(_settings(initial=16, min=16, max_growth=4.0), _plan(nmb=8)), TrackingGnsEstimator(16)
    )
    assert all(d.plan.global_batch_size <= 24 for d in before)
    assert after == []
    copus = GnsPolicy(
        _settings(initial=16, min=16, max_growth=4.0, confidence=0.0, recovery_steps=0, max_rel_err=10.0), _plan(nmb=8)
    )
    _, after_copus = run(copus, GnsEstimator(DecaySchedule()))
    assert after_copus and after_copus[0].step <= 220


def test_auto_estimator_is_the_ema_under_goodput_and_tracking_otherwise():
    """gns.estimator = "auto" (the default): the goodput controllers read a fixed-memory EMA
    (their posterior over c absorbs a consistent bias, not one that changes with the chosen
    window; docs/robust-goodput.md §6.15); every other policy reads the tracking estimator."""
    from copus.core.stats.gns import GnsEstimator
    from copus.core.stats.gns_tracking import TrackingGnsEstimator, resolve_estimator

    assert resolve_estimator("auto", "goodput") == resolve_estimator("auto", "goodput-copus") == "ema"
    assert resolve_estimator("auto", "gns") == resolve_estimator("auto", "norm-test") == "tracking"
    assert resolve_estimator("tracking", "goodput") == "tracking" and resolve_estimator("ema", "gns") == "ema"
    assert isinstance(make_estimator(resolve_estimator("auto", "goodput"), ref_batch=8), GnsEstimator)
    assert isinstance(make_estimator(resolve_estimator("auto", "constant"), ref_batch=8), TrackingGnsEstimator)
