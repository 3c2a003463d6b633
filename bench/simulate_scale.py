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

from copus.core.specs.resolve import get_model_shape
from copus.core.sim.presets import PRESETS
from copus.core.sim.compare import POLICY_FAMILIES, compare_policies
from copus.core.sim.scenario import COPUS_FAITHFUL, Scenario, preset_scenario
from copus.core.sim.simulator import SimSettings
from copus.core.sim.trajectory import TrajectoryParams

OUT = Path(__file__).resolve().parent / "results" / "simulate_scale.json"
FIT_OUT = OUT.with_name("truth_fit.json")  # written as truth_fit_<grid>.json


def scale_run() -> dict:
    shape = get_model_shape("qwen-2.5-32b")
    sim = SimSettings(
        target_losses=(3.0, 2.5, 2.2, 2.0),
        token_budget=20_000_000_000,
        trajectory=TrajectoryParams(initial_loss=float(np.log(shape.vocab_size))),
        seed=0,
    )
    sc = Scenario(
        shape=shape,
        hardware="h100-sxm",
        world_size=1024,
        sim=sim,
        initial_batch=512,
        max_batch=16384,
        batch_grid="geometric",
    )
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
    return {
        "model": shape.name,
        "world_size": 1024,
        "hardware": "h100-sxm",
        "wall_s": wall_once,
        "wall_s_per_policy": per_policy,
        "wall_s_sum": wall,
        "steps": {r.name: r.num_steps for r in cmp_all.results},
        "speedups": cmp_all.speedups(),
        "average_speedup_pct": cmp_all.average_speedup_pct(),
        "goodput_timeline": [
            s.plan.describe() for r in cmp_all.results if cmp_all.families[r.name] == "goodput" for s in r.timeline
        ],
    }


def presets(seeds: int) -> dict:
    out = {}
    for name, preset in PRESETS.items():
        row = {
            "published_avg_speedup_pct": preset.published_avg_speedup_pct,
            "published_speedup_pct": list(preset.published_speedup_pct),
        }
        no_lr = dataclasses.replace(
            COPUS_FAITHFUL,
            name="goodput-no-lr",
            controller=tuple((k, False if k == "lr_aware" else v) for k, v in COPUS_FAITHFUL.controller),
        )
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
            row[variant] = {
                "avg_speedup_pct_mean": float(np.mean(avgs)),
                "avg_speedup_pct_sd": float(np.std(avgs)),
                "avg_speedup_pct_per_seed": avgs,
                "per_target_seed0": per_target[0],
                "goodput_layouts_seed0": layouts[0],
                "wall_s_mean": float(np.mean(walls)),
            }
        out[name] = row
    return out


