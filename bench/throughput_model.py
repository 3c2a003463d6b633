"""How well does the fitted step-time model predict plans it never saw? (issue 5)

    python bench/throughput_model.py                     # profile all plans at 4 ranks, then fit
    python bench/throughput_model.py --profile prof.json # reuse a `copus profile` table

Profiles every valid plan of the tiny model at 4 CPU ranks (`copus profile`), fits
`copus.core.fit.fit_model` on a random 30% of them, and reports the mean absolute percentage
error (MAPE) of the predicted step time on the other 70%; repeated over `--splits` random
splits, median reported. Target: MAPE ≤ 5%. JSON: bench/results/throughput_model.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from copus.core.fit import fit_model, prior_model
from copus.core.models import get_model_shape
from copus.core.plan import ParallelPlan

RESULTS = Path(__file__).resolve().parent / "results"


def profile(args) -> Path:
    out = RESULTS / "throughput_model_profile"
    cmd = [sys.executable, "-m", "copus", "profile", "--nproc", str(args.nproc), "--model", args.model,
           "--global-batch", args.global_batch, "--micro-batch-sizes", args.micro_batch_sizes,
           "--steps", str(args.steps), "--warmup", "1", "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return out / "profile.json"


def mape(model, rows: list[dict]) -> float:
    cols = [np.array([r[k] for r in rows]) for k in ("dp", "tp", "pp", "micro_batch_size", "num_microbatches")]
    pred = model.predict(*cols)
    meas = np.array([r["step_s"] for r in rows])
    return float(np.mean(np.abs(pred - meas) / meas) * 100.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="existing profile.json (skip profiling)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--global-batch", default="8,16,32,64")
    ap.add_argument("--micro-batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fit-fraction", type=float, default=0.3)
    ap.add_argument("--splits", type=int, default=20)
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(args.profile) if args.profile else profile(args)
    rows = json.loads(path.read_text())
    shape = get_model_shape(args.model)
    world = rows[0]["dp"] * rows[0]["tp"] * rows[0]["pp"]
    base = prior_model(shape, None, world)
    errors, train_errors = [], []
    n_fit = max(1, int(round(args.fit_fraction * len(rows))))
    for split in range(args.splits):
        shuffled = rows[:]
        random.Random(split).shuffle(shuffled)
        fit_rows, test_rows = shuffled[:n_fit], shuffled[n_fit:]
        obs = [(ParallelPlan(**{k: r[k] for k in ("dp", "tp", "pp", "micro_batch_size", "num_microbatches")}),
                r["step_s"]) for r in fit_rows]
        model = fit_model(obs, base)
        errors.append(mape(model, test_rows))
        train_errors.append(mape(model, fit_rows))
    result = {"profile": str(path), "num_plans": len(rows), "num_fit": n_fit, "splits": args.splits,
              "mape_heldout_median_pct": statistics.median(errors),
              "mape_heldout_min_pct": min(errors), "mape_heldout_max_pct": max(errors),
              "mape_fit_median_pct": statistics.median(train_errors),
              "prior_mape_pct": mape(base, rows), "target_pct": 5.0}
    (RESULTS / "throughput_model.json").write_text(json.dumps(result, indent=1))
    print(f"\nplans {len(rows)}, fitted on {n_fit} ({args.fit_fraction:.0%}), {args.splits} random splits")
    print("| metric | value |\n|---|---|")
    for k in ("mape_heldout_median_pct", "mape_heldout_min_pct", "mape_heldout_max_pct",
              "mape_fit_median_pct", "prior_mape_pct"):
        print(f"| {k} | {result[k]:.2f} |")


if __name__ == "__main__":
    main()
