"""The planning controller (`batch.policy = "goodput"`, core/control/planner.py): the forecast, the
plan over the rest of the run, the record of refused moves, exploration by value, state."""

import json
import math

import numpy as np
import pytest

from copus.core.control.controller import make_controller
from copus.core.control import experiments as experiments_module
from copus.core.control.planner import PlanningController
from copus.core.control.policies import PolicySettings
from copus.core.cost.throughput import StepTimeModel
from copus.core.plan.plan import ParallelPlan, plan_problems
from copus.core.plan.records import StepRecord
from copus.core.specs.resolve import get_model_shape

SHAPE = get_model_shape("llama-3.2-3b")
HW = "h100-nvlink-pairs"
INIT = ParallelPlan(dp=2, tp=1, pp=4, micro_batch_size=1, num_microbatches=8)  # COPUS 3B start
SETTINGS = PolicySettings(initial=16, min=16, max=512, interval_steps=10, warmup_steps=10, calibration=2.0)
TRUE = StepTimeModel.analytic(SHAPE, HW, 8)
SEQ = SHAPE.seq_len


def _planner(**kw) -> PlanningController:
    kw.setdefault("hardware", HW)
    kw.setdefault("memory_capacity_bytes", 80e9)
    kw.setdefault("step_time_model", _Fixed())
    kw.setdefault("reconfig_cost_s", 30.0)
    return make_controller(kw.pop("settings", SETTINGS), INIT, 8, SHAPE, **kw)


class _Fixed:
    """The analytic model as a fixed predictor (no online fit)."""

    def predict(self, *args):
        return TRUE.predict(*args)


def _drive(
    ctrl,
    steps,
    *,
    bcrit=lambda e: 5.0 + e**0.7,
    seed=0,
    start=None,
    plan=INIT,
    switch_cost_s=30.0,
    gns_noise=0.2,
    c=2.0,
    after=None,
    loss=lambda e: 1.0,
    phi_scale=lambda step: 1.0,
):
    """A synthetic run whose noise scale φ = B_crit(E)/c grows with its effective samples E
    (ΔE = B·B_crit/(B_crit + B)); returns (decisions, plan, state) to continue from.
    `after(record, decision)`: called after every step (decision None when none); `loss(E)`:
    the reported loss; `phi_scale(step)`: a factor on the reported φ (e.g. low in an LR warm-up)."""
    rng = np.random.default_rng(seed)
    step, samples, e = start or (0, 0, 0.0)
    out = []
    for _ in range(steps):
        step += 1
        b = plan.global_batch_size
        samples += b
        bc = bcrit(e)
        e += b * bc / (bc + b)
        t = TRUE.predict_plan(plan) * (1 + 0.03 * rng.standard_normal())
        rec = StepRecord(
            step=step,
            samples=samples,
            tokens=samples * SEQ,
            plan=plan,
            step_s=t,
            loss=loss(e),
            b_noise=bcrit(e) / c * phi_scale(step) * math.exp(gns_noise * rng.standard_normal()),
            b_noise_rel_err=0.1,
        )
        d = ctrl.observe(rec)
        if after is not None:
            after(rec, d)
        if d is not None:
            out.append(d)
            if d.kind == "reconfigure":
                ctrl.record_switch_cost(switch_cost_s)
            plan = d.plan
    return out, plan, (step, samples, e)


def test_goodput_is_the_planner_and_goodput_copus_is_not():
    assert isinstance(_planner(), PlanningController)
    assert not isinstance(_planner(policy="goodput-copus"), PlanningController)


def test_each_decision_point_records_the_plan_and_the_best_moves_refused():
    ctrl = _planner(horizon_tokens=200_000 * SEQ)
    decisions, plan, _ = _drive(ctrl, 400)
    rows = [r for r in ctrl.drain_events() if r["event"] == "considered"]
    assert len(rows) == 40  # steps 10, 20, ..., 400
    assert decisions and plan.global_batch_size > 16  # the batch grew with φ
    for d in decisions:
        assert not plan_problems(d.plan, 8, SHAPE) and 16 <= d.plan.global_batch_size <= 512
        assert d.purpose == "decide" and d.reason.startswith("plan: take ")
    for r in rows:
        layout = [x for x in r["refused"] if x["move"] == "layout"]
        batch = [x for x in r["refused"] if x["move"].startswith("batch")]
        assert layout and batch
        # a refused layout saved less over the rest of the run than the switch it needed
        assert layout[0]["gain_s"] <= layout[0]["needs_s"] + 1e-6
        assert "needs" in layout[0]["why"] and layout[0]["plan"]
        assert all(x["gain_pct"] <= 1e-9 for x in batch)  # the chosen batch is the best
        assert r["expected_s"] > 0 and len(r["c"]) == 1 and r["slope"][0] >= 0
    json.dumps(rows)  # JSON-able


