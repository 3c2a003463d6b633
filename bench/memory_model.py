"""Benchmark: the runtime's memory model against measured peaks, every plan of bench/layouts.py.

Hypothesis: `perf.runtime_memory_model` (core/cost/memory.py) predicts each plan's peak memory per
rank within 10 %. On a GPU the quantity is `torch.cuda.max_memory_allocated` (tensor bytes); on
CPU the process's resident set also holds things no device would: library code paged in on
first use, Python objects (DTensor's sharding caches, FSDP2 and pipeline records), glibc arenas.
So two measurements per plan, side by side:

- tensor bytes: the live CPU tensor storages at the start of the measured step (every tensor
  reachable from Python, distinct storages) plus the peak of c10's running total of allocated
  bytes during it, read from the profiler's allocation events (`profile_memory=True`; each
  event carries `total_allocated`) — the CPU analogue of the CUDA figure;
- RSS: the peak resident set (VmHWM, reset per plan) above the resident set before the build,
  over `--steps` further steps run without the profiler (its event buffers trimmed first).

Run: the plans `copus profile` (and so `bench/layouts.py`) enumerates for `--nproc` ranks, one
global batch and the micro-batch sizes; one engine per layout re-used for its micro-batchings
(as `copus profile`); per plan `--warmup` optimizer steps unmeasured (the first step's lazy
initialisation and AdamW state creation are not the steady state the model describes), then
`--steps` inside the profiler window of which the last is measured, random tokens, lr 0; the
maximum over ranks. `accounting_drift_bytes` (live tensor bytes after the measured step minus
before plus the events' net) checks the accounting: ≈ 0 when no block allocated before the
window was freed inside it. Model:
`runtime_memory_model(cfg, shape, "cpu")` (fp32, allocator overhead 0, no communicator term on CPU).

    python bench/memory_model.py [--nproc 4 --model tiny --global-batch 32 --micro-batch-sizes 1,2,4,8]
      → bench/results/memory_model.json, .md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from itertools import groupby
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return float(line.split()[1]) * 1024.0
    return float("nan")


def _trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _allocations(prof) -> list[tuple[int, int]]:
    """(time ns, c10's running total of allocated CPU bytes) of every allocation or free event,
    the total made relative to the window's start (the reporter's counter carries over from
    earlier profiler windows)."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            f = node.extra_fields
            out.append((node.start_time_ns, int(f.total_allocated), int(f.alloc_size)))
        stack.extend(node.children)
    out.sort()
    if not out:
        return []
    start = out[0][1] - out[0][2]
    return [(t, total - start) for t, total, _ in out]


def _live_tensor_bytes() -> int:
    """Bytes of every distinct CPU tensor storage reachable from Python (parameters, their FSDP2
    shards and buffers, gradients, AdamW moments, DTensor local tensors): the baseline a
    profiler window starts from."""
    import gc

    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            local = getattr(obj, "_local_tensor", None)
            t = local if isinstance(local, torch.Tensor) else obj
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if st.nbytes() and st.data_ptr():
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def _worker(rank: int, world: int, port: int, request: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from copus.config import load_config
    from copus.core.plan.plan import ParallelPlan
    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.engine import Engine, settings_from_config
    from copus.runtime.train.perf import runtime_memory_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, [f"model.name={request['model']!r}", f"parallel.nproc={world}"])
    shape = get_model_shape(cfg.model.name, cfg.model.seq_len)
    model = runtime_memory_model(cfg, shape, "cpu")
    meshes = MeshCache("cpu")
    plans = [ParallelPlan(**p) for p in request["plans"]]
    rows = []
    for _layout, group in groupby(plans, key=lambda p: p.layout):
        group = list(group)
        dist.barrier()
        _trim()
        base_rss = _status("VmRSS:")
        engine = Engine(shape, group[0], settings_from_config(cfg), "cpu", meshes, seed=0)
        for plan in group:
            engine.set_plan(plan)
            gen = torch.Generator().manual_seed(1234 + rank)
            rows_local = plan.micro_batch_size * plan.num_microbatches
            tokens = torch.randint(0, shape.vocab_size, (rows_local, shape.seq_len + 1), generator=gen)
            for _ in range(request["warmup"]):  # first-step work (lazy init, AdamW state) outside
                engine.train_step(tokens, lr=0.0)
            dist.barrier()
            # the profiler reports frees only of blocks allocated while it runs: the measured
            # step is the window's last, after `steps - 1` steps inside it (whatever they free
            # or allocate is then reported), counted from the live tensors at its start
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                for _ in range(request["steps"] - 1):
                    engine.train_step(tokens, lr=0.0)
                live, mark = _live_tensor_bytes(), time.time_ns()
                engine.train_step(tokens, lr=0.0)
            events = _allocations(prof)
            before = [total for t, total in events if t < mark]
            after = [total for t, total in events if t >= mark]
            start = before[-1] if before else 0
            peak = live + max(after, default=start) - start
            drift = _live_tensor_bytes() - (live + (after[-1] if after else start) - start)
            del prof
            _trim()  # the profiler's own memory out of the resident set, then steps without it
            dist.barrier()
            Path("/proc/self/clear_refs").write_text("5")
            for _ in range(request["steps"]):
                engine.train_step(tokens, lr=0.0)
            rss = _status("VmHWM:") - base_rss
            del tokens
            parts = model.breakdown(plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches)
            rows.append(
                {
                    "plan": plan.describe(),
                    "dp": plan.dp,
                    "tp": plan.tp,
                    "pp": plan.pp,
                    "micro_batch_size": plan.micro_batch_size,
                    "num_microbatches": plan.num_microbatches,
                    "tensor_peak_bytes": float(peak),
                    "live_before_bytes": float(live),
                    "accounting_drift_bytes": float(drift),
                    "rss_peak_above_base_bytes": rss,
                    "model_bytes": float(parts["total"]),
                    "model_parts": {k: float(v) for k, v in parts.items()},
                }
            )
            if rank == 0:
                print(
                    f"  {plan.describe():32s} tensors {peak / 2**20:7.1f} MB, model {parts['total'] / 2**20:7.1f} MB",
                    flush=True,
                )
        engine.close()
        del engine
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    dist.destroy_process_group()
    if rank == 0:
        out = []
        for per_rank in zip(*gathered, strict=True):
            row = dict(per_rank[0])
            for key in ("tensor_peak_bytes", "rss_peak_above_base_bytes"):
                row[key] = max(r[key] for r in per_rank)
                row[key.replace("_bytes", "_by_rank")] = [r[key] for r in per_rank]
            out.append(row)
        queue.put(out)


