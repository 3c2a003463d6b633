"""COPUS's goodput controller (`goodput-copus`): gating, online refit, switch costs, no flapping,
state round-trip. The planning controller (`goodput`) is tested in test_planner.py."""

import json
import math

import numpy as np
import pytest

from copus.core.control.controller import make_controller
from copus.core.cost.memory import MemoryModel
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan, plan_problems
from copus.core.control.policies import PolicySettings
from copus.core.plan.records import StepRecord
from copus.core.cost.throughput import StepTimeModel

SHAPE = get_model_shape("llama-3.2-3b")
HW = "h100-nvlink-pairs"
INIT = ParallelPlan(dp=2, tp=1, pp=4, micro_batch_size=1, num_microbatches=8)  # COPUS 3B start
# COPUS's rule (point estimate once rel_err <= max_rel_err, c = 2, no recovery hold); the
# lower-bound and recovery rules have their own tests below
SETTINGS = PolicySettings(
    initial=16, min=16, max=512, interval_steps=10, warmup_steps=10, calibration=2.0, confidence=0.0, recovery_steps=0
)
TRUE = StepTimeModel.analytic(SHAPE, HW, 8)  # the "machine" the synthetic trainer runs on


def _controller(**kw):
    kw.setdefault("policy", "goodput-copus")
    kw.setdefault("lr_aware", True)
    kw.setdefault("hardware", HW)
    kw.setdefault("memory_capacity_bytes", 80e9)
    return make_controller(kw.pop("settings", SETTINGS), INIT, 8, SHAPE, **kw)


def _record(step, plan, step_s, b_noise, rel_err=0.1, skipped=False):
    return StepRecord(
        step=step,
        samples=0,
        tokens=0,
        plan=plan,
        step_s=step_s,
        loss=1.0,
        b_noise=b_noise,
        b_noise_rel_err=rel_err,
        skipped=skipped,
    )


