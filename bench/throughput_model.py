"""How well does the fitted step-time model predict and rank plans it never saw? (issues 5, 15)

    python bench/throughput_model.py                     # profile all plans at 4 ranks, then fit
    python bench/throughput_model.py --profile prof.json --cores 2   # reuse a `copus profile` table

Profiles every valid plan of the tiny model at 4 CPU ranks (`copus profile`), fits
`copus.core.cost.fit.fit_model` on a random 30% of them and scores the other 70% (held out), over
`--splits` random splits (medians reported), for three models side by side:
- "one core per rank": `StepTimeModel` (the "cpu" prior);
- "shared cores": `SharedCoreStepTimeModel` (core/cost/cpu_model.py), ranks time-sharing `--cores`
  cores (the profile's machine; default: this machine's), StepTimeModel's communication terms;
- "gloo calls, shared cores": `GlooCpuStepTimeModel` (core/cost/cpu_model.py, the CPU prior): the
  collectives copus's runtime issues, counted, priced per call, and the same shared-core bound.
Two references for what any model can reach on this data: the measurement noise of a plan's
median (half the mean |median(repeats 1-2) / median(repeats 3-4) − 1|: the expected |error| of
a 4-step median, were steps independent) and the in-sample MAPE of a descriptive 15-parameter
fit, step = a + c·m + d·m·b separately per layout.
Metrics: MAPE of the step time; Spearman's ρ between predicted and measured step times; and,
per global batch, the measured slowdown of the plan the model predicts fastest against the
measured fastest (what a controller choosing by the model loses). Targets: MAPE ≤ 5%,
predicted-best within 5% of measured-best. JSON: bench/results/throughput_model.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from copus.core.cost.cpu_model import GlooCpuStepTimeModel, SharedCoreStepTimeModel
from copus.core.cost.fit import fit_model, prior_model
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan

RESULTS = Path(__file__).resolve().parent / "results"


def profile(args) -> Path:
    out = RESULTS.parent.parent / "runs" / "bench" / "throughput_model_profile"  # raw: git-ignored
    cmd = [
        sys.executable,
        "-m",
        "copus",
        "profile",
        "--nproc",
        str(args.nproc),
        "--model",
        args.model,
        "--global-batch",
        args.global_batch,
        "--micro-batch-sizes",
        args.micro_batch_sizes,
        "--steps",
        str(args.steps),
        "--warmup",
        "1",
        "--out",
        str(out),
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return out / "profile.json"


FIELDS = ("dp", "tp", "pp", "micro_batch_size", "num_microbatches")


def columns(rows: list[dict]) -> list[np.ndarray]:
    return [np.array([r[k] for r in rows]) for k in FIELDS]


def mape(model, rows: list[dict]) -> float:
    pred = model.predict(*columns(rows))
    meas = np.array([r["step_s"] for r in rows])
    return float(np.mean(np.abs(pred - meas) / meas) * 100.0)


def best_plan_slowdowns(pred: np.ndarray, rows: list[dict]) -> list[float]:
    """Per global batch: measured step of the predicted-fastest plan / measured fastest − 1."""
    meas = np.array([r["step_s"] for r in rows])
    out = []
    for batch in sorted({r["global_batch_size"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["global_batch_size"] == batch]
        if len(idx) > 1:
            chosen = idx[int(np.argmin(pred[idx]))]
            out.append(float(meas[chosen] / meas[idx].min() - 1.0))
    return out


def score(base, rows: list[dict], fit_fraction: float, splits: int) -> dict:
    """Held-out MAPE, Spearman ρ and best-plan slowdown over random splits (medians)."""
    n_fit = max(1, int(round(fit_fraction * len(rows))))
    errors, fit_errors, rhos, slow = [], [], [], []
    for split in range(splits):
        shuffled = rows[:]
        random.Random(split).shuffle(shuffled)
        fit_rows, test_rows = shuffled[:n_fit], shuffled[n_fit:]
        obs = [(ParallelPlan(**{k: r[k] for k in FIELDS}), r["step_s"]) for r in fit_rows]
        model = fit_model(obs, base)
        pred = model.predict(*columns(test_rows))
        errors.append(mape(model, test_rows))
        fit_errors.append(mape(model, fit_rows))
        rhos.append(float(spearmanr(pred, [r["step_s"] for r in test_rows]).statistic))
        slow += best_plan_slowdowns(pred, test_rows)
    full = fit_model([(ParallelPlan(**{k: r[k] for k in FIELDS}), r["step_s"]) for r in rows], base)
    return {
        "mape_heldout_median_pct": statistics.median(errors),
        "mape_heldout_min_pct": min(errors),
        "mape_heldout_max_pct": max(errors),
        "mape_fit_median_pct": statistics.median(fit_errors),
        "mape_fit_all_plans_pct": mape(full, rows),
        "spearman_heldout_median": statistics.median(rhos),
        "spearman_heldout_min": min(rhos),
        "best_plan_slowdown_median_pct": 100 * statistics.median(slow),
        "best_plan_slowdown_mean_pct": 100 * statistics.fmean(slow),
        "best_plan_slowdown_max_pct": 100 * max(slow),
        "best_plan_within_5pct_share": sum(x <= 0.05 for x in slow) / len(slow),
        "prior_mape_pct": mape(base, rows),
        "per_layout_error_pct": per_layout_errors(full, rows),
    }


def per_layout_errors(model, rows: list[dict]) -> dict[str, float]:
    """Mean signed error (predicted/measured − 1, %) per layout, model fitted on every plan."""
    pred = model.predict(*columns(rows))
    out: dict[str, list[float]] = {}
    for r, p in zip(rows, pred):
        out.setdefault(f"dp{r['dp']}.tp{r['tp']}.pp{r['pp']}", []).append(p / r["step_s"] - 1)
    return {k: 100 * statistics.fmean(v) for k, v in sorted(out.items())}


def measurement_noise_pct(rows: list[dict]) -> float:
    """Expected |error| (%) of a plan's 4-step median from its repeats: half the mean
    |median(first half) / median(second half) − 1| (the difference of two half-medians has
    about four times the variance of the full median)."""
    dev = []
    for r in rows:
        times = r["step_s_all"]
        half = len(times) // 2
        if half >= 1:
            dev.append(abs(statistics.median(times[:half]) / statistics.median(times[half:]) - 1))
    return 100 * statistics.fmean(dev) / 2 if dev else float("nan")


def per_layout_affine_mape_pct(rows: list[dict]) -> float:
    """In-sample MAPE (%) of step = a + c·m + d·m·b fitted per layout (relative least squares)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dp"], r["tp"], r["pp"]), []).append(r)
    errors = []
    for group in groups.values():
        m = np.array([r["num_microbatches"] for r in group], float)
        b = np.array([r["micro_batch_size"] for r in group], float)
        y = np.array([r["step_s"] for r in group])
        basis = np.stack([np.ones_like(m), m, m * b], axis=1)
        coef = np.linalg.lstsq(basis / y[:, None], np.ones_like(y), rcond=None)[0]
        errors += list(np.abs(basis @ coef / y - 1))
    return 100 * float(np.mean(errors))


