"""Benchmark: `copus simulate` at scale, and the four COPUS presets against the paper.

1. Every policy, a full run of Qwen-2.5-32B on 1,024 H100 (SXM) GPUs: wall time of the whole
   comparison (target < 10 s) and of each policy.
2. The four COPUS configurations (core.presets): simulated average time-to-target speed-up of
   goodput over the fastest baseline (static + CBS, Table 1 metric) next to the published one,
   with COPUS's LR-aware goodput (Eq. 8) and without the sqrt(B) factor, over a few seeds.

Writes bench/results/simulate_scale.json and prints a table.
Run: /work/venv/bin/python bench/simulate_scale.py [--seeds 3] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from copus.core.models import get_model_shape
from copus.core.presets import PRESETS
from copus.core.simulator import (COPUS_FAITHFUL, POLICY_FAMILIES, Scenario, SimSettings,
                                  compare_policies, preset_scenario)
from copus.core.trajectory import TrajectoryParams

OUT = Path(__file__).resolve().parent / "results" / "simulate_scale.json"


def scale_run() -> dict:
    shape = get_model_shape("qwen-2.5-32b")
    sim = SimSettings(target_losses=(3.0, 2.5, 2.2, 2.0), token_budget=20_000_000_000,
                      trajectory=TrajectoryParams(initial_loss=float(np.log(shape.vocab_size))),
                      seed=0)
    sc = Scenario(shape=shape, hardware="h100-sxm", world_size=1024, sim=sim, initial_batch=512,
                  max_batch=16384, batch_grid="geometric")
    t0 = time.perf_counter()
    per_policy = {}
    results = []
    for fam in POLICY_FAMILIES:
        t = time.perf_counter()
        cmp_ = compare_policies(sc, (fam,))
        per_policy[fam] = time.perf_counter() - t
        results.extend(cmp_.results)
    wall = time.perf_counter() - t0
    t = time.perf_counter()
    cmp_all = compare_policies(sc)
    wall_once = time.perf_counter() - t
    return {"model": shape.name, "world_size": 1024, "hardware": "h100-sxm",
            "wall_s": wall_once, "wall_s_per_policy": per_policy, "wall_s_sum": wall,
            "steps": {r.name: r.num_steps for r in cmp_all.results},
            "speedups": cmp_all.speedups(), "average_speedup_pct": cmp_all.average_speedup_pct(),
            "goodput_timeline": [s.plan.describe() for r in cmp_all.results
                                 if cmp_all.families[r.name] == "goodput" for s in r.timeline]}


def presets(seeds: int) -> dict:
    out = {}
    for name, preset in PRESETS.items():
        row = {"published_avg_speedup_pct": preset.published_avg_speedup_pct,
               "published_speedup_pct": list(preset.published_speedup_pct)}
        no_lr = dataclasses.replace(COPUS_FAITHFUL, name="goodput-no-lr", controller=tuple(
            (k, False if k == "lr_aware" else v) for k, v in COPUS_FAITHFUL.controller))
        for variant, goodput in (("lr_aware", COPUS_FAITHFUL), ("no_lr_factor", no_lr)):
            avgs, per_target, walls, layouts = [], [], [], []
            for seed in range(seeds):
                sc = preset_scenario(preset, seed=seed, variants=(goodput,))
                t = time.perf_counter()
                cmp_ = compare_policies(sc)
                walls.append(time.perf_counter() - t)
                avgs.append(cmp_.average_speedup_pct())
                per_target.append([r["speedup_pct"] for r in cmp_.speedups()])
                good = next(r for r in cmp_.results if cmp_.families[r.name] == "goodput")
                layouts.append(_layouts(good))
            row[variant] = {"avg_speedup_pct_mean": float(np.mean(avgs)),
                            "avg_speedup_pct_sd": float(np.std(avgs)),
                            "avg_speedup_pct_per_seed": avgs, "per_target_seed0": per_target[0],
                            "goodput_layouts_seed0": layouts[0], "wall_s_mean": float(np.mean(walls))}
        out[name] = row
    return out


def calibrate() -> dict:
    """Refit each preset's loss curve (E_0, α, B*) to the *static* rows of COPUS Table 1.

    Each static batch runs on its fastest plan under the current analytic step-time model;
    time to loss L at batch B is (step_s/B)·E(L) + step_s·∫ dE / B_crit(L(E)) (McCandlish's
    E = E_min(1 + B/B_crit), integrated). Least squares on log time; L_inf fixed at 1.0.
    Prints the numbers to paste into core/presets.py (they are not applied automatically).
    """
    import math

    from scipy.optimize import least_squares

    from copus.core.simulator import Planner
    from copus.core.trajectory import Trajectory

    fits = {}
    for name, preset in PRESETS.items():
        planner = Planner(preset_scenario(preset))
        shape = planner.scenario.shape
        data = []
        for label, minutes in preset.published_minutes.items():
            if not label.startswith("Static"):
                continue
            batch = int(label.split("=")[1])
            plan = planner.fastest_plan(batch)
            step_s = float(planner.step_time_model.predict(*(np.array([v]) for v in (
                plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches)))[0])
            data += [(batch, step_s, loss, m * 60) for loss, m in zip(preset.target_losses, minutes)
                     if m is not None]

        def resid(x, data=data, preset=preset, shape=shape):
            params = TrajectoryParams(initial_loss=preset.trajectory.initial_loss, final_loss=1.0,
                                      progress_scale_samples=math.exp(x[0]), loss_exponent=x[1],
                                      bcrit_star_tokens=math.exp(x[2]))
            traj = Trajectory(params, shape.seq_len)
            out = []
            for batch, step_s, loss, t in data:
                e_end = traj.progress_for_loss(loss)
                grid = np.linspace(0.0, e_end, 2000)
                inv = np.array([1.0 / traj.critical_batch(traj.loss(e)) for e in grid])
                model_t = step_s / batch * e_end + step_s * np.trapezoid(inv, grid)
                out.append(math.log(model_t / t))
            return np.array(out)

        res = least_squares(resid, [math.log(50.0), 0.25, math.log(2e8)],
                            bounds=([0.0, 0.05, math.log(1e6)], [math.log(1e8), 3.0, math.log(1e11)]))
        fits[name] = {"progress_scale_samples": math.exp(res.x[0]), "loss_exponent": res.x[1],
                      "bcrit_star_tokens": math.exp(res.x[2]),
                      "rms_log_err": float(np.sqrt(np.mean(res.fun ** 2)))}
        print(name, {k: float(f"{v:.4g}") for k, v in fits[name].items()})
    return fits


def _layouts(result) -> list[str]:
    seen, out = None, []
    for s in result.timeline:
        if s.plan.layout != seen:
            seen = s.plan.layout
            out.append(f"DP{s.plan.dp},TP{s.plan.tp},PP{s.plan.pp}@{s.start_s / 60:.1f}min")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--calibrate", action="store_true",
                    help="only refit the presets' loss curves to Table 1's static rows")
    args = ap.parse_args()
    if args.calibrate:
        calibrate()
        return
    scale = scale_run()
    print(f"1,024 x H100, {scale['model']}, all policies: {scale['wall_s']:.2f} s wall "
          f"(target < 10 s); per policy: "
          + ", ".join(f"{k} {v:.2f}s" for k, v in scale["wall_s_per_policy"].items()))
    print(f"  simulated avg speed-up of goodput: {scale['average_speedup_pct']:+.1f}%")
    pre = presets(args.seeds)
    print(f"\n{'preset':14s}{'published':>11s}{'sim LR-aware':>22s}{'sim no LR factor':>22s}")
    for name, row in pre.items():
        a, b = row["lr_aware"], row["no_lr_factor"]
        print(f"{name:14s}{row['published_avg_speedup_pct']:>+10.1f}%"
              f"{a['avg_speedup_pct_mean']:>+14.1f}% ± {a['avg_speedup_pct_sd']:4.1f}"
              f"{b['avg_speedup_pct_mean']:>+14.1f}% ± {b['avg_speedup_pct_sd']:4.1f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"scale_1024": scale, "presets": pre, "seeds": args.seeds},
                              indent=1))
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