def _drive(
    ctrl,
    steps,
    *,
    seed=0,
    start=1,
    plan=INIT,
    b_noise=lambda s: 200.0,
    step_noise=0.05,
    gns_noise=0.3,
    slowdown=1.0,
    switch_cost_s=30.0,
):
    """Run a synthetic trainer; returns (decisions, final plan)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(start, start + steps):
        t = slowdown * TRUE.predict_plan(plan) * (1 + step_noise * rng.standard_normal())
        b = b_noise(step) * math.exp(gns_noise * rng.standard_normal())
        d = ctrl.observe(_record(step, plan, t, b))
        if d is not None:
            out.append(d)
            plan = d.plan
            if d.kind == "reconfigure":
                ctrl.record_switch_cost(switch_cost_s)
    return out, plan


def test_waits_for_warmup_and_a_trustworthy_gns():
    ctrl = _controller()
    assert ctrl.observe(_record(5, INIT, 0.5, 200.0)) is None
    assert ctrl.last_explanation["action"] == "wait" and "warmup" in ctrl.last_explanation["why"]
    assert ctrl.observe(_record(10, INIT, 0.5, 200.0, rel_err=0.9)) is None
    assert "rel. error 0.9 > max_rel_err 0.5" in ctrl.last_explanation["why"]
    assert ctrl.observe(_record(11, INIT, 0.5, float("nan"))) is None
    assert "gns not ready" in ctrl.last_explanation["why"]
    assert ctrl.observe(_record(12, INIT, 0.5, 200.0, skipped=True)) is None
    ctrl.observe(_record(13, INIT, 0.5, 200.0))
    assert ctrl.last_explanation["action"] != "wait"  # the first decision point
    assert len(ctrl.last_explanation["top"]) == 5
    assert ctrl.last_explanation["b_noise"] == pytest.approx(2.0 * 200.0)  # calibration c = 2
    ctrl.observe(_record(14, INIT, 0.5, 200.0))
    assert "next decision at step 23" in ctrl.last_explanation["why"]


def test_decisions_are_feasible_capped_and_explained():
    decisions, _ = _drive(_controller(), 300, b_noise=lambda s: 50.0 + 5.0 * s)
    assert decisions
    mem = MemoryModel(shape=SHAPE)
    prev = INIT
    for d in decisions:
        assert not plan_problems(d.plan, 8, SHAPE)
        assert float(mem.bytes_per_rank(*d.plan.layout, d.plan.micro_batch_size, d.plan.num_microbatches)) <= 80e9
        assert 16 <= d.plan.global_batch_size <= min(512, 2 * prev.global_batch_size)
        assert d.kind == ("batch" if d.plan.layout == prev.layout else "reconfigure")
        assert "margin 10%" in d.reason and d.candidates
        prev = d.plan
    # growing noise scale: the batch grows and ends high
    assert decisions[-1].plan.global_batch_size >= 256


@pytest.mark.parametrize("seed", [0, 3, 8])
def test_no_flapping_under_noisy_statistics(seed):
    """Constant true b_noise, 40% log-normal noise on it and 10% on step times: the controller
    converges, never returns to a plan it left and never shrinks the batch."""
    ctrl = _controller()
    decisions, _ = _drive(ctrl, 400, seed=seed, b_noise=lambda s: 300.0, gns_noise=0.4, step_noise=0.10)
    plans = [INIT] + [d.plan for d in decisions]
    assert len(decisions) <= 8
    assert len(set(plans)) == len(plans), [p.describe() for p in plans]
    batches = [p.global_batch_size for p in plans]
    assert batches == sorted(batches)
    assert len(ctrl.history) == len(decisions)


def test_huge_switch_cost_means_batch_changes_only():
    ctrl = _controller(reconfig_cost_s=1e9)
    decisions, _ = _drive(ctrl, 200, b_noise=lambda s: 50.0 + 5.0 * s)
    assert decisions and all(d.kind == "batch" for d in decisions)
    ctrl = _controller(allow_reconfigure=False)
    decisions, _ = _drive(ctrl, 200, b_noise=lambda s: 50.0 + 5.0 * s)
    assert decisions and all(d.plan.layout == INIT.layout for d in decisions)
    # a cheap switch does change the layout of this pipeline-heavy start
    decisions, _ = _drive(_controller(reconfig_cost_s=0.1), 200, b_noise=lambda s: 50.0 + 5.0 * s)
    assert any(d.kind == "reconfigure" for d in decisions)


def test_switch_costs_are_learned():
    ctrl = _controller(reconfig_cost_s=7.0)
    assert ctrl.reconfig_cost_s == 7.0
    ctrl.observe(_record(1, INIT, 10.0, 200.0))
    ctrl.record_switch_cost(30.0)
    ctrl.record_switch_cost(50.0)
    assert ctrl.reconfig_cost_s == 40.0
    assert ctrl.elapsed_s == 90.0 and ctrl.useful_s == 10.0
    with pytest.raises(ValueError, match="seconds=-1"):
        ctrl.record_switch_cost(-1)


def test_refits_the_step_time_model_from_measurements():
    """The machine is 3× slower than the analytic prior: after some steps the model knows."""
    ctrl = _controller(settings=PolicySettings(initial=16, min=16, max=16), allow_reconfigure=False)
    before = ctrl.model.predict_plan(INIT)
    _drive(ctrl, 60, slowdown=3.0, step_noise=0.02)
    after = ctrl.model.predict_plan(INIT)
    measured = 3.0 * TRUE.predict_plan(INIT)
    assert abs(before / measured - 1) > 0.5
    assert abs(after / measured - 1) < 0.1
    assert ctrl.model_error() < 0.1 and ctrl.fitter.num_fits >= 1


def test_profile_table_prior():
    plans = [
        INIT,
        ParallelPlan(dp=8, tp=1, pp=1, micro_batch_size=2, num_microbatches=1),
        ParallelPlan(dp=4, tp=2, pp=1, micro_batch_size=4, num_microbatches=1),
        ParallelPlan(dp=2, tp=2, pp=2, micro_batch_size=2, num_microbatches=4),
    ]
    table = [(p, 2.0 * TRUE.predict_plan(p)) for p in plans]
    ctrl = _controller(profile_observations=table)
    for p, s in table:
        assert ctrl.model.predict_plan(p) == pytest.approx(s, rel=0.15)


def test_fixed_table_predictor_is_used_as_is():
    class Table:
        full_calls = 0

        def predict(self, dp, tp, pp, micro_batch_size, num_microbatches):
            self.full_calls += np.size(dp) > 1
            return np.where(np.asarray(dp) == 8, 0.5, 2.0) * np.asarray(num_microbatches)

    table = Table()
    ctrl = _controller(step_time_model=table, reconfig_cost_s=0.0)
    assert ctrl.fitter is None
    decisions, _ = _drive(ctrl, 60)
    assert decisions[0].plan.dp == 8
    assert table.full_calls == 1  # a fixed model scores the candidate set once


def test_state_round_trip_gives_identical_decisions():
    b_noise = lambda s: 20.0 + 1.0 * s  # noqa: E731
    a = _controller()
    first, plan = _drive(a, 55, seed=3, b_noise=b_noise, slowdown=1.5)
    state = json.loads(json.dumps(a.state_dict()))  # JSON-able
    b = _controller()
    b.load_state_dict(state)
    rest_a, _ = _drive(a, 150, seed=4, start=56, plan=plan, b_noise=b_noise, slowdown=1.5)
    rest_b, _ = _drive(b, 150, seed=4, start=56, plan=plan, b_noise=b_noise, slowdown=1.5)
    assert first and rest_a and a.fitter.num_fits >= 1
    assert [d.to_dict() for d in rest_a] == [d.to_dict() for d in rest_b]
    assert a.last_explanation == b.last_explanation
    assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({"version": 99})


def test_bad_settings_raise_value_error():
    with pytest.raises(ValueError, match="no plan fits"):
        _controller(memory_capacity_bytes=1e6)
    with pytest.raises(ValueError, match="world size"):
        make_controller(SETTINGS, INIT, 4, SHAPE)


def _blind(cands):
    return (cands.dp * cands.num_microbatches < 2).sum()


@pytest.mark.parametrize("policy", ["goodput", "goodput-copus"])
def test_every_plan_the_controller_can_choose_measures_the_noise_scale(policy):
    """The README run froze at b_noise 2.3 for 350 steps on tp2 mb16x1: dp = 1 and one micro-batch
    give J = 1 small gradient, so the noise scale cannot update. Such plans are dropped where a
    measuring plan of the same layout and batch exists (tp2 mb8x2), kept where none does."""
    tiny = get_model_shape("tiny")
    init = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=4, num_microbatches=1)
    settings = PolicySettings(initial=8, min=8, max=128, interval_steps=10, warmup_steps=10, calibration=1.0)
    ctrl = make_controller(settings, init, 2, tiny, policy=policy)
    c = ctrl.candidates
    assert _blind(c) == 0
    tp2 = (c.dp == 1) & (c.tp == 2)
    assert set(c.global_batch_size[tp2].tolist()) >= {8, 16, 32, 64, 128}  # every batch stays reachable on tp2
    assert ((c.micro_batch_size == 8) & (c.num_microbatches == 2) & tp2 & (c.global_batch_size == 16)).any()
    pair = make_controller(settings, init, 2, tiny, policy=policy, micro_batch_sizes=[4, 16]).candidates
    # B = 16 on tp2 with micro-batches of 4 or 16: mb4x4 measures, so mb16x1 goes
    assert not ((pair.dp == 1) & (pair.micro_batch_size == 16) & (pair.num_microbatches == 1)).any()
    assert ((pair.dp == 1) & (pair.tp == 2) & (pair.global_batch_size == 16)).any()
    lone = make_controller(settings, init, 2, tiny, policy=policy, micro_batch_sizes=[16]).candidates
    # micro-batches of 16 only: B = 16 on tp2 is mb16x1 or nothing, so it stays reachable
    assert ((lone.tp == 2) & (lone.global_batch_size == 16) & (lone.num_microbatches == 1)).sum() == 1
