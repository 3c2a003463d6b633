"""The gap to the oracle split by cause (core/sim/gap.py), and where goodput runs start."""

from dataclasses import replace

import numpy as np
import pytest

from copus.core.control.controller import make_controller
from copus.core.control.policies import PolicySettings
from copus.core.plan.plan import ParallelPlan
from copus.core.sim.gap import decompose, run_gap
from copus.core.sim.oracle import scenario_oracle_minutes
from copus.core.sim.presets import PRESETS
from copus.core.sim.compare import compare_policies
from copus.core.sim.scenario import GoodputVariant, Planner, default_policy_factory, preset_scenario
from copus.core.sim.simulator import simulate
from copus.core.sim.trajectory import LR_TUNED


def _scenario(variants=(), **sim):
    preset = PRESETS["3b-8xh100"]
    sc = preset_scenario(
        preset, seed=0, variants=variants, trajectory=preset.truth(LR_TUNED).with_(gns_calibration=2.0)
    )
    return replace(sc, sim=replace(sc.sim, keep_records=True, step_time_noise=0.0, **sim))


class _Fixed:
    """A policy that keeps its plan."""

    def observe(self, record):
        return None


def test_parts_add_up_to_the_gap_under_the_lr_tuned_truth():
    sc = _scenario()
    planner = Planner(sc)
    last = min(sc.sim.target_losses)
    oracle_s = 60.0 * scenario_oracle_minutes(sc, planner=planner)[-1]
    for batch in (32, 128):
        plan = planner.fastest_plan(batch)
        res = simulate(_Fixed(), plan, sc.shape, planner.step_time_model, sc.sim)
        gap = run_gap(sc, res, planner)
        run_s = res.time_to_target_s[last]
        assert gap.switch_s == 0.0 and gap.steps == res.num_steps
        # exact up to the last step's overshoot of the target
        assert gap.total_s == pytest.approx(run_s - oracle_s, rel=0.02, abs=2 * res.wall_s / res.num_steps)
        assert gap.batch_s >= 0 and gap.layout_s >= 0


def test_a_batch_far_from_the_best_is_charged_to_the_batch():
    sc = _scenario()
    planner = Planner(sc)
    small = simulate(_Fixed(), planner.fastest_plan(16), sc.shape, planner.step_time_model, sc.sim)
    big = simulate(_Fixed(), planner.fastest_plan(512), sc.shape, planner.step_time_model, sc.sim)
    # B = 512 is far too large while the critical batch is small: most of its gap is batch
    g = run_gap(sc, big, planner)
    assert g.batch_s > g.layout_s
    assert g.total_s > run_gap(sc, small, planner).total_s * 0.5


def test_switch_costs_after_the_stop_are_not_counted_and_bad_plans_fail():
    sc = _scenario()
    planner = Planner(sc)
    res = simulate(_Fixed(), planner.fastest_plan(32), sc.shape, planner.step_time_model, sc.sim)
    from copus.core.plan.goodput import build_candidates

    cands = build_candidates(
        sc.world_size,
        sc.shape,
        min_batch=16,
        max_batch=sc.max_batch,
        micro_batch_sizes=sc.micro_batch_sizes,
        memory_model=planner.memory_model,
        memory_capacity_bytes=planner.memory_capacity_bytes,
    )
    step_s = np.asarray(cands.predict_step_s(planner.step_time_model), float)
    recs = res.records[:50]
    g = decompose(recs, [(10, 30.0), (49, 20.0), (60, 99.0)], sc.sim.trajectory, sc.shape.seq_len, cands, step_s)
    assert g.switch_s == 50.0 and g.steps == 50
    alien = replace(recs[0], plan=ParallelPlan(dp=3, tp=1, pp=1, micro_batch_size=1, num_microbatches=1))
    with pytest.raises(ValueError, match="not a feasible candidate"):
        decompose([alien], [], sc.sim.trajectory, sc.shape.seq_len, cands, step_s)


def test_a_planner_start_variant_starts_on_the_controllers_start_plan():
    published = GoodputVariant(name="published")
    planned = GoodputVariant(name="planned", start="planner")
    sc = _scenario(variants=(published, planned))
    sc = replace(sc, start_layout=(4, 2, 1), sim=replace(sc.sim, token_budget=2_000_000))
    cmp_ = compare_policies(sc, ("goodput",))
    planner = Planner(sc)
    chosen = default_policy_factory(sc)("goodput", planner.fastest_plan(16), planner, planned).start_plan()
    assert cmp_.run("published").timeline[0].plan.layout == (4, 2, 1)
    assert cmp_.run("planned").timeline[0].plan == chosen != cmp_.run("published").timeline[0].plan
    with pytest.raises(ValueError, match="start='x' is invalid"):
        GoodputVariant(start="x")


