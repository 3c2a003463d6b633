import json
import math
import sys
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from copus.core.stats.batch_tests import norm_test_terms
from copus.core.plan.plan import ParallelPlan
from copus.core.control.policies import (
    POLICY_NAMES,
    ConstantPolicy,
    GnsPolicy,
    InnerProductTestPolicy,
    NormTestPolicy,
    PolicySettings,
    RampPolicy,
    make_policy,
)
from copus.core.plan.records import StepRecord

D = 8


class Feed:
    """Synthetic training: per step, J = dp·num_microbatches small gradients of b = micro_batch_size
    samples each, g_j ~ N(G, Σ/b) with |G|² = `g2`, tr Σ = `trace`; records like the trainer's."""

    def __init__(self, plan, g2=0.5, trace=20.0, seed=0, ip=True):
        self.plan, self.rng, self.ip = plan, np.random.default_rng(seed), ip
        self.G = np.full(D, math.sqrt(g2 / D))
        self.sd = math.sqrt(trace / D)
        self.step = self.samples = 0

    def record(self, **over):
        p = self.plan
        J, b = p.dp * p.num_microbatches, p.micro_batch_size
        g = self.G + self.rng.normal(size=(J, D)) * self.sd / math.sqrt(b)
        gbar = g.mean(0)
        self.step += 1
        self.samples += p.global_batch_size
        kw = dict(
            step=self.step,
            samples=self.samples,
            tokens=self.samples * 16,
            plan=p,
            step_s=1.0,
            loss=3.0,
            small_sqnorm=float((g * g).sum(1).mean()),
            small_batch=float(b),
            num_small=J,
            big_sqnorm=float(gbar @ gbar),
            ip_sq_mean=float(((g @ gbar) ** 2).mean()) if self.ip else None,
            b_noise=20.0 / 0.5,
            b_noise_rel_err=0.1,
        )
        kw.update(over)
        return StepRecord(**kw)

    def run(self, policy, steps, **over):
        decisions = []
        for _ in range(steps):
            rec = self.record(**over)
            d = policy.observe(rec)
            if d is not None:
                decisions.append(d)
                self.plan = d.plan
        return decisions


def plan(dp=1, pp=1, mbs=1, nmb=8, tp=1):
    return ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=nmb)


def test_settings_mirror_config_and_validate():
    from copus.config import Config

    cfg = Config()
    s = PolicySettings.from_config(cfg)
    assert s.initial == cfg.batch.initial and s.norm_test_form == cfg.batch.norm_test_form
    assert s.max_rel_err == cfg.gns.max_rel_err
    # issue 26: gns.calibration defaults to "auto" (learnt in the run), the prior median 4.0
    assert cfg.gns.calibration == "auto" and s.calibration_mode == "auto" and s.calibration == 4.0
    from copus.config import load_config

    probe = PolicySettings.from_config(load_config(overrides=["gns.calibration='probe'"]))
    assert probe.calibration == 1.0 and probe.calibration_mode == "fixed"
    fixed = PolicySettings.from_config(load_config(overrides=["gns.calibration=3.0"]))
    assert fixed.calibration == 3.0 and fixed.calibration_mode == "fixed"
    with pytest.raises(ValueError, match="batch.max=4"):
        PolicySettings(min=8, max=4)
    with pytest.raises(ValueError, match="batch.max_growth=0.5"):
        PolicySettings(max_growth=0.5)
    with pytest.raises(ValueError, match="norm_test_eta=0"):
        PolicySettings(norm_test_eta=0)
    with pytest.raises(ValueError, match="norm_test_form='exact'"):
        PolicySettings(norm_test_form="exact")


def test_make_policy_names_and_goodput_is_lazy(monkeypatch):
    assert POLICY_NAMES == (
        "constant",
        "ramp",
        "norm-test",
        "norm-test-lau",
        "inner-product-test",
        "gns",
        "goodput",
        "goodput-copus",
        "doubling",
        "schedule",
    )
    s, p = PolicySettings(), plan()
    for name, cls in (
        ("constant", ConstantPolicy),
        ("ramp", RampPolicy),
        ("norm-test", NormTestPolicy),
        ("inner-product-test", InnerProductTestPolicy),
        ("gns", GnsPolicy),
    ):
        assert isinstance(make_policy(name, s, p), cls)
    with pytest.raises(ValueError, match="policy='best'.*constant, ramp, norm-test"):
        make_policy("best", s, p)
    calls = []
    fake = types.ModuleType("copus.core.control.controller")
    fake.make_controller = lambda *a, **kw: calls.append((a, kw)) or "controller"
    monkeypatch.setitem(sys.modules, "copus.core.control.controller", fake)
    assert make_policy("goodput", s, p, 4, None, margin=0.2) == "controller"
    assert calls == [((s, p, 4, None), {"policy": "goodput", "margin": 0.2})]
    assert make_policy("goodput-copus", s, p, 4, None) == "controller"  # the same factory
    assert calls[-1][1] == {"policy": "goodput-copus"}


