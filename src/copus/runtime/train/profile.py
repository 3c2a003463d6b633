"""`copus profile`: timed steps of many parallel plans in one set of worker processes.

Each worker builds one `Engine` per layout (dp, tp, pp) and re-uses it for every micro-batching
of that layout (`Engine.set_plan`), runs `warmup` untimed and `steps` timed optimizer steps on
random tokens, barrier to barrier, and records the median step time and the peak memory:
`torch.cuda.max_memory_allocated` on GPUs; on CPU the peak resident set size (VmHWM), reset
before each plan by writing 5 to /proc/self/clear_refs (Linux; the max over ranks is kept).
Learning rate 0, so no plan changes the weights the next one starts from.
"""

from __future__ import annotations

import json
import statistics
import time
from itertools import groupby
from pathlib import Path

import torch
import torch.distributed as dist

from copus.config import Config
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan
from copus.runtime.engine.dist import max_over_ranks

REQUEST = "profile_request.json"


def write_request(run_dir: Path, plans: list[ParallelPlan], steps: int, warmup: int) -> None:
    rows = [
        {
            "dp": p.dp,
            "tp": p.tp,
            "pp": p.pp,
            "micro_batch_size": p.micro_batch_size,
            "num_microbatches": p.num_microbatches,
        }
        for p in plans
    ]
    (run_dir / REQUEST).write_text(json.dumps({"plans": rows, "steps": steps, "warmup": warmup}))


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024.0
    except OSError:
        pass
    return float("nan")


def time_plan(engine, plan: ParallelPlan, steps: int, warmup: int, device: torch.device) -> dict:
    """Median barrier-to-barrier step time and peak memory of `plan` on `engine`'s layout."""
    engine.set_plan(plan)
    seq = engine.shape.seq_len
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    rows = plan.micro_batch_size * plan.num_microbatches
    tokens = torch.randint(0, engine.shape.vocab_size, (rows, seq + 1), generator=gen)
    _reset_peak(device)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_step(tokens, lr=0.0)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {
        "dp": plan.dp,
        "tp": plan.tp,
        "pp": plan.pp,
        "micro_batch_size": plan.micro_batch_size,
        "num_microbatches": plan.num_microbatches,
        "global_batch_size": plan.global_batch_size,
        "step_s": step_s,
        "step_s_all": times,
        "samples_per_s": plan.global_batch_size / step_s,
        "tokens_per_s": plan.global_batch_size * seq / step_s,
        "peak_memory_bytes": max_over_ranks(_peak_bytes(device), device),
    }


def profile_worker(cfg: Config, run_dir: str, resume: bool = False) -> dict:
    """Entry point on every rank (see `copus.runtime.train.launch.launch`); rank 0 returns the rows."""
    from copus.runtime.engine.dist import MeshCache, init_distributed, shutdown
    from copus.runtime.engine.engine import Engine, settings_from_config

    request = json.loads((Path(run_dir) / REQUEST).read_text())
    device = init_distributed(backend=cfg.parallel.backend, timeout_s=cfg.train.nccl_timeout_s)
    shape = get_model_shape(cfg.model.name, cfg.model.seq_len)
    settings = settings_from_config(cfg)
    meshes = MeshCache(device.type)
    plans = [ParallelPlan(**p) for p in request["plans"]]
    rows = []
    try:
        for _layout, group in groupby(plans, key=lambda p: p.layout):
            group = list(group)
            engine = Engine(shape, group[0], settings, device, meshes, seed=cfg.train.seed)
            for plan in group:
                rows.append(time_plan(engine, plan, request["steps"], request["warmup"], device))
                if dist.get_rank() == 0:
                    r = rows[-1]
                    print(
                        f"  {plan.describe():32s} {r['step_s'] * 1e3:9.1f} ms/step {r['tokens_per_s']:10.0f} tokens/s",
                        flush=True,
                    )
            engine.close()
            del engine
    finally:
        shutdown()
    return {"rows": rows}
