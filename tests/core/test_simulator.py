import dataclasses
import math

import numpy as np
import pytest

from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan
from copus.core.sim.presets import PRESETS
from copus.core.sim.compare import compare_policies
from copus.core.sim.scenario import Planner, Scenario, default_policy_factory, preset_scenario
from copus.core.sim.simulator import SimSettings, reconfig_cost_s, simulate
from copus.core.sim.trajectory import TrajectoryParams

SHAPE = get_model_shape("llama-3.2-3b")
# Fixed here (not taken from a preset, whose fit follows the step-time model): B_crit grows
# from ~1 to ~1,000 samples, so the best layout moves from tp2 to pure dp during the run.
TRAJ = TrajectoryParams(initial_loss=11.76, progress_scale_samples=265.0, loss_exponent=0.272, bcrit_star_tokens=1e9)


def _scenario(**kw) -> Scenario:
    """3B on 8 H100 (NVLink pairs), short run: two early targets, small budget."""
    sim = SimSettings(
        target_losses=(6.0, 4.5),
        token_budget=60_000_000,
        seed=kw.pop("seed", 0),
        trajectory=TRAJ,
        reconfig_cost_s=5.0,
        **kw.pop("sim", {}),
    )
    return Scenario(
        shape=SHAPE, hardware="h100-nvlink-pairs", world_size=8, sim=sim, max_batch=256, static_batches=(16, 64), **kw
    )


@pytest.fixture(scope="module")
def planner():
    return Planner(_scenario())


def _run(policy_name: str, planner: Planner, scenario: Scenario, **sim_kw):
    sim = dataclasses.replace(scenario.sim, **sim_kw)
    plan = planner.fastest_plan(scenario.initial_batch)
    policy = default_policy_factory(scenario)(policy_name, plan, planner)
    return simulate(policy, plan, scenario.shape, planner.step_time_model, sim, switch_cost_s=planner.switch_cost_s)


def test_deterministic_for_a_seed(planner):
    sc = _scenario()
    a, b = _run("goodput", planner, sc), _run("goodput", planner, sc)
    assert a.time_to_target_s == b.time_to_target_s and a.num_steps == b.num_steps
    assert [d.plan for d in a.decisions] == [d.plan for d in b.decisions]
    c = _run("goodput", planner, sc, seed=1)
    assert c.wall_s != a.wall_s


def test_every_target_reached_in_order_and_batches_grow(planner):
    res = _run("gns", planner, _scenario())
    t6, t45 = res.time_to_target_s[6.0], res.time_to_target_s[4.5]
    assert t6 is not None and t45 is not None and 0 < t6 < t45 <= res.wall_s
    batches = [s.plan.global_batch_size for s in res.timeline]
    assert batches[0] == 16 and batches[-1] > 16 and batches == sorted(batches)
    assert all(s.plan.layout == res.timeline[0].plan.layout for s in res.timeline)  # CBS: fixed


def test_replayed_feed_gives_the_same_decisions(planner):
    """The controller inside the simulator decides exactly as on the same feed outside it."""
    sc = _scenario()
    plan = planner.fastest_plan(sc.initial_batch)
    factory = default_policy_factory(sc)
    inside = factory("goodput", plan, planner)
    feed, decided = [], {}

    class Recorder:
        def observe(self, record):
            feed.append(record)
            d = inside.observe(record)
            if d is not None:
                decided[record.step] = d
            return d

        def record_switch_cost(self, seconds):
            feed.append(seconds)
            inside.record_switch_cost(seconds)

    sim = dataclasses.replace(sc.sim, token_budget=200_000_000, target_losses=(3.5,))
    res = simulate(Recorder(), plan, sc.shape, planner.step_time_model, sim, switch_cost_s=planner.switch_cost_s)
    assert len(res.decisions) >= 2 and any(d.kind == "reconfigure" for d in res.decisions)
    fresh = factory("goodput", plan, planner)
    replayed = {}
    for item in feed:
        if isinstance(item, float):
            fresh.record_switch_cost(item)
            continue
        d = fresh.observe(item)
        if d is not None:
            replayed[item.step] = d
    assert replayed.keys() == decided.keys()
    for step, d in decided.items():
        assert replayed[step].plan == d.plan and replayed[step].kind == d.kind
        assert replayed[step].reason == d.reason
    # the simulator applied every decision at the next step
    for step, d in decided.items():
        nxt = next(r for r in feed if not isinstance(r, float) and r.step == step + 1)
        assert nxt.plan == d.plan


def test_reconfiguration_cost_is_added_to_wall_time(planner):
    sc = _scenario()
    sim = dataclasses.replace(sc.sim, target_losses=(3.5,), token_budget=200_000_000)
    cheap = _run("goodput", planner, sc, target_losses=(3.5,), token_budget=200_000_000)
    assert cheap.switch_costs_s, "expected at least one parallelism change"
    assert sum(cheap.switch_costs_s) == pytest.approx(planner.switch_cost_s * len(cheap.switch_costs_s), rel=0.2)
    assert cheap.wall_s > sum(cheap.switch_costs_s)
    no_cost = simulate(
        default_policy_factory(sc)("goodput", cheap.timeline[0].plan, planner),
        cheap.timeline[0].plan,
        sc.shape,
        planner.step_time_model,
        sim,
        switch_cost_s=0.0,
    )
    assert no_cost.switch_costs_s and all(c == 0.0 for c in no_cost.switch_costs_s)