def _check_invariants(decisions, start, s):
    prev = start
    last_step = 0
    for d in decisions:
        new = d.plan
        assert d.kind == "batch" and new.layout == prev.layout
        assert new.micro_batch_size == prev.micro_batch_size
        assert prev.global_batch_size < new.global_batch_size <= s.max
        assert new.global_batch_size <= s.max_growth * prev.global_batch_size
        assert new.global_batch_size % (new.dp * new.micro_batch_size) == 0
        assert new.num_microbatches >= new.pp
        assert d.step >= s.warmup_steps and d.step - last_step >= s.interval_steps
        assert str(new.global_batch_size) in d.reason
        prev, last_step = new, d.step


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["ramp", "norm-test", "inner-product-test", "gns"]),
    dp=st.integers(1, 4),
    pp=st.sampled_from([1, 2]),
    mbs=st.integers(1, 3),
    max_batch=st.integers(16, 300),
    growth=st.sampled_from([1.5, 2.0, 3.0]),
    warmup=st.integers(0, 12),
    interval=st.integers(1, 6),
    trace=st.floats(1.0, 400.0),
    seed=st.integers(0, 10**6),
)
def test_policies_respect_limits(name, dp, pp, mbs, max_batch, growth, warmup, interval, trace, seed):
    start = plan(dp=dp, pp=pp, mbs=mbs, nmb=max(pp, 2))
    s = PolicySettings(
        initial=start.global_batch_size,
        min=1,
        max=max(max_batch, start.global_batch_size),
        max_growth=growth,
        warmup_steps=warmup,
        interval_steps=interval,
        ramp_to=max(max_batch, start.global_batch_size),
        ramp_samples=500,
        norm_test_eta=0.3,
        ip_theta=0.3,
        orth_nu=0.5,
    )
    feed = Feed(start, trace=trace, seed=seed)
    policy = make_policy(name, s, start)
    decisions = feed.run(policy, 60, b_noise=trace / 0.5)
    _check_invariants(decisions, start, s)


def test_no_decision_before_warmup_and_between_intervals():
    start = plan(nmb=8)
    s = PolicySettings(initial=8, max=1024, warmup_steps=25, interval_steps=7, recovery_steps=0)
    feed = Feed(start, trace=500.0)
    decisions = feed.run(GnsPolicy(s, start), 60, b_noise=1000.0)
    assert [d.step for d in decisions][:3] == [25, 32, 39]
    assert [d.plan.global_batch_size for d in decisions][:3] == [16, 32, 64]


def test_gns_policy_approaches_c_times_b_noise_and_waits_for_accuracy():
    start = plan(dp=2, mbs=2, nmb=2)  # multiple of 4
    s = PolicySettings(
        initial=8,
        min=8,
        max=4096,
        warmup_steps=0,
        interval_steps=5,
        gns_c=2.0,
        max_rel_err=0.3,
        confidence=0.0,
        recovery_steps=0,
    )
    feed, policy = Feed(start), GnsPolicy(s, start)
    assert feed.run(policy, 30, b_noise=101.0, b_noise_rel_err=0.5) == []
    decisions = feed.run(policy, 60, b_noise=101.0, b_noise_rel_err=0.2)
    sizes = [d.plan.global_batch_size for d in decisions]
    assert sizes == [16, 32, 64, 128, 204]  # ceil(202 / 4) * 4, ≤ 2x per decision
    assert decisions[0].step == 31  # first accurate step
    assert "b_noise=101.0" in decisions[-1].reason and "gns_c=2" in decisions[-1].reason
    assert feed.run(policy, 30, b_noise=50.0) == []  # never shrinks


def test_norm_test_policy_finds_its_fixed_point():
    """Per-sample form passes when B ≥ b_noise·(1/η² − 1): 40·3 = 120 here."""
    start = plan(nmb=8)
    s = PolicySettings(initial=8, max=4096, warmup_steps=10, interval_steps=10, norm_test_eta=0.5)
    feed = Feed(start, g2=0.5, trace=20.0, seed=4)
    decisions = feed.run(NormTestPolicy(s, start), 300)
    final = feed.plan.global_batch_size
    assert 90 <= final <= 200, [d.plan.global_batch_size for d in decisions]
    assert "norm test (per-sample, eta=0.5): T=" in decisions[0].reason


def test_norm_test_averages_terms_over_the_window():
    start = plan(nmb=4)
    s = PolicySettings(initial=4, min=1, max=1024, warmup_steps=0, interval_steps=2, norm_test_eta=0.5)
    policy = NormTestPolicy(s, start)
    stats = [(3.0, 0.1), (2.0, 0.4)]
    out = None
    for i, (sq, q) in enumerate(stats, 1):
        out = policy.observe(
            StepRecord(
                step=i,
                samples=4 * i,
                tokens=0,
                plan=start,
                step_s=1,
                loss=1,
                small_sqnorm=sq,
                big_sqnorm=q,
                num_small=4,
                small_batch=1.0,
            )
        )
    terms = [norm_test_terms(sq, q, 4, 1.0) for sq, q in stats]
    t = np.mean([v for v, _ in terms]) / (0.25 * np.mean([q for _, q in terms]))
    assert out is not None and f"T={t:.1f} > B=4 over 2 steps" in out.reason