METRICS = (
    "mape_heldout_median_pct",
    "mape_heldout_max_pct",
    "mape_fit_median_pct",
    "mape_fit_all_plans_pct",
    "spearman_heldout_median",
    "spearman_heldout_min",
    "best_plan_slowdown_median_pct",
    "best_plan_slowdown_mean_pct",
    "best_plan_slowdown_max_pct",
    "best_plan_within_5pct_share",
    "prior_mape_pct",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="existing profile.json (skip profiling)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="cores of the machine that measured the profile")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--global-batch", default="8,16,32,64")
    ap.add_argument("--micro-batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fit-fraction", type=float, default=0.3)
    ap.add_argument("--splits", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS / "throughput_model.json"), help="JSON path")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(args.profile) if args.profile else profile(args)
    rows = json.loads(path.read_text())
    shape = get_model_shape(args.model)
    world = rows[0]["dp"] * rows[0]["tp"] * rows[0]["pp"]
    base = prior_model(shape, None, world)
    shared = SharedCoreStepTimeModel(
        base.params, shape, None, cores=args.cores, world_size=world, dtype_bytes=base.dtype_bytes
    )
    gloo = GlooCpuStepTimeModel(
        base.params, shape, None, cores=args.cores, world_size=world, dtype_bytes=base.dtype_bytes
    )
    models = {
        "one core per rank": score(base, rows, args.fit_fraction, args.splits),
        f"shared cores ({world} ranks, {args.cores} cores)": score(shared, rows, args.fit_fraction, args.splits),
        f"gloo calls, shared cores ({world} ranks, {args.cores} cores)": score(
            gloo, rows, args.fit_fraction, args.splits
        ),
    }
    for name, model in zip(models, (base, shared, gloo)):
        models[name]["fitted_params"] = sorted(set(model.params.names()) - set(getattr(model, "unused_params", ())))
    result = {
        "profile": str(path),
        "num_plans": len(rows),
        "world_size": world,
        "cores": args.cores,
        "fit_fraction": args.fit_fraction,
        "splits": args.splits,
        "targets": {"mape_pct": 5.0, "best_plan_slowdown_pct": 5.0},
        "models": models,
        "measurement_noise_pct": measurement_noise_pct(rows),
        "per_layout_affine_fit_mape_pct": per_layout_affine_mape_pct(rows),
        "command": "python " + " ".join(["bench/throughput_model.py"] + sys.argv[1:]),
        "load_average": list(os.getloadavg()),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    names = list(models)
    print(
        f"\nplans {len(rows)}, fitted on {args.fit_fraction:.0%}, {args.splits} random splits; "
        f"world {world}, cores {args.cores}"
    )
    print("| metric | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for k in METRICS:
        print(f"| {k} | " + " | ".join(f"{models[n][k]:.3f}" for n in names) + " |")
    print(
        f"references: measurement noise of a plan's median {result['measurement_noise_pct']:.1f} %, "
        f"per-layout affine fit (15 parameters, in-sample) {result['per_layout_affine_fit_mape_pct']:.1f} %"
    )
    print("per-layout mean error (fit on all plans), %:")
    for n in names:
        print(f"  {n}: " + ", ".join(f"{k} {v:+.1f}" for k, v in models[n]["per_layout_error_pct"].items()))


if __name__ == "__main__":
    main()
