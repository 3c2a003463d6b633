"""Benchmark: in-process layout switch vs checkpoint-restart for the same transitions.

Both paths move the same model + AdamW state from layout X to layout Y on `--nproc` local gloo
ranks (CPU) started by torch's elastic launcher, the launcher `copus train` uses.

- in-process (`copus.runtime.reconfigure.switch_engine`): one job; after 2 warm-up steps it
  cycles through the transitions `--repeats` times. Timed: stage (DCP save to /dev/shm),
  teardown (close + gc), build (cached mesh, model, wrappers, optimizer), load (DCP reshard),
  the slowest rank's wall time. Then the first step under the new plan and the median of 2 more
  (the plan's step time).
- checkpoint-restart: per transition and repeat, job 1 builds X, takes 1 step, and, from a barrier
  on, writes an atomic checkpoint (`runtime/checkpoint.save`: DCP + manifest + fsync) and exits;
  the parent starts job 2 (new agent, rendezvous, spawned workers, `import torch`, process group)
  which builds Y, verifies and loads the checkpoint resharded, and reaches a barrier. Timed:
  barrier before the save → barrier after the load (wall clock, same host), and to the end of
  the first step. NOT included (so the restart figure is a lower bound for `copus train`):
  dataset loading/tokenising and the trainer's own set-up after a restart.

Figures: median over repeats per transition; ratio = restart / in-process (to ready, and to the
end of the first step); in-process switch in units of the new plan's step time.
Target (issue 11): in-process ≥ 10× faster than checkpoint-restart and ≤ 3 step times
(COPUS reports 2.3–15.7×).

Writes bench/results/reconfigure.json and prints a table.
Run: /work/venv/bin/python bench/reconfigure.py [--repeats 3] [--model tiny] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "results" / "reconfigure.json"
TRANSITIONS = ("dp4>dp2tp2", "dp2tp2>pp2dp2", "pp2dp2>dp4")


def parse_layout(text: str) -> tuple[int, int, int]:
    """"dp2tp2" → (dp, tp, pp) = (2, 2, 1); missing degrees are 1."""
    import re

    deg = {k: int(v) for k, v in re.findall(r"(dp|tp|pp)(\d+)", text)}
    if not deg or "".join(f"{k}{v}" for k, v in re.findall(r"(dp|tp|pp)(\d+)", text)) != text:
        raise ValueError(f"layout {text!r} is invalid; allowed: e.g. 'dp4', 'dp2tp2', 'pp2dp2'")
    return deg.get("dp", 1), deg.get("tp", 1), deg.get("pp", 1)


def make_plan(layout: str, batch: int, nproc: int):
    from copus.core.plan import ParallelPlan

    dp, tp, pp = parse_layout(layout)
    if dp * tp * pp != nproc or batch % dp:
        raise ValueError(f"layout {layout!r} with batch {batch}: allowed: dp·tp·pp = {nproc} "
                         "and dp dividing the batch")
    per = batch // dp
    mbs = max(m for m in range(1, min(4, per) + 1) if per % m == 0 and per // m >= pp)
    return ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=per // mbs)


# ------------------------------------------------------------------------------------ workers

def _setup(args: dict, layout: str):
    import torch
    import torch.distributed as dist

    from copus.core.models import get_model_shape
    from copus.runtime.dist import MeshCache, init_distributed
    from copus.runtime.engine import Engine, EngineSettings

    device = init_distributed()
    shape = get_model_shape(args["model"])
    cache = MeshCache(device.type)

    def build(plan):
        return Engine(shape, plan, EngineSettings(), device, cache, seed=0)

    def step(engine, i: int) -> float:
        """One optimizer step on a fixed batch; returns the slowest rank's wall time."""
        g = torch.Generator().manual_seed(i)
        p = engine.plan
        rows = p.micro_batch_size * p.num_microbatches
        tokens = torch.randint(0, shape.vocab_size, (rows, shape.seq_len + 1), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_step(tokens, 1e-3)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    plan = make_plan(layout, args["batch"], dist.get_world_size())
    return build, step, plan


def in_process_worker(args: dict) -> dict:
    """One job: warm up, then cycle through the transitions `repeats` times."""
    import warnings

    warnings.filterwarnings("ignore")
    from copus.runtime.dist import shutdown
    from copus.runtime.reconfigure import switch_engine

    first = args["transitions"][0].split(">")[0]
    build, step, plan = _setup(args, first)
    engine = build(plan)
    step(engine, 0)
    step(engine, 1)
    rows, i = [], 2
    for rep in range(args["repeats"]):
        for tr in args["transitions"]:
            src, dst = tr.split(">")
            if engine.plan.layout != make_plan(src, args["batch"], args["nproc"]).layout:
                raise ValueError(f"transitions must chain: {tr!r} does not start at "
                                 f"{engine.plan.describe()}")
            new_plan = make_plan(dst, args["batch"], args["nproc"])
            engine, report = switch_engine(engine, new_plan, build)
            first_s = step(engine, i)
            steady = [step(engine, i + 1), step(engine, i + 2)]
            i += 3
            rows.append({"transition": tr, "repeat": rep, **report.to_dict(),
                         "first_step_s": first_s, "step_s": float(np.median(steady))})
    engine.close()
    shutdown()
    return {"rows": rows}


def restart_save_worker(args: dict) -> dict:
    """Job 1 of a restart: build X, one step, then (timed from a barrier) checkpoint and exit."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from copus.runtime import checkpoint as ckpt
    from copus.runtime.dist import shutdown

    build, step, plan = _setup(args, args["src"])
    engine = build(plan)
    step(engine, 0)
    dist.barrier()
    t_start = time.time()
    model_sd, optim_sd = engine.state_dicts()
    ckpt.save(args["ckpt"], 1, {"model": model_sd, "optim": optim_sd}, {"step": 1})
    engine.close()
    shutdown()
    return {"t_start": t_start}


def restart_load_worker(args: dict) -> dict:
    """Job 2 of a restart: build Y, load the checkpoint resharded; times to ready / first step."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from copus.runtime import checkpoint as ckpt
    from copus.runtime.dist import shutdown

    t_entry = time.time()
    build, step, plan = _setup(args, args["dst"])
    engine = build(plan)
    model_sd, optim_sd = engine.state_dicts()
    state = {"model": model_sd, "optim": optim_sd}
    ckpt.load(Path(args["ckpt"]) / "step-1", state)
    engine.load_state(state["model"], state["optim"])
    dist.barrier()
    t_ready = time.time()
    first_s = step(engine, 1)
    t_first = time.time()
    engine.close()
    shutdown()
    return {"t_entry": t_entry, "t_ready": t_ready, "t_first": t_first, "first_step_s": first_s}


def launch(entry, args: dict, nproc: int) -> dict:
    """Run `entry(args)` on `nproc` spawned ranks (elastic agent as in copus train); rank 0's."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from copus.runtime.launch import free_port

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"bench-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_configs={"timeout": 120},
                          max_restarts=0, monitor_interval=0.2, start_method="spawn",
                          local_addr="127.0.0.1")
    return elastic_launch(config, entry)(args)[0]


# ------------------------------------------------------------------------------------ main

def checkpoint_restart(args: dict, tr: str, rep: int, root: Path) -> dict:
    src, dst = tr.split(">")
    folder = root / f"{tr.replace('>', '-')}-{rep}"
    job = {**args, "src": src, "dst": dst, "ckpt": str(folder)}
    saved = launch(restart_save_worker, job, args["nproc"])
    loaded = launch(restart_load_worker, job, args["nproc"])
    shutil.rmtree(folder, ignore_errors=True)
    return {"transition": tr, "repeat": rep, "restart_s": loaded["t_ready"] - saved["t_start"],
            "restart_to_first_step_s": loaded["t_first"] - saved["t_start"],
            "spawn_to_entry_s": loaded["t_entry"] - saved["t_start"],
            "first_step_s": loaded["first_step_s"]}


def summarise(inproc: list[dict], restart: list[dict], transitions: list[str],
              nproc: int) -> list[dict]:
    """Medians per transition and over all transitions ("all"), with the ratios."""
    out = []
    for tr in [*transitions, "all"]:
        a = [r for r in inproc if tr in ("all", r["transition"])]
        b = [r for r in restart if tr in ("all", r["transition"])]

        def med(rows, key):
            return float(np.median([r[key] for r in rows]))

        row = {"transition": tr, "in_process_s": med(a, "wall_s"),
               "in_process_to_first_step_s": float(np.median(
                   [r["wall_s"] + r["first_step_s"] for r in a])),
               **{k: med(a, k) for k in ("stage_s", "teardown_s", "build_s", "load_s",
                                         "step_s", "rss_before_mb", "rss_peak_mb")},
               "state_mb_per_rank": float(np.median([r["staged_bytes"] for r in a])) / nproc / 2**20,
               "rss_peak_delta_mb": float(np.median(
                   [r["rss_peak_mb"] - r["rss_before_mb"] for r in a])),
               "restart_s": med(b, "restart_s"),
               "restart_until_worker_entry_s": med(b, "spawn_to_entry_s"),
               "restart_to_first_step_s": med(b, "restart_to_first_step_s")}
        row["ratio"] = row["restart_s"] / row["in_process_s"]
        row["ratio_to_first_step"] = (row["restart_to_first_step_s"]
                                      / row["in_process_to_first_step_s"])
        row["switch_in_steps"] = row["in_process_s"] / row["step_s"]
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transitions", default=",".join(TRANSITIONS),
                    help="chained layout changes, e.g. dp4>dp2tp2,dp2tp2>pp2dp2,pp2dp2>dp4")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--from-json", default="", help="re-summarise a saved result, run nothing")
    ns = ap.parse_args()
    if ns.from_json:
        result = json.loads(Path(ns.from_json).read_text())
        result["summary"] = summarise(result["in_process"], result["checkpoint_restart"],
                                      list(dict.fromkeys(r["transition"]
                                                         for r in result["in_process"])),
                                      result["nproc"])
        report(result, Path(ns.out))
        return
    transitions = ns.transitions.split(",")
    for tr in transitions:
        for layout in tr.split(">"):
            make_plan(layout, ns.batch, ns.nproc)
    args = {"model": ns.model, "nproc": ns.nproc, "batch": ns.batch, "repeats": ns.repeats,
            "transitions": transitions}
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    inproc = launch(in_process_worker, args, ns.nproc)["rows"]
    root = Path(tempfile.mkdtemp(prefix="copus-bench-restart-"))
    try:
        restart = [checkpoint_restart(args, tr, rep, root)
                   for rep in range(ns.repeats) for tr in transitions]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarise(inproc, restart, transitions, ns.nproc)
    result = {"bench": "reconfigure", "model": ns.model, "nproc": ns.nproc, "batch": ns.batch,
              "repeats": ns.repeats, "backend": "gloo", "device": "cpu",
              "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg()[0]},
              "target": {"ratio_min": 10.0, "switch_in_steps_max": 3.0},
              "bench_s": time.perf_counter() - t0, "summary": summary,
              "in_process": inproc, "checkpoint_restart": restart}
    report(result, Path(ns.out))


def report(result: dict, out: Path) -> None:
    """Write the JSON and print the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    host = result["host"]
    print(f"{result['model']}, {result['nproc']} gloo ranks, B={result['batch']}, median of "
          f"{result['repeats']} (load avg {host['loadavg_before']:.1f} on {host['cpus']} CPUs)")
    head = ("transition", "in-proc s", "stage", "teardn", "build", "load", "restart s", "ratio",
            "+1st step", "step s", "switch/step", "peak ΔMB", "state MB")
    print(" ".join(f"{h:>13}" if i == 0 else f"{h:>9}" for i, h in enumerate(head)))
    for r in result["summary"]:
        vals = (r["in_process_s"], r["stage_s"], r["teardown_s"], r["build_s"], r["load_s"],
                r["restart_s"], r["ratio"], r["ratio_to_first_step"], r["step_s"],
                r["switch_in_steps"], r["rss_peak_delta_mb"], r["state_mb_per_rank"])
        print(f"{r['transition']:>13} " + " ".join(f"{v:9.3f}" for v in vals))
    print(f"ratio = restart / in-process to ready; '+1st step' = the same ratio including the first "
          f"step; peak ΔMB = per-rank RSS peak during the switch − before; state MB = staged "
          f"model+AdamW state per rank\nwrote {out}")


if __name__ == "__main__":
    main()
