"""Decision audits (core/control/audit.py): a decision whose realised step time misses its prediction
badly enough is undone (shrinking the batch if need be); one that delivers is kept; both are
logged with the comparison."""

import json

import pytest

from copus.core.control.audit import Auditor, PendingAudit, audit_row
from copus.core.control.controller import make_controller
from copus.core.cost.fit import prior_model
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan
from copus.core.control.policies import PolicySettings
from copus.core.plan.records import Candidate, Decision, StepRecord

SHAPE = get_model_shape("tiny")
B8 = ParallelPlan(dp=4, tp=1, pp=1, micro_batch_size=2, num_microbatches=1)
SETTINGS = PolicySettings(initial=8, min=8, max=64, interval_steps=5, warmup_steps=5)


def _record(step, plan, step_s, b_noise=400.0):
    return StepRecord(
        step=step, samples=0, tokens=0, plan=plan, step_s=step_s, loss=1.0, b_noise=b_noise, b_noise_rel_err=0.1
    )


def _controller(audit_steps=3):
    # batch changes only (one layout, one micro-batch size): the audit is what is tested
    return make_controller(
        SETTINGS,
        B8,
        4,
        SHAPE,
        micro_batch_sizes=[2],
        audit_steps=audit_steps,
        allow_reconfigure=False,
        step_time_model=prior_model(SHAPE, None, 4),
    )


def _drive(ctrl, true_s, steps):
    plan, plans, decisions, events = B8, [], [], []
    for step in range(1, steps + 1):
        plans.append(plan)
        d = ctrl.observe(_record(step, plan, true_s(plan)))
        events += ctrl.drain_events()
        if d is not None:
            decisions.append(d)
            plan = d.plan
    return plans, decisions, events


def test_a_growth_that_delivers_less_than_it_predicted_is_undone():
    """The prior predicts B=16 at about the cost of B=8 (fixed per-step costs dominate), so the
    controller grows; on this "machine" B=16 takes 4× as long as B=8: realised goodput is far
    below the plan it left, so the growth is undone and B shrinks back to 8."""
    ctrl = _controller()
    plans, decisions, events = _drive(ctrl, lambda p: 0.1 * (p.global_batch_size / 8) ** 2, 20)
    grow = decisions[0]
    assert grow.purpose == "decide" and grow.plan.global_batch_size == 16
    audits = [e for e in events if e["event"] == "audit"]
    assert audits[0]["decision_step"] == grow.step and audits[0]["verdict"] == "undo"
    assert audits[0]["realised_step_s"] == pytest.approx(0.4)
    assert audits[0]["step_error"] > 0.5  # realised ≫ predicted
    assert audits[0]["realised_goodput"] < audits[0]["before_goodput"] * (1 - 0.10)
    undo = decisions[1]
    assert undo.purpose == "undo" and undo.plan == B8 and undo.step == audits[0]["step"]
    assert undo.step == grow.step + 1 + 3  # one warm-up + audit_steps steps
    assert plans[undo.step] == B8  # the batch shrank back
    assert all(p == B8 for p in plans[undo.step :])  # measured now: no re-growth
    json.dumps(events)


def test_a_growth_that_delivers_is_kept():
    ctrl = _controller()
    plans, decisions, events = _drive(ctrl, lambda p: 0.1 + 0.001 * p.global_batch_size, 20)
    audits = [e for e in events if e["event"] == "audit"]
    assert audits and all(a["verdict"] == "keep" for a in audits)
    assert not [d for d in decisions if d.purpose == "undo"]
    assert plans[-1].global_batch_size > 8


def test_audits_off_and_not_applied():
    ctrl = _controller(audit_steps=0)
    _, decisions, events = _drive(ctrl, lambda p: 0.1 * (p.global_batch_size / 8) ** 2, 20)
    assert decisions and not events
    a = Auditor(3, margin=0.1)
    d = Decision(
        kind="batch",
        plan=B8.with_batch(16),
        reason="x",
        step=5,
        candidates=(Candidate(plan=B8.with_batch(16), step_s=0.1, goodput=1.0),),
    )
    a.start(d, B8, 0.1, True)
    row, undo = a.follow(6, B8, 0.1, lambda s, b: b / s, 100.0)  # the trainer refused it
    assert row["verdict"] == "not applied" and undo is None and not a.busy
    with pytest.raises(ValueError, match="audit_steps=-1"):
        Auditor(-1)


def test_audit_row_compares_realised_goodput_with_the_plan_left():
    p = PendingAudit(
        step=3,
        kind="batch",
        before=B8,
        after=B8.with_batch(16),
        predicted_step_s=0.2,
        before_step_s=0.1,
        before_measured=True,
        times=[0.25, 0.3, 0.35],
    )
    row = audit_row(p, lambda s, b: b / s, margin=0.1, step=7, b_noise=100.0)
    assert row["realised_step_s"] == 0.3 and row["step_error"] == pytest.approx(0.5)
    assert row["realised_goodput"] == pytest.approx(16 / 0.3)
    assert row["before_goodput"] == pytest.approx(80.0)
    assert row["realised_vs_before"] == pytest.approx(16 / 0.3 / 80 - 1)
    assert row["verdict"] == "undo"
    p.times = [0.19, 0.2, 0.21]
    assert audit_row(p, lambda s, b: b / s, margin=0.1, step=7, b_noise=100.0)["verdict"] == "keep"