def test_the_controller_start_plan_is_at_the_initial_batch_and_fastest_on_request():
    preset = PRESETS["3b-8xh100"]
    sc = _scenario()
    planner = Planner(sc)
    settings = PolicySettings(initial=16, min=16, max=512)
    slow = ParallelPlan(dp=8, tp=1, pp=1, micro_batch_size=2, num_microbatches=1)

    def build(**kw):
        return make_controller(
            settings,
            slow,
            8,
            sc.shape,
            hardware=preset.hardware,
            step_time_model=planner.step_time_model,
            online_fit=False,
            **kw,
        )

    fitting = {"memory_capacity_bytes": planner.memory_capacity_bytes, "micro_batch_sizes": sc.micro_batch_sizes}
    ctrl = build(**fitting)
    start = ctrl.start_plan()  # the plan under the prior (start="plan"): some plan at B = 16
    assert start.global_batch_size == 16
    fastest = build(**fitting, planner_options={"start": "fastest"}).start_plan()
    assert fastest == planner.fastest_plan(16) and fastest != slow
    mb = 2 if start.micro_batch_size != 2 else 1
    fixed_mb = ctrl.start_plan(micro_batch_size=mb)
    assert fixed_mb.micro_batch_size == mb and fixed_mb.global_batch_size == 16
    locked = build(allow_reconfigure=False)
    assert locked.start_plan() == slow


def test_the_switch_aware_ceiling_lies_between_the_free_oracle_and_one_layout():
    from copus.core.plan.goodput import build_candidates
    from copus.core.sim.oracle import oracle_minutes, switch_aware_minutes

    sc = _scenario()
    planner = Planner(sc)
    cands = build_candidates(
        sc.world_size,
        sc.shape,
        min_batch=16,
        max_batch=sc.max_batch,
        micro_batch_sizes=sc.micro_batch_sizes,
        memory_model=planner.memory_model,
        memory_capacity_bytes=planner.memory_capacity_bytes,
    )
    step_s = np.asarray(cands.predict_step_s(planner.step_time_model), float)
    ok = np.isfinite(step_s) & (step_s > 0)
    b, t = cands.global_batch_size[ok], step_s[ok]
    ids = (cands.dp * 10_000 + cands.tp * 100 + cands.pp)[ok]
    targets, truth, seq = sc.sim.target_losses, sc.sim.trajectory, sc.shape.seq_len
    free = oracle_minutes(truth, seq, b, t, targets)
    zero = switch_aware_minutes(truth, seq, b, t, ids, targets, 0.0)
    paid = switch_aware_minutes(truth, seq, b, t, ids, targets, 38.0)
    never = switch_aware_minutes(truth, seq, b, t, ids, targets, 1e12)
    single = min(
        (switch_aware_minutes(truth, seq, b[ids == i], t[ids == i], ids[ids == i], targets, 0.0)[-1], i)
        for i in np.unique(ids)
    )
    assert zero == pytest.approx(free, rel=0.005)  # the programme = the greedy oracle
    assert all(z <= p + 1e-9 <= n + 1e-9 for z, p, n in zip(zero, paid, never))
    assert paid[-1] > zero[-1] + 0.3  # 3B switches cost ≥ 0.3 min here
    assert never[-1] == pytest.approx(single[0], rel=1e-6)  # no switch: the best one layout


def test_grid_cells_carry_the_switch_aware_capture():
    from copus.core.sim import truth_grid as tg

    cell = tg.Cell("p", "lr-tuned", 2.0)
    runs = [{"seed": s, "oracle_avg": 8.0, "switch_aware_avg": 6.0, "variants": {"g": 3.0}} for s in (0, 1)]
    out = tg.summarise_cell(cell, runs)
    assert out["switch_aware_oracle_avg_pct"] == 6.0
    assert out["variants"]["g"]["capture"] == pytest.approx(3 / 8)
    assert out["variants"]["g"]["capture_switch_aware"] == pytest.approx(0.5)
    assert tg.goals([out], "g")["median_capture_switch_aware"] == pytest.approx(0.5)
