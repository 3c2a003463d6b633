"""In-run exploration (core/control/explore.py): probes are bounded and logged, decided on
measurements, never over the memory budget, and off when a [parallel] degree is fixed."""

import json
import math

import numpy as np
import pytest

from copus.config import load_config
from copus.core.control.controller import make_controller
from copus.core.control.explore import ExploreSettings, probe_candidate, probe_verdict
from copus.core.plan.goodput import build_candidates
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan
from copus.core.control.policies import PolicySettings
from copus.core.plan.records import StepRecord
from copus.runtime.train.setup import make_run_policy

SHAPE = get_model_shape("tiny")
DP4 = ParallelPlan(dp=4, tp=1, pp=1, micro_batch_size=8, num_microbatches=1)  # B = 32
SETTINGS = PolicySettings(initial=32, min=32, max=32, interval_steps=10, warmup_steps=5)


def _record(step, plan, step_s, b_noise=50.0):
    return StepRecord(
        step=step, samples=0, tokens=0, plan=plan, step_s=step_s, loss=1.0, b_noise=b_noise, b_noise_rel_err=0.1
    )


def _drive(ctrl, true_s, steps, plan=DP4, seed=0):
    """A synthetic trainer on a machine whose step time per layout is `true_s(plan)`;
    returns (plan per step, decisions, decisions.jsonl events)."""
    rng = np.random.default_rng(seed)
    plans, decisions, events = [], [], []
    for step in range(1, steps + 1):
        plans.append(plan)
        d = ctrl.observe(_record(step, plan, true_s(plan) * (1 + 0.02 * rng.standard_normal())))
        events += ctrl.drain_events()
        if d is not None:
            decisions.append(d)
            plan = d.plan
            if d.kind == "reconfigure":
                ctrl.record_switch_cost(1.0)
    return plans, decisions, events


def _controller(explore, **kw):
    return make_controller(kw.pop("settings", SETTINGS), DP4, 4, SHAPE, explore=explore, audit_steps=3, **kw)


def _layouts_faster(fast: tuple[int, int, int], factor: float):
    """dp4 takes 1 s; the layout `fast` is `factor`× faster; every other one 3× slower."""

    def true_s(plan):
        if plan.layout == (4, 1, 1):
            return 1.0
        return 1.0 / factor if plan.layout == fast else 3.0

    return true_s


ALL = ExploreSettings(max_probes=3, probe_steps=3, interval_steps=4, top_k=6)


def test_switches_to_a_layout_measured_faster_by_more_than_the_margin():
    ctrl = _controller(ALL)
    plans, decisions, events = _drive(ctrl, _layouts_faster((2, 1, 2), 1.5), 60)
    probes = [d for d in decisions if d.purpose == "probe"]
    assert probes and all(d.reason.startswith("probe ") for d in probes)
    kept = [e for e in events if e["event"] == "probe_result" and e["verdict"] == "keep"]
    assert len(kept) == 1 and "dp2.tp1.pp2" in kept[0]["plan"]
    assert kept[0]["gain"] == pytest.approx(0.5, abs=0.1) and kept[0]["margin"] == 0.10
    assert plans[-1].layout == (2, 1, 2)  # stays on the measured-faster layout
    json.dumps(events)  # decisions.jsonl rows are JSON


def test_no_lasting_switch_when_no_layout_beats_the_margin():
    ctrl = _controller(ALL)
    plans, decisions, events = _drive(ctrl, _layouts_faster((2, 1, 2), 1.05), 80)
    results = [e for e in events if e["event"] == "probe_result"]
    assert len(results) == ALL.max_probes  # bounded: max_probes per run
    assert all(e["verdict"] == "revert" for e in results)
    reverts = [d for d in decisions if d.purpose == "revert"]
    assert len(reverts) == ALL.max_probes and all(d.plan.layout == (4, 1, 1) for d in reverts)
    assert plans[-1].layout == (4, 1, 1)
    # each probe ran one warm-up step + probe_steps measured steps, then came back
    n = ALL.probe_steps + 1
    for d in (d for d in decisions if d.purpose == "probe"):  # plans[s] is step s + 1
        assert plans[d.step : d.step + n] == [d.plan] * n and plans[d.step + n] != d.plan
    starts = [d.step for d in decisions if d.purpose == "probe"]
    ends = [e["step"] for e in results]
    assert all(s - e >= ALL.interval_steps for s, e in zip(starts[1:], ends[:-1]))
    assert all(s >= SETTINGS.warmup_steps for s in starts)