def test_reconfig_cost_model_matches_copus_table2_magnitudes():
    for name, lo, hi in (("llama-3.2-3b", 25, 60), ("qwen-2.5-32b", 40, 70)):
        world = 8 if name.startswith("llama-3.2") else 32
        online = reconfig_cost_s(get_model_shape(name), world, "online")
        restart = reconfig_cost_s(get_model_shape(name), world, "restart")
        assert lo <= online <= hi and 2 * online < restart < 900
    with pytest.raises(ValueError, match="reconfig_mode"):
        reconfig_cost_s(SHAPE, 8, "teleport")


def test_more_gpus_never_slower_for_the_best_plan_of_a_large_model():
    shape = get_model_shape("llama-2-13b")
    for batch in (64, 256):
        times = []
        for world in (8, 16, 32, 64):
            sim = SimSettings(target_losses=(4.0,), token_budget=1)
            p = Planner(
                Scenario(
                    shape=shape, hardware="h100-sxm", world_size=world, sim=sim, initial_batch=batch, max_batch=batch
                )
            )
            plan = p.fastest_plan(batch)
            assert plan is not None
            times.append(
                float(
                    p.step_time_model.predict(
                        *(
                            np.array([v])
                            for v in (plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches)
                        )
                    )[0]
                )
            )
        assert all(np.diff(times) <= 1e-12), times


def test_bigger_static_batch_never_more_efficient_per_sample(planner):
    sc = _scenario()
    samples = []
    for batch in (16, 32, 64, 128):
        plan = planner.fastest_plan(batch)
        sim = dataclasses.replace(sc.sim, target_losses=(4.5,))
        res = simulate(
            default_policy_factory(sc)("constant", plan, planner), plan, sc.shape, planner.step_time_model, sim
        )
        samples.append(res.tokens // sc.shape.seq_len)
    assert samples == sorted(samples) and samples[0] < samples[-1]


def test_compare_policies_reports_every_family_and_speedups():
    sc = _scenario()
    cmp_ = compare_policies(sc)
    fams = set(cmp_.families.values())
    assert fams == {"static", "cbs", "doubling", "norm-test", "goodput"}
    rows = cmp_.speedups()
    assert [r["target"] for r in rows] == [6.0, 4.5]
    for r in rows:
        assert r["baseline"] is not None and r["goodput_s"] is not None
        expect = 100 * (r["baseline_s"] - r["goodput_s"]) / r["baseline_s"]
        assert r["speedup_pct"] == pytest.approx(expect)
    d = cmp_.to_dict()
    assert d["world_size"] == 8 and len(d["runs"]) == len(cmp_.results)
    with pytest.raises(ValueError, match="policy 'adam'"):
        compare_policies(sc, ("adam",))


def test_preset_scenarios_build():
    for preset in PRESETS.values():
        sc = preset_scenario(preset, seed=3)
        assert sc.world_size == preset.world_size and sc.sim.seed == 3
        assert sc.sim.target_losses == preset.target_losses


def test_bad_settings_raise_value_error():
    with pytest.raises(ValueError, match="reconfig_mode"):
        SimSettings(target_losses=(3.0,), token_budget=10, reconfig_mode="fast")
    with pytest.raises(ValueError, match="target_losses"):
        SimSettings(target_losses=(), token_budget=10)
    plan = ParallelPlan(dp=1, tp=1, pp=1, micro_batch_size=1, num_microbatches=16)

    class Inf:
        def predict(self, *a):
            return np.array([math.inf])

    class Null:
        def observe(self, r):
            return None

    with pytest.raises(ValueError, match="predicted step time"):
        simulate(
            Null(),
            plan,
            SHAPE,
            Inf(),
            SimSettings(target_losses=(3.0,), token_budget=10**6, trajectory=TrajectoryParams()),
        )


def test_simulate_command_json_plot_and_errors(tmp_path, capsys):
    import json

    from copus.cli import main

    png = tmp_path / "sim.png"
    rc = main(
        [
            "simulate",
            "--model",
            "llama-3.2-3b",
            "--gpus",
            "8",
            "--target-loss",
            "6.0,5.0",
            "--policies",
            "static,goodput",
            "--tokens",
            "3e7",
            "--max-batch",
            "64",
            "--json",
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 8 and [r["target"] for r in out["speedups"]] == [6.0, 5.0]
    assert {r["family"] for r in out["runs"]} == {"static", "goodput"}
    assert png.stat().st_size > 1000
    assert main(["simulate", "--policies", "static,magic"]) == 2
    assert "--policies" in capsys.readouterr().err
    assert main(["simulate", "--preset", "70b-moon"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_simulate_takes_a_train_config(tmp_path, capsys):
    import json

    from copus.cli import main

    conf = tmp_path / "run.toml"
    conf.write_text(
        "[model]\nname = 'llama-3.2-3b'\n[parallel]\nnproc = 16\n[batch]\ninitial = 32\n"
        "max = 256\n[train]\nmax_tokens = 200000000\nseed = 3\n"
    )
    assert main(["simulate", "--config", str(conf), "--policies", "static", "--target-loss", "6.0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["world_size"], out["seed"], out["token_budget"]) == (16, 3, 200_000_000)
    assert [int(r["name"].split()[1][2:]) for r in out["runs"]] == [32, 64, 128, 256]  # batch.initial..max
    assert {s["dp"] * s["tp"] * s["pp"] for r in out["runs"] for s in r["timeline"]} == {16}  # nproc
