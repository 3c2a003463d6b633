"""bench/ttt_replay.py (replay time, goal check) and bench/lr_aware_check.py on made-up runs."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


replay = _load("ttt_replay")
lra = _load("lr_aware_check")


def _plan(b, pp=4, mbs=2):
    return {"dp": 1, "tp": 1, "pp": pp, "micro_batch_size": mbs, "global_batch_size": b}


def _write(run, steps, decisions=(), evals=(), probes=()):
    run.mkdir(parents=True)
    for name, rows in (("metrics", steps), ("decisions", decisions), ("eval", evals), ("probes", probes)):
        (run / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_replay_prices_steps_by_the_profile_plus_switch_and_probe_costs(tmp_path):
    steps = [{"step": i, "step_s": 9.0, **_plan(8)} for i in (1, 2, 3)]
    steps += [{"step": 4, "step_s": 5.0, **_plan(16, mbs=4)}, {"step": 5, "step_s": 7.0, **_plan(16, mbs=4)}]
    _write(
        tmp_path / "r",
        steps,
        decisions=[{"step": 3, "switch_s": 1.5, "applied": True}],
        evals=[{"step": 2, "val_loss": 3.0}, {"step": 5, "val_loss": 2.0}],
        probes=[{"step": 4, "cost_s": 10.0}],
    )
    medians = replay.profile_medians([{**_plan(8), "step_s": 9, "step_s_all": [1.0, 2.0, 30.0]}])
    assert medians == {(1, 1, 4, 2, 8): 2.0}
    rc = replay.replay_curve(tmp_path / "r", medians)
    # 3 profiled steps at 2 s, switch 1.5 s, 2 unprofiled steps at their own median 6 s, probe 10
    assert rc["replay_s"] == pytest.approx(3 * 2 + 1.5 + 6 + 10 + 6)
    assert rc["unprofiled_steps"] == 2 and rc["switch_s"] == 1.5 and rc["probe_s"] == 10
    # same layout and micro-batch profiled at 4 and 8 micro-batches: a line through them
    two = {(1, 1, 4, 2, 8): 2.0, (1, 1, 4, 2, 16): 3.0}
    assert replay.interpolate(two, (1, 1, 4, 2, 12)) == pytest.approx(2.5)
    assert replay.interpolate(two, (1, 1, 4, 2, 32)) == pytest.approx(5.0)
    assert replay.interpolate({(1, 1, 4, 2, 8): 2.0}, (1, 1, 4, 2, 24)) == pytest.approx(6.0)
    assert math.isnan(replay.interpolate(two, (2, 1, 2, 2, 8)))
    assert replay.replay_eval_curve(tmp_path / "r", medians) == ([4.0, pytest.approx(29.5)], [3.0, 2.0])


def test_goal_check_uses_median_over_seeds_and_both_clocks():
    tt = {
        "static-8": {0: 100.0, 1: 100.0, 2: 130.0},
        "static-16": {0: 90.0, 1: 120.0, 2: 120.0},
        "gns-start": {0: 95.0, 1: 95.0, 2: 95.0},
        "goodput": {0: 80.0, 1: 85.0, 2: 70.0},
    }
    res = {
        "seeds": [0, 1, 2],
        "time_to_target_s": {"2.0": tt},
        "replay_time_to_target_s": {"2.0": {**tt, "goodput": {0: 99.0, 1: 99.0, 2: 99.0}}},
    }
    g = replay.goal_check(res)
    assert g["wall"]["vs_static"]["baseline"] == "static-8"  # median 100 < 120
    assert g["wall"]["vs_static"]["median"] == pytest.approx(0.2)  # of .2, .15, .46
    assert g["wall"]["vs_cbs"]["median"] == pytest.approx(1 - 80 / 95)
    assert g["wall"]["met"] and not g["replay"]["met"]
    tt["goodput"][1] = math.nan  # one seed never got there
    assert not replay.goal_check(res)["wall"]["met"]


def test_lr_aware_check_recovers_phi_from_an_e_of_b_world():
    """Loss falls with 'progress' p(tokens, B) = tokens / (φ + B): the E(B) model exactly."""
    phi, curves = 40.0, {}
    for b in (8, 16, 32):
        tokens = [1000.0 * i for i in range(1, 200)]
        curves[b] = {
            "tokens": tokens,
            "loss": [5.0 / (1 + t / (phi + b) / 100) for t in tokens],
            "b_noise": [(t, phi) for t in tokens],
        }
    res = lra.analyse(curves, 8, [0.25, 0.5])
    for r in res["rows"]:
        assert r["ratio"] == pytest.approx((phi + r["batch"]) / (phi + 8), rel=0.02)
        assert r["phi_fit"] == pytest.approx(phi, rel=0.1)
        assert r["E_c1"] == pytest.approx(r["ratio"], rel=0.02)
    assert "measured ratio < 1" in lra.markdown(res)


def test_ceiling_is_zero_on_flat_throughput_and_large_on_linear():
    phi = 1e6  # pure noise: every batch is efficient
    steps = [
        {"small_sqnorm": 1.0 + phi / 4, "small_batch": 4, "big_sqnorm": 1.0 + phi / 8, "global_batch_size": 8}
        for _ in range(200)
    ]
    flat = [{"global_batch_size": b, "samples_per_s": 50.0} for b in (8, 16, 32)]
    linear = [{"global_batch_size": b, "samples_per_s": 5.0 * b} for b in (8, 16, 32)]
    assert lra.ceiling(steps, flat, 8, 1.0)["1"]["oracle_saves_vs_base"] == pytest.approx(0)
    lin = lra.ceiling(steps, linear, 8, 1.0)["1"]
    assert lin["best_static"] == 32 and lin["oracle_saves_vs_base"] == pytest.approx(0.75, abs=1e-3)
    assert lin["oracle_saves_vs_best_static"] == pytest.approx(0, abs=1e-3)


def test_schedule_ceiling_needs_a_moving_noise_scale():
    """Constant φ: one static batch is already the per-step best (the oracle gains 0). φ rising
    1 → 1000 with T(B) ∝ B/(64+B): no static batch is right throughout, the oracle gains."""
    rate = {b: b / (64 + b) for b in (8, 16, 32, 64, 128, 256, 512)}
    flat = lra.schedule_ceiling([50.0] * 300, rate, 8, 1.0, (1.0,))["1"]
    assert flat["oracle_saves_vs_best_static"] == pytest.approx(0, abs=1e-12)
    rising = [10 ** (3 * i / 299) for i in range(300)]
    r = lra.schedule_ceiling(rising, rate, 8, 1.0, (1.0,))["1"]
    assert 0.10 < r["oracle_saves_vs_best_static"] < r["oracle_saves_vs_base"]
    assert r["best_static"] not in (8, 512)


def test_bench_goodput_runs_with_library_defaults_only():
    """The head-to-head's `goodput` leg sets no [gns]/[controller] key (nothing bench-specific);
    `goodput-copus` differs from it only by the policy name."""
    import types

    ttt = _load("time_to_target")
    args = types.SimpleNamespace(
        initial_batch=8,
        static=[8, 16, 32, 64, 128],
        model="tiny",
        nproc=4,
        max_tokens=1_000_000,
        warmup_tokens=50_000,
        lr=3e-3,
        eval_samples=32,
        set=[],
    )
    plan = {"dp": 1, "tp": 1, "pp": 4, "micro_batch_size": 2}
    best = {b: {**plan, "micro_batch_size": max(2, b // 8)} for b in args.static}
    specs = ttt.run_specs(args, best, 128)
    assert set(ttt.ALL_POLICIES) <= set(specs)
    assert not [s for s in specs["goodput"] if s.startswith(("gns.", "controller."))]
    diff = set(specs["goodput-copus"]) ^ set(specs["goodput"])
    assert diff == {"batch.policy='goodput'", "batch.policy='goodput-copus'"}


def test_time_to_target_analyse_on_made_up_runs_skips_superseded_rows(tmp_path):
    """bench/time_to_target.py reads run folders with ttt_replay's reader: wall time without
    evaluation, replay time from the profile, and rows a resume superseded left out."""
    ttt = _load("time_to_target")
    assert ttt.read_jsonl is replay.read_jsonl and ttt.plan_key is replay.plan_key
    root = tmp_path / "root"
    for name, step_s, loss_end in (("static-8", 1.0, 2.0), ("goodput", 0.5, 1.9)):
        steps, wall = [], 0.0
        for i in range(1, 5):
            wall += step_s + (2.0 if i == 3 else 0.0)  # a 2 s evaluation after step 2
            steps.append({"step": i, "step_s": step_s, "wall_s": wall, "tokens": 1024 * i, **_plan(8)})
        evals = [
            {"step": 2, "val_loss": 3.0, "tokens": 2048, "wall_s": 2 * step_s + 2.0},
            {"step": 4, "val_loss": loss_end, "tokens": 4096, "wall_s": wall},
        ]
        stale = {"step": 4, "step_s": 99.0, "wall_s": 999.0, "tokens": 4096, "superseded": True, **_plan(8)}
        _write(root / "seed0" / name, [*steps, stale], evals=evals)
    res = ttt.analyse([root], [2.5], [1.0], medians={(1, 1, 4, 2, 8): 0.25})
    tt = res["time_to_target_s"]["2.5"]
    # static-8: evaluations at 2 s and 4 s of training (the 2 s evaluation excluded), 3.0 -> 2.0
    assert tt["static-8"][0] == pytest.approx(3.0)
    assert tt["goodput"][0] == pytest.approx(1.0 + 1.0 * 0.5 / 1.1)
    # replay: every step at the profiled 0.25 s, whatever the wall clock said
    rt = res["replay_time_to_target_s"]["2.5"]
    assert rt["static-8"][0] == pytest.approx(0.75)
    assert rt["goodput"][0] == pytest.approx(0.5 + 0.5 * 0.5 / 1.1)
    assert res["runs"]["static-8/seed0"]["train_wall_s"] == pytest.approx(4.0)  # not 999 - 2
