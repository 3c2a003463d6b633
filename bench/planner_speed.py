"""Benchmark: how fast the planner ranks ≥ 10,000 candidate plans (design §4: "in milliseconds").

For each scenario: build the candidate set once (enumeration + memory pruning), then time, as
the median of `--repeats` runs,
- rank_ms:    predict every candidate's step time + goodput + full sort (also its min, and the
              split into predict_ms and goodput_sort_ms);
- decide_ms:  `core.search.evaluate` from the smallest batch: the growth cap is applied first,
              so only the allowed candidates are predicted (+ amortisation, hysteresis, top-5).
Target: rank_ms ≤ 10 for ≥ 10,000 candidates; with the plan options of issue 25 (AC mode,
pipeline schedule + virtual stages, sequence parallel, reshard-after-forward: 48 option sets
per plan, `core.plan.goodput.option_grid`), rank_ms ≤ 100 for ≥ 100,000 candidates.

Writes bench/results/planner_speed.json and prints a table.
Run: /work/venv/bin/python bench/planner_speed.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from copus.core.plan.goodput import build_candidates, goodput, option_grid, rank
from copus.core.specs.hardware import get_hardware
from copus.core.cost.memory import MemoryModel
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.search import evaluate
from copus.core.cost.throughput import StepTimeModel

OUT = Path(__file__).resolve().parent / "results" / "planner_speed.json"
TARGET_MS = 10.0
TARGET_OPTIONS_MS = 100.0
ALL_OPTIONS = option_grid(
    schedules=("1f1b", "gpipe", "interleaved-1f1b"),
    virtual_stages=(2, 4),
    sequence_parallel=(False, True),
    reshard_after_forward=(True, False),
)

SCENARIOS = [
    # name, model, hardware, world, min B, max B, micro-batch sizes, batch grid
    ("3b-8xh100-pairs", "llama-3.2-3b", "h100-nvlink-pairs", 8, 16, 1024, (1, 2, 4, 8, 16, 32, 64), "multiples"),
    ("7b-32xmi210", "llama-2-7b", "mi210", 32, 16, 2048, (1, 2, 4, 8, 16), "multiples"),
    ("32b-1024xh100", "qwen-2.5-32b", "h100-sxm", 1024, 512, 65536, (1, 2, 4, 8), "geometric"),
    # issue 25: every plan × 48 option sets, ranked jointly; no memory pruning (to count them all)
    ("32b-256xh100-opts", "qwen-2.5-32b", "h100-sxm", 256, 512, 1024, (1, 2, 4, 8), "multiples", "options"),
]


def _times_ms(fn, repeats: int) -> tuple[float, float]:
    """(median, min) wall time of `fn` in ms; the min is the figure least hurt by other load."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3), float(np.min(times) * 1e3)


def bench(name, model_name, hw_name, world, min_b, max_b, mbs, grid, *rest) -> dict:
    *flags, repeats = rest
    options = ALL_OPTIONS if "options" in flags else None
    shape = get_model_shape(model_name)
    hw = get_hardware(hw_name)
    memory = MemoryModel(shape=shape, mixed_precision=hw.dtype_bytes == 2)
    t0 = time.perf_counter()
    cands = build_candidates(
        world,
        shape,
        min_batch=min_b,
        max_batch=max_b,
        micro_batch_sizes=mbs,
        batch_grid=grid,
        memory_model=memory,
        memory_capacity_bytes=None if options else hw.memory_bytes,
        options=options,
    )
    build_ms = (time.perf_counter() - t0) * 1e3
    model = StepTimeModel.analytic(shape, hw, world)
    b_noise = 4.0 * min_b
    current = cands.plan(int(np.argmin(cands.global_batch_size)))

    def rank_all():
        step_s = cands.predict_step_s(model)
        return rank(goodput(step_s, cands.global_batch_size, b_noise), step_s)

    def decide():
        return evaluate(cands, model, b_noise, current, elapsed_s=600.0, reconfig_cost_s=30.0)

    step_s = cands.predict_step_s(model)
    rank_ms, rank_min_ms = _times_ms(rank_all, repeats)
    predict_ms, _ = _times_ms(lambda: cands.predict_step_s(model), repeats)
    score_ms, _ = _times_ms(lambda: rank(goodput(step_s, cands.global_batch_size, b_noise), step_s), repeats)
    decide_ms, _ = _times_ms(decide, repeats)
    best = cands.plan(int(rank_all()[0]))
    return {
        "scenario": name,
        "model": model_name,
        "hardware": hw_name,
        "world_size": world,
        "batch_range": [min_b, max_b],
        "batch_grid": grid,
        "num_candidates": len(cands),
        "build_ms": build_ms,
        "rank_ms": rank_ms,
        "rank_min_ms": rank_min_ms,
        "predict_ms": predict_ms,
        "goodput_sort_ms": score_ms,
        "decide_ms": decide_ms,
        "best_plan": best.describe(),
        "repeats": repeats,
        "option_sets": len(options or [None]),
        "target_ms": TARGET_OPTIONS_MS if options else TARGET_MS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    rows = [bench(*sc, args.repeats) for sc in SCENARIOS]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "target_rank_ms": TARGET_MS,
                "target_rank_ms_options": TARGET_OPTIONS_MS,
                "machine": platform.processor() or platform.machine(),
                "load_average": os.getloadavg(),
                "cpu_count": os.cpu_count(),
                "results": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(
        f"{'scenario':<18} {'candidates':>10} {'build ms':>9} {'rank ms':>8} {'(min)':>6} "
        f"{'predict':>8} {'sort':>6} {'decide ms':>9}  best plan"
    )
    for r in rows:
        ok = "" if r["num_candidates"] < 10_000 or r["rank_ms"] <= r["target_ms"] else "  (over target)"
        print(
            f"{r['scenario']:<18} {r['num_candidates']:>10} {r['build_ms']:>9.1f} "
            f"{r['rank_ms']:>8.2f} {r['rank_min_ms']:>6.2f} {r['predict_ms']:>8.2f} "
            f"{r['goodput_sort_ms']:>6.2f} {r['decide_ms']:>9.2f}  {r['best_plan']}{ok}"
        )
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
