"""Step time with gradient-statistics collection vs without, same processes, interleaved.

Two engines of the same plan live side by side on every rank; one keeps the `GradStats` hooks
(per-micro-batch squared norms, design §3), in the other they are removed. Steps alternate
between the two (ABBA order, so drift and warm-up hit both equally) on the same batch; the
printed ratio is median(step_s with stats) / median(step_s without). Target: ≤ 1.005. Also
timed: the wall time spent inside the hooks per step (rank 0), i.e. the statistics' direct
cost, which run-to-run noise does not blur ("direct ratio" = 1 + hook time / step time).

    python bench/gns_overhead.py [--nproc 2] [--steps 30] [--model tiny] [--batch 16] [--mbs 4]

Writes bench/results/gns_overhead.json. Timings on a shared or oversubscribed CPU are noisy;
the spread (interquartile range of the per-pair ratios) and the ratio of the fastest steps
(least disturbed by other processes) are reported beside the median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "gns_overhead.json"


class _NoStats:
    """Stand-in for GradStats with no hooks: the engine then collects nothing per micro-batch."""

    def __init__(self) -> None:
        self.kept: list = []

    def begin(self, num_microbatches: int, grad_scale: float) -> None:
        return None

    def small_sqnorm_sum(self):
        import torch

        return torch.zeros((), dtype=torch.float64)

    def close(self) -> None:
        return None


def bench_worker(cfg, run_dir: str, resume: bool) -> dict:
    """Entry on every rank (spawned by copus.runtime.train.launch)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.data.stream import GlobalSampler, build_datasets, local_slice
    from copus.runtime.engine.dist import MeshCache, init_distributed, shutdown
    from copus.runtime.engine.engine import Engine, EngineSettings
    from copus.runtime.train.trainer import initial_plan

    opts = json.loads(Path(run_dir, "bench_opts.json").read_text())
    device = init_distributed(backend=cfg.parallel.backend)
    shape = get_model_shape(cfg.model.name)
    world = dist.get_world_size()
    plan = initial_plan(cfg, world, shape)
    cache = MeshCache(device.type)
    engines = {name: Engine(shape, plan, EngineSettings(), device, cache, seed=0) for name in ("with", "without")}
    engines["without"].stats.close()
    engines["without"].stats = _NoStats()
    hook_s = _time_hooks(engines["with"].stats)
    train, _, _ = build_datasets(cfg.data, shape.seq_len, shape.vocab_size)
    ids = GlobalSampler(len(train), 0).ids(0, plan.global_batch_size)
    local = local_slice(ids, engines["with"].dp_rank, plan.dp)
    tokens = torch.from_numpy(train.batch(local).astype(np.int64)).to(device)
    times: dict[str, list[float]] = {"with": [], "without": []}
    in_hooks: list[float] = []
    order = ["with", "without", "without", "with"]
    for i in range(opts["warmup"] + opts["steps"]):
        for name in order[:2] if i % 2 == 0 else order[2:]:
            dist.barrier()
            hook_s[0] = 0.0
            t0 = time.perf_counter()
            engines[name].train_step(tokens, 1e-3)
            if name == "with" and i >= opts["warmup"]:
                in_hooks.append(hook_s[0])
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= opts["warmup"]:
                times[name].append(float(t))
    for e in engines.values():
        e.close()
    shutdown()
    return {"times": times, "plan": plan.describe(), "world_size": world, "in_hooks_s": statistics.median(in_hooks)}


def _time_hooks(stats) -> list[float]:
    """Wrap `stats._record` (the per-micro-batch hook body) and the per-step sum to add their
    wall time into the
    returned box: the direct cost of the statistics, free of the run-to-run noise (on CPU the
    work is synchronous, so the time inside is the time it costs)."""
    box = [0.0]
    record = stats._record

    def timed(pid, g):
        t0 = time.perf_counter()
        record(pid, g)
        box[0] += time.perf_counter() - t0

    def timed_sum():
        t0 = time.perf_counter()
        out = total()
        box[0] += time.perf_counter() - t0
        return out

    total = stats.small_sqnorm_sum
    stats._record = timed
    stats.small_sqnorm_sum = timed_sum
    return box


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    import tempfile

    from copus.config import load_config
    from copus.runtime.train.launch import launch

    cfg = load_config(
        None,
        [
            f"parallel.nproc={args.nproc}",
            f"model.name='{args.model}'",
            f"batch.initial={args.batch}",
            "batch.min=1",
            f"batch.max={max(args.batch, 256)}",
            f"parallel.micro_batch_size={args.mbs}",
            "data.max_chars=400000",
        ],
    )
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "bench_opts.json").write_text(json.dumps({"steps": args.steps, "warmup": args.warmup}))
        res = launch(cfg, tmp, max_restarts=0, entry=bench_worker)
    w, wo = res["times"]["with"], res["times"]["without"]
    pairs = sorted(a / b for a, b in zip(w, wo, strict=True))
    q1, q3 = pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]
    ratio = statistics.median(w) / statistics.median(wo)
    out = {
        "bench": "gns_overhead",
        "model": args.model,
        "plan": res["plan"],
        "world_size": res["world_size"],
        "steps": args.steps,
        "median_step_s_with_stats": statistics.median(w),
        "median_step_s_without_stats": statistics.median(wo),
        "ratio": ratio,
        "pair_ratio_median": statistics.median(pairs),
        "min_step_s_with_stats": min(w),
        "min_step_s_without_stats": min(wo),
        "ratio_of_minima": min(w) / min(wo),
        "median_s_in_hooks_rank0": res["in_hooks_s"],
        "direct_ratio": 1.0 + res["in_hooks_s"] / statistics.median(wo),
        "pair_ratio_iqr": [q1, q3],
        "target": 1.005,
        "meets_target": ratio <= 1.005,
        "host": platform.node(),
        "python": sys.version.split()[0],
        "load_average_1min_after": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'plan':<24}{'with stats':>12}{'without':>12}{'ratio':>9}{'pair IQR':>18}")
    print(
        f"{res['plan']:<24}{out['median_step_s_with_stats'] * 1e3:>10.1f}ms"
        f"{out['median_step_s_without_stats'] * 1e3:>10.1f}ms{ratio:>9.4f}"
        f"{'[%.3f, %.3f]' % (q1, q3):>18}"
    )
    print(f"ratio of minima (least disturbed steps): {min(w) / min(wo):.4f}")
    print(
        f"time inside the hooks (rank 0): {res['in_hooks_s'] * 1e3:.2f} ms/step -> direct ratio "
        f"{out['direct_ratio']:.4f}"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