def calibrate(grid: str = "full") -> dict:
    """Refit each preset's ground truth to the *static and CBS* rows of COPUS Table 1.

    Both truths (core.trajectory LR_TUNED and SQRT_LR) over a grid of their LR-model
    parameters (SQRT_LR: x0, p; both: B_crit/b_noise); for each, the loss curve (E_0, α, B*)
    is refitted to the static rows (core.truth_fit.fit_loss_curve) and the two CBS rows are
    simulated. The COPUS rows are never used: the goodput speed-ups printed beside each
    candidate are the prediction. Writes bench/results/truth_fit.json and prints the numbers to
    paste into core/sim/presets.py (they are not applied automatically).
    """
    from copus.commands.simulate import default_variant
    from copus.core.sim.trajectory import LR_TUNED, SQRT_LR
    from copus.core.sim.truth_fit import fit_truth, preset_cbs_errors, preset_static_rows

    x0s = {
        "full": (0.3, 0.45, 0.6, 0.75, 0.9),
        "quick": (0.6,),
        "fine": tuple(round(0.5 + 0.05 * i, 2) for i in range(10)),
    }[grid]
    exponents = (0.5,) if grid == "fine" else (0.5, 1.0)  # p = 1 lost everywhere on "full"
    candidates = [{"lr_model": LR_TUNED, "gns_calibration": c} for c in (2.0, 4.0)]
    candidates += [
        {"lr_model": SQRT_LR, "lr_fraction_x0": x0, "lr_opt_exponent": p, "lr_warmup_tokens": 8e6, "gns_calibration": c}
        for p in exponents
        for c in (2.0, 4.0)
        for x0 in x0s
    ]
    out = {}
    for name, preset in PRESETS.items():
        rows, cbs = preset_static_rows(preset), preset_cbs_errors(preset)
        fits = fit_truth(preset.trajectory, 2048, rows, preset.target_losses, candidates, cbs)
        out[name] = []
        for f in fits:
            sc = preset_scenario(preset, trajectory=f.params, variants=(COPUS_FAITHFUL, default_variant()))
            cmp_ = compare_policies(sc)
            q = f.params
            row = {
                "lr_model": q.lr_model,
                "x0": q.lr_fraction_x0,
                "p": q.lr_opt_exponent,
                "gns_calibration": q.gns_calibration,
                "warmup_tokens": q.lr_warmup_tokens,
                "progress_scale_samples": q.progress_scale_samples,
                "loss_exponent": q.loss_exponent,
                "bcrit_star_tokens": q.bcrit_star_tokens,
                "static_rms": f.static_rms,
                "cbs_rms": f.cbs_rms,
                "rms": f.rms,
                "sim_goodput_copus_avg_pct": cmp_.average_speedup_pct("goodput-copus"),
                "sim_goodput_avg_pct": cmp_.average_speedup_pct("goodput"),
            }
            out[name].append(row)
            print(
                f"{name:12s} {q.lr_model:8s} x0={q.lr_fraction_x0:<4g} p={q.lr_opt_exponent:<3g} "
                f"c={q.gns_calibration:<3g} E0={q.progress_scale_samples:.4g} "
                f"a={q.loss_exponent:.4g} B*={q.bcrit_star_tokens:.4g} | RMS static "
                f"{f.static_rms:.3f} CBS {f.cbs_rms:.3f} all {f.rms:.3f} | sim goodput-copus "
                f"{row['sim_goodput_copus_avg_pct']:+.1f}% goodput {row['sim_goodput_avg_pct']:+.1f}%"
                f" (published {preset.published_avg_speedup_pct:+.1f}%)",
                flush=True,
            )
    FIT_OUT.with_name(f"truth_fit_{grid}.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {FIT_OUT.with_name(f'truth_fit_{grid}.json')}")
    return out


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
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="only refit the presets' ground truths to Table 1's static and CBS rows",
    )
    ap.add_argument(
        "--grid",
        choices=("full", "fine", "quick"),
        default="full",
        help="--calibrate: x0 in 0.3..0.9 with p in {1, 1/2}; 0.5..0.95 at p = 1/2; one x0 (a smoke run)",
    )
    args = ap.parse_args()
    if args.calibrate:
        calibrate(args.grid)
        return
    scale = scale_run()
    print(
        f"1,024 x H100, {scale['model']}, all policies: {scale['wall_s']:.2f} s wall "
        f"(target < 10 s); per policy: " + ", ".join(f"{k} {v:.2f}s" for k, v in scale["wall_s_per_policy"].items())
    )
    print(f"  simulated avg speed-up of goodput: {scale['average_speedup_pct']:+.1f}%")
    pre = presets(args.seeds)
    print(f"\n{'preset':14s}{'published':>11s}{'sim LR-aware':>22s}{'sim no LR factor':>22s}")
    for name, row in pre.items():
        a, b = row["lr_aware"], row["no_lr_factor"]
        print(
            f"{name:14s}{row['published_avg_speedup_pct']:>+10.1f}%"
            f"{a['avg_speedup_pct_mean']:>+14.1f}% ± {a['avg_speedup_pct_sd']:4.1f}"
            f"{b['avg_speedup_pct_mean']:>+14.1f}% ± {b['avg_speedup_pct_sd']:4.1f}"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"scale_1024": scale, "presets": pre, "seeds": args.seeds}, indent=1))
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