def test_a_switch_is_taken_only_where_the_rest_of_the_run_repays_it():
    grow = dict(bcrit=lambda e: 5.0 + 2.0 * e**0.8)
    long_run, _, _ = _drive(_planner(horizon_tokens=2e6 * SEQ), 300, **grow)
    assert any(d.kind == "reconfigure" for d in long_run)
    dear, _, _ = _drive(_planner(horizon_tokens=2e6 * SEQ, reconfig_cost_s=1e7), 300, **grow)
    assert dear and all(d.kind == "batch" for d in dear)
    locked, _, _ = _drive(_planner(horizon_tokens=2e6 * SEQ, allow_reconfigure=False), 300, **grow)
    assert locked and all(d.plan.layout == INIT.layout for d in locked)
    # the same run about to end: the switch would not be repaid before it does
    ending, _, _ = _drive(_planner(horizon_tokens=1.0), 300, **grow)
    first_switch = [d.step for d in long_run if d.kind == "reconfigure"][0]
    assert all(d.kind == "batch" for d in ending if d.step <= first_switch + 10)


@pytest.mark.parametrize("slope", [0.4, 0.8])
def test_the_forecast_reads_the_growth_of_the_noise_scale(slope):
    ctrl = _planner(settings=PolicySettings(initial=16, min=16, max=16, calibration=2.0))
    _drive(ctrl, 600, bcrit=lambda e: 2.0 * (1.0 + e) ** slope, gns_noise=0.05)
    e_now, phi_now, beta = ctrl.forecast(np.array([2.0]))
    assert beta[0] == pytest.approx(slope, abs=0.12)
    assert phi_now[0] == pytest.approx((1.0 + e_now[0]) ** slope, rel=0.25)
    flat = _planner(settings=PolicySettings(initial=16, min=16, max=16, calibration=2.0))
    _drive(flat, 600, bcrit=lambda e: 40.0, gns_noise=0.05)
    assert flat.forecast(np.array([2.0]))[2][0] < 0.15  # no growth read, the prior overruled


def test_the_posterior_over_c_enters_as_equal_mass_quantiles():
    auto = PolicySettings(initial=16, min=16, max=512, calibration=4.0, calibration_mode="auto")
    ctrl = _planner(settings=auto)
    cs, w = ctrl.c_hypotheses()
    assert len(cs) == 5 and w.sum() == pytest.approx(1.0) and np.all(np.diff(cs) > 0)
    assert cs[2] == pytest.approx(4.0, rel=0.05)  # the prior median


def test_probes_a_layout_only_when_measuring_it_is_worth_its_cost():
    grow = dict(bcrit=lambda e: 5.0 + 2.0 * e**0.8)
    online = dict(step_time_model=None, horizon_tokens=2e6 * SEQ)
    cheap, _, _ = _drive(_planner(reconfig_cost_s=0.5, **online), 60, switch_cost_s=0.5, **grow)
    probes = [d for d in cheap if d.purpose == "probe"]
    assert probes and "value of measuring it" in probes[0].reason
    dear, _, _ = _drive(_planner(reconfig_cost_s=1e6, **online), 60, switch_cost_s=1e6, **grow)
    assert not [d for d in dear if d.purpose == "probe"]
    off, _, _ = _drive(
        _planner(reconfig_cost_s=0.5, planner_options={"explore": False}, **online), 60, switch_cost_s=0.5, **grow
    )
    assert not [d for d in off if d.purpose == "probe"]


def test_a_probe_runs_at_the_batch_the_plan_chose():
    """A probe measures a layout; it takes the batch the plan chose on the current layout (which
    respects the ladder and the floor), never a batch the plan refused (§6.21)."""
    grow = dict(bcrit=lambda e: 5.0 + 2.0 * e**0.8)
    ctrl = _planner(reconfig_cost_s=0.5, step_time_model=None, horizon_tokens=2e6 * SEQ)
    decisions, _, _ = _drive(ctrl, 120, switch_cost_s=0.5, **grow)
    chosen = {r["step"]: r["global_batch_size"] for r in ctrl.drain_events() if r["event"] == "considered"}
    probes = [d for d in decisions if d.purpose == "probe"]
    assert probes
    for d in probes:
        assert d.plan.global_batch_size == chosen[d.step], (d.step, d.plan.describe(), chosen[d.step])


def test_state_round_trip_gives_identical_decisions():
    a = _planner(horizon_tokens=2e6 * SEQ, step_time_model=None)
    _, plan, at = _drive(a, 55, seed=3)
    state = json.loads(json.dumps(a.state_dict()))
    b = _planner(horizon_tokens=2e6 * SEQ, step_time_model=None)
    b.load_state_dict(state)
    rest_a, _, _ = _drive(a, 150, seed=4, start=at, plan=plan)
    rest_b, _, _ = _drive(b, 150, seed=4, start=at, plan=plan)
    assert rest_a and [d.to_dict() for d in rest_a] == [d.to_dict() for d in rest_b]
    assert a.state_dict() == b.state_dict()


def test_bad_planner_options_are_one_line_errors():
    with pytest.raises(ValueError, match="c_points=0"):
        _planner(planner_options={"c_points": 0})


