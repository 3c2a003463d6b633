"""core.replan: the plan a resumed run takes at a new world size."""

from __future__ import annotations

import math

import numpy as np
import pytest

from copus.core.cost.fit import prior_model
from copus.core.plan.goodput import build_candidates
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.replan import FixedDegrees, batch_pool, replan

SHAPE = get_model_shape("tiny")
SAVED = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=2)  # B = 8


def _cands(world: int, lo: int = 8, hi: int = 64, sizes=(1, 2, 4)):
    return build_candidates(world, SHAPE, min_batch=lo, max_batch=hi, micro_batch_sizes=sizes)


def test_keeps_the_global_batch_and_takes_the_fastest_plan_of_the_new_world():
    cands, model = _cands(4), prior_model(SHAPE, None, 4)
    d = replan(cands, model, saved=SAVED, why="world size changed from 2 to 4")
    assert d is not None and d.plan.world_size == 4 and d.plan.global_batch_size == 8
    at_b = np.flatnonzero(cands.global_batch_size == 8)
    fastest = at_b[np.argmin(cands.predict_step_s(model, at_b))]
    assert d.plan == cands.plan(int(fastest))
    assert d.kind == "reconfigure" and d.reason.startswith("world size changed from 2 to 4: global batch 8 kept; ")
    assert [c.plan for c in d.candidates][0] == d.plan and len(d.candidates) == 5
    steps = [c.step_s for c in d.candidates]
    assert steps == sorted(steps) and all(c.plan.global_batch_size == 8 for c in d.candidates)


def test_fixed_degrees_are_respected():
    cands, model = _cands(4), prior_model(SHAPE, None, 4)
    for fixed in (
        FixedDegrees(micro_batch_size=1),
        FixedDegrees(tp=2),
        FixedDegrees(dp=4, micro_batch_size=2),
        FixedDegrees(pp=2, tp=2),
    ):
        d = replan(cands, model, saved=SAVED, why="w", fixed=fixed)
        assert d is not None and fixed.admits(d.plan), (fixed, d.plan)
        assert all(fixed.admits(c.plan) for c in d.candidates)
        assert fixed.describe() in d.reason
    assert replan(cands, model, saved=SAVED, why="w", fixed=FixedDegrees(tp=4)) is None  # 6 heads


def test_batch_that_cannot_run_falls_back_to_the_closest():
    saved = ParallelPlan(dp=1, tp=1, pp=1, micro_batch_size=3, num_microbatches=3)  # B = 9
    cands = _cands(2, lo=4, hi=64, sizes=(2,))  # B even
    pool, b = batch_pool(cands, np.ones(len(cands), bool), 9)
    assert b == 10 and set(cands.global_batch_size[pool]) == {10}  # tie 8 / 10: the larger
    d = replan(cands, prior_model(SHAPE, None, 2), saved=saved, why="w")
    assert d.plan.global_batch_size == 10 and "global batch 9 impossible here, closest 10" in d.reason


def test_noise_scale_enters_the_reason_and_goodput_but_not_the_choice_at_one_batch():
    cands, model = _cands(2), prior_model(SHAPE, None, 2)
    a = replan(cands, model, saved=SAVED, why="w")
    b = replan(cands, model, saved=SAVED, why="w", b_noise=50.0)
    assert a.plan == b.plan and "b_noise=50" in b.reason and "b_noise" not in a.reason
    assert math.isnan(replan(cands, model, saved=SAVED, why="w", b_noise=math.nan).b_noise)
    assert b.candidates[0].efficiency == pytest.approx(51 / 58)  # E(B) = (b+1)/(b+B)


def test_same_layout_at_a_new_batch_split_is_a_batch_decision():
    cands = _cands(2, sizes=(4,))
    d = replan(cands, prior_model(SHAPE, None, 2), saved=SAVED, why="w", fixed=FixedDegrees(dp=2))
    assert d.kind == "batch" and d.plan == SAVED.with_batch(8, 4)


def test_admits():
    f = FixedDegrees(tp=2, micro_batch_size=4)
    plan = ParallelPlan(dp=1, tp=2, pp=1, micro_batch_size=2, num_microbatches=1)
    assert not f.admits(plan) and f.admits(plan, layout_only=True)
    assert FixedDegrees().admits(plan) and FixedDegrees().describe() == "no fixed degrees"