def test_inner_product_policy_needs_ip_stats():
    start = plan(nmb=8)
    s = PolicySettings(initial=8, max=1024, warmup_steps=0, interval_steps=5, ip_theta=0.3, orth_nu=0.5)
    assert Feed(start, ip=False).run(InnerProductTestPolicy(s, start), 40) == []
    decisions = Feed(start).run(InnerProductTestPolicy(s, start), 40)
    assert decisions and "T_ip=" in decisions[0].reason and "T_orth=" in decisions[0].reason


def test_skipped_and_non_finite_records_are_ignored():
    start = plan(nmb=8)
    s = PolicySettings(initial=8, max=1024, warmup_steps=0, interval_steps=1)
    feed = Feed(start)
    policy = NormTestPolicy(s, start)
    assert feed.run(policy, 5, skipped=True) == []
    assert feed.run(policy, 5, small_sqnorm=math.nan) == []
    assert feed.run(GnsPolicy(s, start), 5, b_noise=math.nan) == []


def test_ramp_policy_follows_schedule():
    start = plan(dp=2, nmb=4)
    s = PolicySettings(
        initial=8,
        max=64,
        ramp_to=32,
        ramp_samples=400,
        warmup_steps=0,
        interval_steps=1,
        ramp_kind="stepwise",
        ramp_steps=2,
    )
    feed = Feed(start)
    decisions = feed.run(RampPolicy(s, start), 80)
    assert [d.plan.global_batch_size for d in decisions] == [16, 20, 32]
    assert decisions[0].step == 25  # 25·8 = 200 samples: half-way
    assert ConstantPolicy(s, start).observe(feed.record()) is None
    with pytest.raises(ValueError, match="batch.ramp_to=4 is invalid"):
        RampPolicy(PolicySettings(initial=8, ramp_to=4), start)


@pytest.mark.parametrize("name", ["norm-test", "inner-product-test", "gns", "ramp"])
def test_state_round_trip_gives_identical_decisions(name):
    start = plan(nmb=8)
    s = PolicySettings(
        initial=8, max=4096, warmup_steps=3, interval_steps=7, ramp_to=256, ramp_samples=2000, ip_theta=0.2, orth_nu=0.5
    )
    feed = Feed(start, seed=2)
    records = []
    for _ in range(100):
        records.append(feed.record(b_noise=30.0 + feed.step))
    a = make_policy(name, s, start)
    for r in records[:45]:
        a.observe(r)
    b = make_policy(name, s, start)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    outs = [(a.observe(r), b.observe(r)) for r in records[45:]]
    assert all(x == y for x, y in outs)
    assert sum(x is not None for x, _ in outs) >= 3
    assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="policy state"):
        make_policy("constant", s, start).load_state_dict(a.state_dict())


def test_lau_schedule_jumps_to_the_rounded_statistic_at_the_first_step():
    """Lau et al. Algorithm 1: tested at step 1 on that step alone, b ← ⌈T⌉ rounded up to a
    multiple of dp·micro_batch_size, no growth cap, clipped at max; an infinite T → max."""
    start = plan(dp=2, mbs=2, nmb=2)  # B = 8, multiple 4
    s = PolicySettings(
        initial=8, max=1000, interval_steps=1, warmup_steps=0, max_growth=float("inf"), norm_test_eta=0.5
    )
    rec = Feed(start).record(small_sqnorm=3.0, big_sqnorm=0.1)
    t = norm_test_terms(3.0, 0.1, 4, 2.0)[0] / (0.25 * 0.1)  # 2·4/3·2.9/0.025 = 309.3
    d = make_policy("norm-test-lau", s, start).observe(rec)
    assert d.step == 1 and d.plan.global_batch_size == 4 * math.ceil(t / 4) == 312
    d = make_policy("norm-test-lau", s, start).observe(Feed(start).record(small_sqnorm=3.0, big_sqnorm=0.0))
    assert d.plan.global_batch_size == 1000 and "capped at max=1000" in d.reason


def test_forms_refuse_the_wrong_small_gradients_and_uncomputable_starts():
    s = PolicySettings(initial=8, max=64, norm_test_form="paper", warmup_steps=0, interval_steps=1)
    with pytest.raises(ValueError, match=r"^batch.norm_test_form='paper' is invalid at dp=1"):
        NormTestPolicy(s, plan(dp=1, nmb=8))
    start = plan(dp=2, mbs=2, nmb=2)
    with pytest.raises(
        ValueError,
        match=r"needs J=2 per-worker gradients, got J=4; allowed: "
        r"gns.small='rank'",
    ):
        NormTestPolicy(s, start).observe(Feed(start).record())  # micro-batch records
    with pytest.raises(ValueError, match="dp\\*num_microbatches=1"):
        NormTestPolicy(PolicySettings(initial=8, max=64), plan(dp=1, mbs=8, nmb=1))