def test_copus_report_shows_the_moves_weighed_and_refused(tmp_path):
    from copus.reporting.report import write_report
    from copus.reporting.runs import load_run

    ctrl = _planner(horizon_tokens=200_000 * SEQ)
    _drive(ctrl, 120)
    rows = [r for r in ctrl.drain_events() if r["event"] == "considered"]
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.toml").write_text('[batch]\npolicy = "goodput"\n')
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                dict(
                    step=s,
                    samples=16 * s,
                    tokens=16 * SEQ * s,
                    wall_s=float(s),
                    loss=3.0,
                    global_batch_size=16,
                    dp=2,
                    tp=1,
                    pp=4,
                    b_noise=5.0,
                    tokens_per_s=1000.0,
                )
            )
            + "\n"
            for s in range(1, 121)
        )
    )
    (run / "decisions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = write_report([load_run(run)], tmp_path / "out", []).read_text()
    assert "## Moves weighed by r" in md
    first = rows[0]
    lay = next(x for x in first["refused"] if x["move"] == "layout")
    assert (
        f"| {first['step']} | {first['chosen']} | {first['expected_s']:.0f} | {lay['plan']} "
        f"| {lay['gain_s']:.1f} | {lay['needs_s']:.1f} |"
    ) in md
    assert md.count("\n| ") >= len(rows)  # one table row per decision point


def test_measured_step_times_are_shrunk_toward_the_model_by_their_precision():
    ctrl = _planner(step_time_model=None, allow_reconfigure=False)
    model_s = float(ctrl.model.predict_plan(INIT))
    rng = np.random.default_rng(0)
    for _ in range(4):  # a few noisy steps at twice the model's time
        ctrl.fitter.observe(INIT, 2.0 * model_s * math.exp(0.3 * rng.standard_normal()))
    few = _predicted(ctrl)
    assert model_s < few < 2.0 * model_s * 1.3
    for _ in range(28):  # many quiet ones: the measurement dominates
        ctrl.fitter.observe(INIT, 2.0 * model_s * (1 + 0.01 * rng.standard_normal()))
    many = _predicted(ctrl)
    assert abs(many / (2.0 * model_s) - 1) < abs(few / (2.0 * model_s) - 1)
    assert many == pytest.approx(2.0 * model_s, rel=0.1)


def _predicted(ctrl) -> float:
    """The planner's step time of INIT (its decision model, over the candidates)."""
    return float(ctrl.predicted_step_s()[ctrl.candidates.index_of(INIT)])


def _narrow(ctrl, c: float) -> None:
    """Evidence that pins c: the posterior's mass on the grid point nearest `c`."""
    post = ctrl.posterior
    z = (post.log2_grid - math.log2(c)) / 0.1
    post.log_post = np.broadcast_to(-0.5 * z * z, post.log_post.shape).copy()
    ctrl.calibration = post.value()


def test_the_batch_moves_by_sqrt2_rungs_while_the_posterior_over_c_is_wide():
    ctrl = _planner(settings=PolicySettings(initial=16, min=16, max=512, calibration=4.0, calibration_mode="auto"))
    assert ctrl.posterior.interval_ratio() > 8.0 and ctrl.ladder_steps() == 2  # the prior: wide
    moves, _, _ = _drive(ctrl, 150, c=4.0)  # (before the first experiment's window closes)
    batches = [d.plan.global_batch_size for d in moves]
    assert len(batches) >= 2 and batches == sorted(batches), batches
    for b in batches:  # each on a rung 16·2^(k/2) (the nearest batch a layout can host)
        k = 2 * math.log2(b / 16)
        assert abs(k - round(k)) < 0.35, batches
    _narrow(ctrl, 4.0)
    assert ctrl.posterior.interval_ratio() < 8.0 and ctrl.ladder_steps() == 0  # known: any batch


def test_while_c_is_wide_the_batch_moves_one_doubling_per_experiment():
    """While the posterior over c is wide, every batch move stays within 2x of the batch before
    the calibration window being read (the plan, deciding every 10 steps, does not climb several
    rungs on the prior before the first ≈ 70-step window is read), and the move that opens a
    window is itself at most a doubling (it jumped 8 -> 32 on the prior in the CPU runs);
    once the window has closed, the next doubling."""
    growth = lambda e: 5.0 + 20.0 * e**0.7  # noqa: E731  B_crit far above the start: wants to grow fast
    ctrl = _planner(settings=PolicySettings(initial=16, min=16, max=512, calibration=4.0, calibration_mode="auto"))
    seen = []  # (batch before the window, batch chosen, window open) at each batch move while wide

    def note(rec, d):
        post = ctrl.posterior
        if d is not None and d.plan.global_batch_size != rec.plan.global_batch_size:
            if post.interval_ratio() > 8.0:
                seen.append((ctrl.window_base, d.plan.global_batch_size, post.window_open))

    moves, plan, _ = _drive(ctrl, 300, bcrit=growth, c=4.0, after=note)
    assert plan.global_batch_size >= 64, [d.plan.global_batch_size for d in moves]  # it does grow
    assert len(seen) >= 2, [d.plan.global_batch_size for d in moves]
    assert all(b <= 2 * base and b >= base / 2 for base, b, _ in seen), seen


def test_a_noise_scale_reading_alone_never_shrinks_the_batch():
    """With c fixed, no reading of φ (a gradient spike moves the online φ for many steps) makes
    the plan shrink; with c learnt, only evidence that c is small does (the shrink is right
    even at the posterior's 95 % quantile)."""
    ctrl = _planner()  # c fixed
    _, plan, state = _drive(ctrl, 200, c=2.0)
    big = plan.global_batch_size
    assert big > 16
    drop = lambda e: 0.05  # noqa: E731  the signal spike: φ collapses 100x
    moves, plan, _ = _drive(ctrl, 100, bcrit=drop, start=state, plan=plan)
    assert all(d.plan.global_batch_size >= big for d in moves) and plan.global_batch_size >= big

    auto = PolicySettings(initial=16, min=16, max=512, calibration=4.0, calibration_mode="auto")
    ctrl = _planner(settings=auto)
    _, plan, state = _drive(ctrl, 200, c=4.0)
    big = plan.global_batch_size
    step_s = ctrl.predicted_step_s()
    now = ctrl.forecast(ctrl.c_hypotheses()[0])[1]
    # wide: the spike's reading changes nothing (the floor is the recent stretches' φ at the
    # posterior's 95 % quantile), and keeps the batch up to the ladder's rounding
    assert ctrl.floor_batch(np.array([0.05]), step_s) == ctrl.floor_batch(now, step_s) >= 0.9 * big
    _narrow(ctrl, 1.0 / 16)  # the evidence: c is 64x below its prior
    assert ctrl.floor_batch(np.array([0.05]), ctrl.predicted_step_s()) < big


def _profile_of(ctrl, slower: float = 1.0) -> list[tuple[ParallelPlan, float]]:
    """A `copus profile` table: one plan of every layout at each of the first batches, timed by
    the truth (× `slower` for every plan but INIT's layout)."""
    c, rows = ctrl.candidates, {}
    for i in range(len(c)):
        p = c.plan(i)
        if p.global_batch_size <= 64 and (p.layout, p.global_batch_size) not in rows:
            rows[(p.layout, p.global_batch_size)] = (
                p,
                float(TRUE.predict_plan(p)) * (1 if p.layout == INIT.layout else slower),
            )
    rows[(INIT.layout, 16)] = (INIT, float(TRUE.predict_plan(INIT)))
    return list(rows.values())


def test_with_a_profile_no_profiled_layout_is_probed():
    grow = dict(bcrit=lambda e: 5.0 + 2.0 * e**0.8)
    online = dict(step_time_model=None, horizon_tokens=2e6 * SEQ, reconfig_cost_s=0.5)
    bare, _, _ = _drive(_planner(**online), 60, switch_cost_s=0.5, **grow)
    assert [d for d in bare if d.purpose == "probe"]  # the same run without a profile probes
    profile = _profile_of(_planner(**online))
    ctrl = _planner(profile_observations=profile, **online)
    assert ctrl.profile and {p.layout for p, _ in profile} >= {
        ctrl.candidates.plan(i).layout for i in range(len(ctrl.candidates))
    }
    got, _, _ = _drive(ctrl, 60, switch_cost_s=0.5, **grow)
    assert not [d for d in got if d.purpose == "probe"]


def test_with_a_profile_the_load_scales_every_plan_alike():
    """The run's own steps, twice the profile's time (a loaded machine), set the load factor k
    but not the ranking: the profile's relative times stay; without a profile the loaded
    measurement of the current plan makes the other layouts look faster."""
    base = _planner(step_time_model=None, allow_reconfigure=False)
    profile = _profile_of(base, slower=1.1)  # every other layout 10 % slower than INIT's
    ctrl = _planner(step_time_model=None, allow_reconfigure=False, profile_observations=profile)
    other = next(p for p, _ in profile if p.layout != INIT.layout and p.global_batch_size == 16)
    for ctl in (base, ctrl):
        for _ in range(12):
            ctl.fitter.observe(INIT, 2.0 * float(TRUE.predict_plan(INIT)))
    s = ctrl.predicted_step_s()
    i, j = ctrl.candidates.index_of(INIT), ctrl.candidates.index_of(other)
    assert ctrl.load_factor() == pytest.approx(2.0)
    assert s[j] / s[i] == pytest.approx(1.1 * float(TRUE.predict_plan(other) / TRUE.predict_plan(INIT)))
    sb = base.predicted_step_s()
    assert sb[j] / sb[i] < s[j] / s[i]


def _noisy_power_law(seed: int = 1):
    """A power law in E with the per-step loss noise of B = 16 sequences (σ ≈ 2.1/sqrt(tokens))."""
    rng = np.random.default_rng(seed)
    return lambda e: 2.0 + 9.0 * (1.0 + e / 50.0) ** -0.24 + 0.012 * rng.standard_normal()


def test_an_upward_experiment_is_taken_when_its_value_of_information_exceeds_its_cost(monkeypatch):
    """c far above the prior (the truth 32, the prior median 4) and B ≪ cφ: the expected-rate
    rule keeps B = 16; the hypotheses disagree on E(B_x)/E(16) for a larger B_x, the plan under
    the posterior would lose a lot of time if c were large, and a window at B_x costs a few
    seconds: the plan takes the larger batch as an experiment (docs/robust-goodput.md §6.9),
    only once the noise-scale EMA's warm-up lies behind the window's pre-change steps, and
    holds it until the window has been read."""

    monkeypatch.setattr(experiments_module, "DITHER_HALF_STEPS", 0)  # the batch held, as measured then (§6.33)

    auto = PolicySettings(initial=16, min=16, max=512, calibration=4.0, calibration_mode="auto")
    flat = lambda e: 40.0  # noqa: E731
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(experiments_module, "EXPERIMENTS", on)
        curve = _noisy_power_law()
        ctrl = _planner(settings=auto, horizon_tokens=4e9)
        runs[on] = (ctrl, _drive(ctrl, 170, c=32.0, bcrit=flat, loss=curve)[0])
    assert runs[False][1] == []  # the expected-rate rule alone: no move
    ctrl, moves = runs[True]
    assert [d.step for d in moves] == [120], [(d.step, d.plan.global_batch_size) for d in moves]
    assert 16 < moves[0].plan.global_batch_size <= 32 and "experiment" in moves[0].reason
    row = next(e for e in ctrl.events if e.get("step") == 120 and e.get("event") == "considered")
    exp = row["experiment"]
    assert exp["value_s"] > exp["cost_s"] and exp["instead_of"] == 16


def test_an_experiment_is_priced_however_narrow_the_posterior(monkeypatch):
    """docs/robust-goodput.md §6.32: a posterior 3-fold wide (the prior 0.5 octave around c = 4)
    that is wrong (the truth c = 32) is how one misread window left the held-out runs: with
    experiments priced only while the interval is wider than 8-fold (`EXPERIMENT_WIDE_RATIO`
    = `WIDE_RATIO`, before §6.32) none is taken; priced whenever no window is open, the window at
    B = 32 is worth its cost, taken at step 120 and held until read."""
    import copus.core.control.planner as planner_module

    monkeypatch.setattr(experiments_module, "DITHER_HALF_STEPS", 0)  # the batch held, as measured then (§6.33)

    auto = PolicySettings(initial=16, min=16, max=512, calibration=4.0, calibration_mode="auto")
    runs = {}
    for ratio in (planner_module.WIDE_RATIO, 1.0):
        monkeypatch.setattr(experiments_module, "EXPERIMENT_WIDE_RATIO", ratio)
        ctrl = _planner(settings=auto, horizon_tokens=4e9, posterior_options={"prior_octaves": 0.5})
        assert ctrl.posterior.interval_ratio() < planner_module.WIDE_RATIO
        moves = _drive(ctrl, 170, c=32.0, bcrit=lambda e: 40.0, loss=_noisy_power_law())[0]
        runs[ratio] = [(d.step, d.plan.global_batch_size, "experiment" in d.reason) for d in moves]
    assert not any(x for _, _, x in runs[planner_module.WIDE_RATIO]), runs
    assert runs[1.0] == [(120, 32, True)], runs


def test_after_an_experiment_is_read_the_batch_may_return_to_the_batch_before_it(monkeypatch):
    """docs/robust-goodput.md §6.28: an experiment is a measurement, not a commitment. The truth
    B_crit = 20 (c = 16 on the reported φ): a window at B = 32 (the experiment at step 120) tells
    that B = 16 has the higher expected rate; once it is read the plan goes back to 16. Without
    the return the experiment's batch is the floor (a smaller batch only where it is best at the
    posterior's 95 % quantile of c) and the run stays at 32. The pending return survives a
    checkpoint. (Experiments priced only while the posterior is wide, as in §6.28: once this one
    is read the posterior is narrow, and §6.32's later experiments would start a second window.)"""
    import copus.core.control.planner as planner_module

    monkeypatch.setattr(experiments_module, "DITHER_HALF_STEPS", 0)  # the batch held, as measured then (§6.33)

    auto = PolicySettings(initial=16, min=16, max=512, calibration=4.0, calibration_mode="auto")
    monkeypatch.setattr(experiments_module, "EXPERIMENTS", True)
    monkeypatch.setattr(experiments_module, "EXPERIMENT_WIDE_RATIO", planner_module.WIDE_RATIO)
    runs = {}
    for back in (False, True):
        monkeypatch.setattr(experiments_module, "RETURN_AFTER_EXPERIMENT", back)
        curve = _noisy_power_law()
        ctrl = _planner(settings=auto, horizon_tokens=4e9)
        moves, _, _ = _drive(ctrl, 400, c=16.0, bcrit=lambda e: 20.0, loss=curve)
        runs[back] = (ctrl, [(d.step, d.plan.global_batch_size) for d in moves])
    assert runs[False][1] == [(120, 32)]  # the experiment's batch became the floor
    assert runs[False][0].experiment_from == 16.0
    ctrl, moves = runs[True]
    assert moves[0] == (120, 32) and moves[1][1] == 16 and moves[1][0] > 120, moves
    assert ctrl.experiment_from is None  # the return was the plan's own move
    held = runs[False][0]
    twin = _planner(settings=auto, horizon_tokens=4e9)
    twin.load_state_dict(json.loads(json.dumps(held.state_dict())))
    assert twin.experiment_from == 16.0


def test_an_experiment_is_repeated_only_once_the_noise_scale_has_grown(monkeypatch):
    """docs/robust-goodput.md §6.28: at the same cφ/B a second window at the same pair of batches
    would read what the first read; on the long pre-training truth, where cφ ≪ B, the VoI priced
    the same experiment again and again (51–132 round trips 256 → 512 → 256). With
    `REPEAT_PHI_GROWTH` = 2 the pair is taken again only once φ has doubled (0, the default: any
    time); the record survives a checkpoint."""

    auto = PolicySettings(initial=16, min=16, max=512, calibration=4.0, calibration_mode="auto")
    monkeypatch.setattr(experiments_module, "REPEAT_PHI_GROWTH", 2.0)
    ctrl = _planner(settings=auto, horizon_tokens=4e9)
    ctrl.experiment_phi["16>32"] = 1.0
    for phi, again in ((1.0, False), (1.9, False), (2.0, True)):
        ctrl.chunks = [[16.0, 10.0, 10.0 * phi, 10.0, 1.0]]  # [batch, steps, Σφ, steps with φ, first step]
        assert ctrl._may_repeat(16.0, 32.0) is again, phi
    assert ctrl._may_repeat(16.0, 22.0)  # another pair: never taken
    monkeypatch.setattr(experiments_module, "REPEAT_PHI_GROWTH", 0.0)
    ctrl.chunks = [[16.0, 10.0, 10.0, 10.0, 1.0]]
    assert ctrl._may_repeat(16.0, 32.0)  # 0: any time (as measured before the rule)
    twin = _planner(settings=auto, horizon_tokens=4e9)
    twin.load_state_dict(json.loads(json.dumps(ctrl.state_dict())))
    assert twin.experiment_phi == {"16>32": 1.0}


def test_under_the_sqrt_lr_rule_the_rates_carry_its_overshoot_factor(monkeypatch):
    """docs/robust-goodput.md §6.14: told the run scales the LR by sqrt(B/B_ref), the plan's rate
    at batch B is ΔE·(2x − x²)/step_s under the posterior's x0 rows; all mass on the LR re-tuned
    row (or lr_rule "none"): the factor is 1."""
    auto = PolicySettings(
        initial=16, min=16, max=512, interval_steps=10, warmup_steps=10, calibration=2.0, calibration_mode="auto"
    )
    import copus.core.control.controller as controller_module

    off = _planner(settings=auto, lr_rule="sqrt")
    assert not off.posterior.lr_fractions  # off by default: no x0 rows, factor 1
    monkeypatch.setattr(controller_module, "LR_RULE_FACTOR", True)
    sqrt_rule = _planner(settings=auto, lr_rule="sqrt")
    plain = _planner(settings=auto, lr_rule="none")
    post = sqrt_rule.posterior
    assert post.lr_fractions and post.lr_ref_batch == 16.0
    k = len(post.lr_exponents) + len(post.lr_fractions) - 1
    post.log_post[:] = -1e9
    post.log_post[k] = 0.0  # the largest x0 hypothesis
    step_s = sqrt_rule.predicted_step_s()
    b = sqrt_rule.candidates.global_batch_size.astype(float)
    r_sqrt, r_plain = sqrt_rule.rates(np.array([100.0]), step_s)[0], plain.rates(np.array([100.0]), step_s)[0]
    x0 = post.lr_fractions[-1]
    x = np.maximum(x0 * np.sqrt(b / 16.0) * np.sqrt((1.0 + 100.0 / b) / 7.25), 1.0)  # overshoot only
    ok = r_plain > 0
    np.testing.assert_allclose(r_sqrt[ok], r_plain[ok] * np.maximum(2 * x - x * x, 0.0)[ok], rtol=1e-9, atol=1e-12)
    big = ok & (b >= 256)
    assert big.any() and np.all(r_sqrt[big] < 0.8 * r_plain[big])  # past the optimum: less progress
    post.log_post[:] = -1e9
    post.log_post[0] = 0.0  # the LR re-tuned for every B: no factor
    np.testing.assert_allclose(sqrt_rule.rates(np.array([100.0]), step_s), plain.rates(np.array([100.0]), step_s))


def test_with_the_sqrt_rule_rows_each_hypothesis_of_c_keeps_its_own_lr_factor(monkeypatch):
    """docs/robust-goodput.md §6.35: with the x0 rows on, the plan's hypotheses are quantiles of c
    within each row of the posterior, each priced with its own row's factor: the LR re-tuned row
    at c = 8 gets factor 1, the x0 = 0.3 row at c = 1 gets 2x − x² at its own c. The marginal
    variant (`LR_JOINT` False) mixes the rows' c and prices every one with the mean factor."""
    import copus.core.control.controller as controller_module
    import copus.core.control.planner as planner_module
    from copus.core.stats.lr_progress import sqrt_rule_factor

    monkeypatch.setattr(controller_module, "LR_RULE_FACTOR", True)
    monkeypatch.setattr(controller_module, "LR_OVERSHOOT_ONLY", False)
    auto = PolicySettings(
        initial=16, min=16, max=512, interval_steps=10, warmup_steps=10, calibration=2.0, calibration_mode="auto"
    )
    ctrl = _planner(settings=auto, lr_rule="sqrt")
    post = ctrl.posterior
    n_exp, grid = len(post.lr_exponents), post.log2_grid
    post.log_post[:] = -1e9
    post.log_post[0, :, int(np.argmin(np.abs(grid - 3.0)))] = 0.0  # re-tuned LR, c = 8
    post.log_post[n_exp, :, int(np.argmin(np.abs(grid - 0.0)))] = 0.0  # x0 = lr_fractions[0], c = 1
    cs, w = ctrl.c_hypotheses()
    x0 = ctrl.hypothesis_x0
    tuned = np.isnan(x0)
    assert tuned.sum() == (~tuned).sum() == ctrl.c_points  # 2·c_points in all, by the rows' mass
    np.testing.assert_allclose(w.sum(), 1.0)
    np.testing.assert_allclose(cs[tuned], 8.0, rtol=0.2)  # a grid point spread over its cell
    np.testing.assert_allclose(cs[~tuned], 1.0, rtol=0.2)
    assert np.all(x0[~tuned] == post.lr_fractions[0])
    step_s = ctrl.predicted_step_s()
    bc = cs * 5.0
    plain = _planner(settings=auto, lr_rule="none").rates(bc, step_s)
    r = ctrl.rates(bc, step_s)
    b = ctrl.candidates.global_batch_size.astype(float)
    ok = plain[0] > 0
    np.testing.assert_allclose(r[tuned][:, ok], plain[tuned][:, ok], rtol=1e-12)
    f = sqrt_rule_factor(b[None, :], bc[~tuned][:, None], post.lr_fractions[0], 16.0, post.lr_opt_exponent)
    np.testing.assert_allclose(r[~tuned][:, ok], (plain[~tuned] * f)[:, ok], rtol=1e-9)
    monkeypatch.setattr(planner_module, "LR_JOINT", False)
    cs_m, _ = ctrl.c_hypotheses()
    assert ctrl.hypothesis_x0 is None and len(cs_m) == ctrl.c_points
    r_m = ctrl.rates(cs_m * 5.0, step_s)
    assert not np.allclose(r_m[-1][ok], _planner(settings=auto, lr_rule="none").rates(cs_m * 5.0, step_s)[-1][ok])


def test_no_decision_is_taken_and_no_stretch_fitted_during_the_lr_warmup(monkeypatch):
    import copus.core.control.planner as planner_module

    monkeypatch.setattr(planner_module, "WARMUP_HOLD", "all")
    warm = 150 * 16 * SEQ  # the first 150 steps at B = 16
    grow = dict(bcrit=lambda e: 5.0 + 2.0 * e**0.8)
    why = []
    ctrl = _planner(horizon_tokens=2e6 * SEQ, lr_warmup_tokens=warm)
    decisions, _, _ = _drive(ctrl, 300, after=lambda rec, d: why.append((rec.tokens, ctrl.last_explanation)), **grow)
    rows = [e for e in ctrl.events if e.get("event") == "considered"]
    assert rows and min(r["tokens"] for r in rows) >= warm
    assert decisions and all(d.step >= 150 for d in decisions)
    assert any("LR warm-up" in w["why"] for t, w in why if t < warm and w)
    # the same run without a warm-up decides inside those first 150 steps
    free = _planner(horizon_tokens=2e6 * SEQ)
    _drive(free, 300, **grow)
    assert min(e["tokens"] for e in free.events if e.get("event") == "considered") < warm
    # a noise scale read while the LR ramps (100x low) is left out of the forecast: 50 steps
    # past the warm-up the forecast φ is the run's, not a tenth of it
    low = dict(phi_scale=lambda step: 0.01 if step <= 150 else 1.0, gns_noise=0.05, **grow)
    phi = []
    for w in (warm, 0):
        c = _planner(settings=PolicySettings(initial=16, min=16, max=16, calibration=2.0), lr_warmup_tokens=w)
        _, _, (_, _, e) = _drive(c, 200, **low)
        phi.append(c.forecast(np.array([2.0]))[1][0] / ((5.0 + 2.0 * e**0.8) / 2.0))
    assert phi[0] == pytest.approx(1.0, rel=0.25) and phi[1] < 0.5


def test_by_default_only_batch_moves_are_taken_in_the_lr_warmup():
    warm = 150 * 16 * SEQ
    grow = dict(bcrit=lambda e: 5.0 + 2.0 * e**0.8)
    seen = []  # (tokens, decision) of every step
    _drive(
        _planner(horizon_tokens=2e6 * SEQ, lr_warmup_tokens=warm),
        300,
        after=lambda r, d: seen.append((r.tokens, d)),
        **grow,
    )
    early = [d for t, d in seen if d is not None and t < warm]
    late = [d for t, d in seen if d is not None and t >= warm]
    assert early and all(d.kind == "batch" and d.plan.layout == INIT.layout for d in early)
    assert any(d.kind == "reconfigure" for d in late)


def test_an_experiment_is_not_taken_where_its_window_cannot_tell_the_hypotheses_apart(monkeypatch):
    """docs/robust-goodput.md §6.29: the first experiment test's scenario with a loss 17× noisier
    per step. Its window would separate the plan's most distant hypotheses of c by less than
    `MIN_SEPARATION` standard deviations: with the floor no experiment is taken (a reading that
    weak is the fit's misspecification, not c); without it (0) the stakes of a wide posterior
    still price the window above its cost, and it is taken as in the quiet run."""

    monkeypatch.setattr(experiments_module, "DITHER_HALF_STEPS", 0)  # the batch held, as measured then (§6.33)

    auto = PolicySettings(initial=16, min=16, max=512, calibration=4.0, calibration_mode="auto")
    monkeypatch.setattr(experiments_module, "EXPERIMENTS", True)
    default = experiments_module.MIN_SEPARATION
    assert default > 0
    moves = {}
    for noise in (0.012, 0.2):
        for floor in (0.0, default):
            monkeypatch.setattr(experiments_module, "MIN_SEPARATION", floor)
            rng = np.random.default_rng(1)
            curve = lambda e, s=noise, g=rng: 2.0 + 9.0 * (1.0 + e / 50.0) ** -0.24 + s * g.standard_normal()  # noqa: E731
            run = _drive(_planner(settings=auto, horizon_tokens=4e9), 170, c=32.0, bcrit=lambda e: 40.0, loss=curve)[0]
            moves[noise, floor] = [(d.step, d.plan.global_batch_size) for d in run]
    assert moves[0.012, 0.0] == moves[0.012, default] == moves[0.2, 0.0] == [(120, 32)], moves
    assert moves[0.2, default] == [], moves


def test_a_square_wave_experiment_alternates_its_batch_within_one_window(monkeypatch):
    """docs/robust-goodput.md §6.33 (a variant, off by default): with `DITHER_HALF_STEPS` = 30 the
    experiment of §6.32's test (B = 32 at step 120) is a square wave: 32, 16, 32 every 30 steps
    while the posterior's window (skip + window steps after the first change) lasts, then held
    until the window is read. The changes inside the window do not extend it (`hold_window`):
    it is read when a held experiment's would be, over both batches. The wave survives a
    checkpoint."""

    monkeypatch.setattr(experiments_module, "DITHER_HALF_STEPS", 30)
    auto = PolicySettings(initial=16, min=16, max=512, calibration=4.0, calibration_mode="auto")
    ctrl = _planner(settings=auto, horizon_tokens=4e9, posterior_options={"prior_octaves": 0.5})
    curve = _noisy_power_law()
    moves, plan, state = _drive(ctrl, 170, c=32.0, bcrit=lambda e: 40.0, loss=curve)
    first = [(d.step, d.plan.global_batch_size) for d in moves]
    assert first == [(120, 32), (150, 16)], first
    assert ctrl.dither is not None and ctrl.dither[2] == 120 and ctrl.posterior.hold_window
    twin = _planner(settings=auto, horizon_tokens=4e9, posterior_options={"prior_octaves": 0.5})
    twin.load_state_dict(json.loads(json.dumps(ctrl.state_dict())))
    assert twin.dither == ctrl.dither
    moves = _drive(ctrl, 250, c=32.0, bcrit=lambda e: 40.0, loss=curve, start=state, plan=plan, seed=1)[0]
    seen = first + [(d.step, d.plan.global_batch_size) for d in moves]
    last = twin.dither[3]  # the step of the experiment + the window's span (skip + window + lag)
    assert [m for m in seen if m[0] < last] == [(120, 32), (150, 16), (180, 32)], seen
    assert ctrl.dither is None and not ctrl.posterior.hold_window
    row = ctrl.posterior.experiments[0]
    post = ctrl.posterior
    assert set(row["batches"]) == {16.0, 32.0}
    assert row["steps"] == 2 * post.window_steps + post.skip_steps + 1, row  # not extended by 150, 180


def test_with_c_given_under_the_sqrt_rule_the_variant_learns_only_the_rules_x0(monkeypatch):
    """docs/robust-goodput.md §6.36: c given (`calibration_mode` "fixed", e.g. from `copus
    calibrate`) and the sqrt LR rule: the variant `FIXED_C_LR_ROWS` weighs the x0 rows (the whole
    factor 2x − x²) around a c held FIXED_C_OCTAVES wide, so its hypotheses of c stay at the given
    c whatever the windows read; by default, or with lr_rule "none", c alone (no posterior)."""
    import copus.core.control.controller as controller_module

    fixed = PolicySettings(initial=16, min=16, max=512, interval_steps=10, warmup_steps=10, calibration=2.0)
    assert _planner(settings=fixed, lr_rule="sqrt").posterior is None  # off by default
    monkeypatch.setattr(controller_module, "FIXED_C_LR_ROWS", True)
    assert _planner(settings=fixed, lr_rule="none").posterior is None
    ctrl = _planner(settings=fixed, lr_rule="sqrt", horizon_tokens=2e6 * SEQ)
    post = ctrl.posterior
    assert post is not None and post.lr_fractions and not post.lr_overshoot_only
    assert post.prior_octaves == controller_module.FIXED_C_OCTAVES
    _drive(ctrl, 400, c=4.0, bcrit=lambda e: 5.0 + 2.0 * e**0.8)  # windows that read a c 2x larger
    cs, w = ctrl.c_hypotheses()
    x0 = ctrl.hypothesis_x0
    assert np.isnan(x0).any() and np.isfinite(x0).any()  # the re-tuned row and the x0 rows
    np.testing.assert_allclose(cs, 2.0, rtol=0.15)