def test_top_k_limits_which_layouts_are_probed():
    ctrl = _controller(ExploreSettings(max_probes=10, probe_steps=2, interval_steps=0, top_k=1))
    _, decisions, _ = _drive(ctrl, _layouts_faster((2, 1, 2), 1.0), 30)
    probes = [d for d in decisions if d.purpose == "probe"]
    assert probes and all("the model's #1 other layout" in d.reason for d in probes)


def test_never_probes_a_plan_predicted_over_memory():
    cands = build_candidates(
        4, SHAPE, min_batch=32, max_batch=32, micro_batch_sizes=[1, 2, 4, 8], memory_model=_HugePipelines()
    )

    class PipelinesFastest:
        def predict(self, dp, tp, pp, micro_batch_size, num_microbatches):
            return np.where(np.asarray(pp) == 4, 0.1, 1.0 + 0.0 * np.asarray(dp, float))

    free = probe_candidate(cands, PipelinesFastest(), DP4, [], top_k=1)
    assert free is not None and free.plan.pp == 4  # without a budget it would pick pp4
    capped = probe_candidate(cands, PipelinesFastest(), DP4, [], top_k=6, memory_capacity_bytes=1e9)
    assert capped is not None and capped.plan.pp != 4
    # and through the controller: memory_capacity_bytes prunes the candidates it probes
    ctrl = _controller(ALL, memory_model=_HugePipelines(), memory_capacity_bytes=1e9, step_time_model=None)
    _, decisions, _ = _drive(ctrl, lambda p: 0.1 if p.pp == 4 else 1.0, 60)
    assert decisions and all(d.plan.pp != 4 for d in decisions)


class _HugePipelines:
    """Memory model: pp4 plans need 1e12 bytes per rank, everything else 1e6."""

    def bytes_per_rank(self, dp, tp, pp, micro_batch_size, num_microbatches):
        return np.where(np.asarray(pp) == 4, 1e12, 1e6)


def test_a_fixed_parallel_degree_means_no_probes():
    cfg = load_config(
        None,
        [
            "train.max_steps=5",
            "parallel.nproc=4",
            "parallel.dp=4",
            "batch.initial=32",
            "batch.min=32",
            "batch.max=32",
            "batch.ramp_to=32",
            "batch.warmup_steps=0",
            "controller.explore_interval_steps=0",
        ],
    )
    ctrl = make_run_policy(cfg, DP4, 4, SHAPE)
    assert ctrl.explorer.settings.max_probes == 4  # on by default ...
    plans, decisions, events = _drive(ctrl, _layouts_faster((2, 1, 2), 3.0), 40)
    # ... but the layout is fixed: micro-batch changes only, never a probe
    assert {p.layout for p in plans} == {(4, 1, 1)} and all(d.kind == "batch" for d in decisions)
    assert not any(d.purpose == "probe" for d in decisions)
    assert not [e for e in events if e["event"] == "probe_result"]
    free = make_run_policy(
        load_config(
            None,
            [
                "train.max_steps=5",
                "parallel.nproc=4",
                "batch.initial=32",
                "batch.min=32",
                "batch.max=32",
                "batch.ramp_to=32",
                "batch.warmup_steps=0",
                "controller.explore_top_k=6",
            ],
        ),
        DP4,
        4,
        SHAPE,
    )
    assert any(d.purpose == "probe" for d in _drive(free, _layouts_faster((2, 1, 2), 3.0), 40)[1])


def test_probe_verdict_and_state_round_trip():
    assert probe_verdict(1.0, 0.8, 0.10) == (True, pytest.approx(0.25))
    assert probe_verdict(1.0, 0.95, 0.10)[0] is False
    assert probe_verdict(float("nan"), 0.5, 0.10)[0] is False
    ctrl, plan = _controller(ALL), DP4
    for step in range(1, 40):  # stop in the middle of a probe
        d = ctrl.observe(_record(step, plan, 1.0))
        plan = d.plan if d is not None else plan
        if ctrl.explorer.busy:
            break
    assert ctrl.explorer.busy
    state = json.loads(json.dumps(ctrl.state_dict()))
    other = _controller(ALL)
    other.load_state_dict(state)
    assert other.explorer.state_dict() == ctrl.explorer.state_dict()
    with pytest.raises(ValueError, match="explore_probe_steps=0"):
        ExploreSettings(probe_steps=0)
    assert not math.isnan(ctrl.measured_step_s(DP4))
