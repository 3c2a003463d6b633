"""LR schedule, initial plan, and 2-process trainer runs: resume equality, sample accounting."""

from __future__ import annotations

import json

import pytest

from copus.config import load_config
from copus.core.models import get_model_shape
from copus.runtime.optim import LearningRate, LrSchedule
from copus.runtime.trainer import default_micro_batch_size, initial_plan

# ------------------------------------------------------------------------------ LR schedule


def test_schedule_warmup_then_cosine_to_min():
    s = LrSchedule(base_lr=1.0, kind="cosine", warmup_tokens=100, total_tokens=1100,
                   min_lr_ratio=0.1)
    assert s.multiplier(0) == pytest.approx(0.01)
    assert s.multiplier(50) == pytest.approx(0.5)
    assert s.multiplier(100) == pytest.approx(1.0)
    assert s.multiplier(600) == pytest.approx(0.55)       # half-way: r + (1-r)/2
    assert s.multiplier(1100) == pytest.approx(0.1)
    assert s.multiplier(5000) == pytest.approx(0.1)       # stays at the floor


def test_schedule_linear_and_constant():
    lin = LrSchedule(base_lr=2.0, kind="linear", total_tokens=1000, min_lr_ratio=0.0)
    assert lin.multiplier(250) == pytest.approx(0.75)
    const = LrSchedule(base_lr=2.0, kind="constant", total_tokens=1000)
    assert const.multiplier(999) == 1.0


def test_schedule_is_in_tokens_not_steps():
    """The same tokens give the same LR whatever batch they came in."""
    lr = LearningRate(schedule=LrSchedule(base_lr=1e-3, total_tokens=10_000), rule="none",
                      ref_batch=8)
    small_steps = [lr.lr(t) for t in range(0, 10_000, 1000)]
    assert small_steps == [lr.lr(t) for t in range(0, 10_000, 1000)]
    assert small_steps[0] > small_steps[-1]


def test_lr_rule_factor_is_absolute_and_serialisable():
    lr = LearningRate(schedule=LrSchedule(base_lr=1e-3, kind="constant"), rule="sqrt",
                      ref_batch=8)
    assert lr.on_batch_change(32) == pytest.approx(2.0)
    assert lr.on_batch_change(128) == pytest.approx(4.0)
    assert lr.on_batch_change(8) == pytest.approx(1.0)      # back to the reference: no drift
    assert lr.lr(0) == pytest.approx(1e-3)
    lr.on_batch_change(72)
    state = json.loads(json.dumps(lr.state_dict()))
    other = LearningRate(schedule=lr.schedule, rule="sqrt", ref_batch=8)
    other.load_state_dict(state)
    assert other.lr(123) == lr.lr(123) and len(other.history) == 4


def test_lr_rules_linear_adascale():
    lin = LearningRate(schedule=LrSchedule(base_lr=1.0, kind="constant"), rule="linear",
                       ref_batch=4)
    assert lin.on_batch_change(12) == pytest.approx(3.0)
    ada = LearningRate(schedule=LrSchedule(base_lr=1.0, kind="constant"), rule="adascale",
                       ref_batch=4)
    assert ada.on_batch_change(16) == pytest.approx(1.0)     # no GNS estimate yet → 1
    # gain r = (σ² + μ²)/(σ²/S + μ²), σ² = tr(Σ)/B0: tr=40, B0=4 → σ²=10, μ²=1, S=4 → 11/3.5
    assert ada.on_batch_change(16, grad_sqnorm=1.0, grad_trace_cov=40.0) == pytest.approx(11 / 3.5)


def test_bad_schedule_values_are_value_errors():
    with pytest.raises(ValueError, match="lr_schedule"):
        LrSchedule(base_lr=1.0, kind="exp")
    with pytest.raises(ValueError, match="lr_rule"):
        LearningRate(schedule=LrSchedule(base_lr=1.0), rule="cube")


# ------------------------------------------------------------------------------ initial plan


def test_default_micro_batch_size():
    assert default_micro_batch_size(4, 1) == 4
    assert default_micro_batch_size(12, 1) == 4
    assert default_micro_batch_size(6, 1) == 3
    assert default_micro_batch_size(8, 4) == 2           # ≥ pp micro-batches
    assert default_micro_batch_size(7, 1) == 1


def test_initial_plan_defaults_to_pure_fsdp():
    shape = get_model_shape("tiny")
    plan = initial_plan(load_config(None, ["batch.initial=8"]), 2, shape)
    assert (plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches) == (2, 1, 1,
                                                                                       4, 1)
    plan = initial_plan(load_config(None, ["parallel.pp=2", "batch.initial=8"]), 4, shape)
    assert plan.layout == (2, 1, 2) and plan.num_microbatches >= 2


def test_initial_plan_rejects_bad_layouts():
    shape = get_model_shape("tiny")
    with pytest.raises(ValueError, match="tp=4 must divide n_heads=6"):
        initial_plan(load_config(None, ["parallel.tp=4"]), 4, shape)
    with pytest.raises(ValueError, match="does not divide the world size"):
        initial_plan(load_config(None, ["parallel.tp=3"]), 4, shape)
    with pytest.raises(ValueError, match="batch.initial=9"):
        initial_plan(load_config(None, ["batch.initial=9", "batch.min=1"]), 2, shape)
