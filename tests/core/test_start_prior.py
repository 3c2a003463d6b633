"""The prior the planning controller picks its start layout by (core/control/start_prior.py;
docs/robust-goodput.md §6.16)."""

import argparse
import math

import pytest

from copus.commands.simulate import _preset
from copus.core.control import start_prior
from copus.core.sim.presets import get_preset
from copus.core.sim.scenario import Planner, default_policy_factory


def test_the_prior_critical_batch_grows_as_kaplans_data_law_says():
    # B_crit ∝ L^(-1/0.21), L ∝ D^(-0.095): ×10 tokens -> ×10^0.452 critical batch
    lo, hi = start_prior.prior_critical_batch(1_000, 2048), start_prior.prior_critical_batch(10_000, 2048)
    assert math.log10(hi / lo) == pytest.approx(0.095 / 0.21, abs=1e-9)
    # 16 sequences of 2048 tokens: L = (5.4e13 / 32768)^0.095 ≈ 7.5 nats, B_crit ≈ 6.6 sequences
    assert start_prior.prior_critical_batch(16, 2048) == pytest.approx(6.6, rel=0.02)
    assert start_prior.prior_critical_batch(1, 131_072) == 1.0  # never below one sequence


def test_the_level_hypotheses_are_equal_mass_quantiles_two_octaves_wide():
    m, w = start_prior.level_hypotheses(5)
    assert sum(w) == pytest.approx(1.0) and m[2] == pytest.approx(1.0)
    assert math.log2(m[4]) == pytest.approx(-math.log2(m[0])) == pytest.approx(2.0 * 1.2816, rel=1e-3)
    assert start_prior.level_hypotheses(1) == ([1.0], [1.0])


def _controller(preset: str, truth: str, start: str):
    args = argparse.Namespace(truth="fitted", crit_ratio=None, seed=0, reconfig="online", no_lr_aware=False)
    sc = _preset(get_preset(preset), args, truth, 1.0, 0)
    planner = Planner(sc)
    variant = [v for v in sc.variants() if v.name == "goodput"][0]
    ctl = default_policy_factory(sc)("goodput", planner.fastest_plan(sc.initial_batch), planner, variant)
    ctl.start = start
    return ctl, planner, sc


def test_3b_starts_on_the_layout_its_growing_batch_needs_not_the_fastest_at_b0():
    # the 3B preset: dp2.tp2.pp2 is the fastest at B = 16, dp4.tp2 2 % slower there and faster
    # from B ≈ 32 on; the honest ceiling (which knows the truth) starts on dp4.tp2 too
    ctl, planner, sc = _controller("3b-8xh100", "lr-tuned", "plan")
    planned = ctl.start_plan()
    fastest = planner.fastest_plan(sc.initial_batch)
    assert fastest.layout == (2, 2, 2)
    assert planned.layout == (4, 2, 1) and planned.global_batch_size == sc.initial_batch
    ctl.start = "fastest"
    assert ctl.start_plan() == fastest


def test_a_preset_whose_fastest_start_is_also_the_plans_keeps_it():
    ctl, planner, sc = _controller("32b-32xh100", "lr-tuned", "plan")
    assert ctl.start_plan().layout == planner.fastest_plan(sc.initial_batch).layout == (2, 2, 8)


def test_an_unknown_start_is_refused():
    from copus.core.control.planner import PlanningController

    with pytest.raises(ValueError, match="start='x' is invalid; allowed: plan, fastest"):
        PlanningController.__init__(object.__new__(PlanningController), start="x")