def run(nproc: int, request: dict) -> list[dict]:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, request, queue)) for r in range(nproc)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    return rows


def table(result: dict) -> str:
    mb = 2**20
    rows = result["rows"]
    lines = [
        f"# Memory model vs measured peak per rank: {result['model']}, {result['nproc']} CPU ranks (gloo), "
        f"B = {result['global_batch_size']}",
        "",
        f"`{result['command']}` — {result['note']}",
        "",
        "| plan | tensor peak (MB) | model (MB) | model / tensor peak | RSS peak above pre-build (MB) | model / RSS |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, m, rss = r["tensor_peak_bytes"], r["model_bytes"], r["rss_peak_above_base_bytes"]
        lines.append(f"| {r['plan']} | {t / mb:.1f} | {m / mb:.1f} | {m / t:.3f} | {rss / mb:.1f} | {m / rss:.3f} |")
    q = [r["model_bytes"] / r["tensor_peak_bytes"] for r in rows]
    q_rss = [r["model_bytes"] / r["rss_peak_above_base_bytes"] for r in rows]
    lines += [
        "",
        f"model / tensor peak: {min(q):.3f} – {max(q):.3f}; model / RSS: {min(q_rss):.3f} – {max(q_rss):.3f} "
        f"({len(rows)} plans)",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch-sizes", default="1,2,4,8")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="steps in the profiler window (>= 2): the last is measured")
    ap.add_argument("--name", default="memory_model")
    args = ap.parse_args()
    from copus.core.plan.plan import enumerate_plans
    from copus.core.specs.resolve import get_model_shape

    shape = get_model_shape(args.model)
    mbs = [int(x) for x in args.micro_batch_sizes.split(",")]
    plans = sorted(
        enumerate_plans(args.nproc, [args.global_batch], mbs, shape),
        key=lambda p: (p.layout, p.global_batch_size, p.micro_batch_size),
    )
    request = {
        "model": args.model,
        "warmup": args.warmup,
        "steps": args.steps,
        "plans": [
            {
                "dp": p.dp,
                "tp": p.tp,
                "pp": p.pp,
                "micro_batch_size": p.micro_batch_size,
                "num_microbatches": p.num_microbatches,
            }
            for p in plans
        ],
    }
    print(f"{len(plans)} plans of {args.model} on {args.nproc} ranks", flush=True)
    t0 = time.perf_counter()
    rows = run(args.nproc, request)
    result = {
        "command": "python bench/memory_model.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "nproc": args.nproc,
        "global_batch_size": args.global_batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "note": "2 shared CPU cores; max over ranks; one engine per layout",
        "wall_s": time.perf_counter() - t0,
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(result)
    (RESULTS / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
