"""Benchmark: layout switch by the direct path vs DCP staging vs checkpoint-restart.

All three move the same model + AdamW state from layout X to layout Y on `--nproc` local ranks
(gloo on CPU, NCCL on GPU: the device follows `init_distributed`) started by torch's elastic
launcher, the launcher `copus train` uses.

- direct (`switch_engine(path="direct")`, runtime/state/redistribute.py): shards move between the
  layouts in memory. Phases: build (meta model, wrappers, then optimizer), plan (describe both
  layouts: digests + one broadcast per distinct description), move (per bucket: materialise, all_to_all_single, free),
  teardown. Bytes moved between ranks and copied within ranks are counted.
- dcp (`switch_engine(path="dcp")`): stage (DCP save to /dev/shm), teardown, build, load.
- checkpoint-restart (models only): per transition and repeat, job 1 builds X, takes 1 step and,
  from a barrier on, writes an atomic checkpoint and exits; job 2 (new agent, rendezvous, spawned
  workers, import, process group) builds Y, loads it resharded and reaches a barrier. Dataset
  loading and the trainer's own set-up are NOT included (a lower bound for `copus train`).

One in-process job per model alternates the two in-process paths over the chained transitions
(`--repeats` times each, in alternating order), so both see the same load. `--model` takes a
named model (tiny, small: a step follows every switch, giving the plan's step time) or
`synthetic:GB` (a Llama-like state of GB gigabytes — weights + AdamW moments, all ranks together
— with Adam state made by one step on constant gradients; no training steps). Every job also
measures, on the same ranks, the all_to_all_single bandwidth (bytes that cross ranks, all ranks
together) and the concurrent memcpy bandwidth; `floor_s = moved / a2a_bw + local / copy_bw` is
the time the direct path's bytes would need at those rates.

Goals (issue 17, CPU): tiny direct ≥ 40× faster than checkpoint-restart and ≤ 1 step time;
synthetic: direct wall ≤ 3 · floor_s + c with c ≤ 0.2 s (c, k also fitted over the sizes).

Writes bench/results/reconfigure.json (all models of the run) and prints tables.
Run: python bench/reconfigure.py [--models tiny,small,synthetic:0.1,synthetic:0.5,synthetic:1]
     [--repeats 3] [--no-restart]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "results" / "reconfigure.json"
TRANSITIONS = ("dp4>dp2tp2", "dp2tp2>pp2dp2", "pp2dp2>dp4")


def parse_layout(text: str) -> tuple[int, int, int]:
    """ "dp2tp2" → (dp, tp, pp) = (2, 2, 1); missing degrees are 1."""
    import re

    deg = {k: int(v) for k, v in re.findall(r"(dp|tp|pp)(\d+)", text)}
    if not deg or "".join(f"{k}{v}" for k, v in re.findall(r"(dp|tp|pp)(\d+)", text)) != text:
        raise ValueError(f"layout {text!r} is invalid; allowed: e.g. 'dp4', 'dp2tp2', 'pp2dp2'")
    return deg.get("dp", 1), deg.get("tp", 1), deg.get("pp", 1)


def make_plan(layout: str, batch: int, nproc: int):
    from copus.core.plan.plan import ParallelPlan

    dp, tp, pp = parse_layout(layout)
    if dp * tp * pp != nproc or batch % dp:
        raise ValueError(f"layout {layout!r} with batch {batch}: allowed: dp·tp·pp = {nproc} and dp dividing the batch")
    per = batch // dp
    mbs = max(m for m in range(1, min(4, per) + 1) if per % m == 0 and per // m >= pp)
    return ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=per // mbs)


# ------------------------------------------------------------------------------------ shapes


def synthetic_shape(gb: float):
    """A Llama-like shape whose weights + 2 AdamW moments (fp32, 12 B/parameter) total about
    `gb` GB: dim 1024, ffn 4096 (16.8M parameters per block, ~201 MB of state); for < 0.3 GB
    dim 512, ffn 2048 (~50 MB per block). At least 2 blocks (pp2)."""
    from copus.core.specs.models import ModelShape

    dim, ffn = (1024, 4096) if gb >= 0.3 else (512, 2048)
    per_block = 12 * (4 * dim * dim + 3 * dim * ffn)
    layers = max(2, round(gb * 1e9 / per_block))
    return ModelShape(
        name=f"synthetic-{gb:g}GB",
        n_layers=layers,
        dim=dim,
        n_heads=dim // 64,
        n_kv_heads=dim // 64,
        ffn_dim=ffn,
        vocab_size=256,
        seq_len=16,
    )


def model_shape(name: str):
    from copus.core.specs.resolve import get_model_shape

    return synthetic_shape(float(name.split(":", 1)[1])) if name.startswith("synthetic:") else get_model_shape(name)


# ------------------------------------------------------------------------------------ workers


def _setup(args: dict, layout: str):
    import torch
    import torch.distributed as dist

    from copus.runtime.engine.dist import MeshCache, init_distributed
    from copus.runtime.engine.engine import Engine, EngineSettings

    device = init_distributed()
    shape = model_shape(args["model"])
    cache = MeshCache(device.type)

    def build(plan, allocate=True, init=True):
        return Engine(shape, plan, EngineSettings(), device, cache, seed=0, allocate=allocate, init=init)

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


def fake_adam_step(engine) -> None:
    """AdamW state (step, exp_avg, exp_avg_sq) from one step on constant gradients: the state a
    switch moves, without the cost of a forward/backward of a large model."""
    import torch

    for p in engine.model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-4
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)


def _slowest(seconds: float, device) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.cpu())


def bandwidths(nbytes: int, device, repeats: int = 3) -> dict:
    """Aggregate (all ranks together) bytes/s of all_to_all_single (bytes that cross ranks)
    and of concurrent memcpy, with `nbytes` per rank; medians of `repeats`."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    n = max(nbytes // 4 // world * world, world)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    a2a, copy = [], []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(dst, src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        a2a.append(_slowest(time.perf_counter() - t0, device))
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        copy.append(_slowest(time.perf_counter() - t0, device))
    crossing = n * 4 * (world - 1) / world * world
    return {
        "bytes_per_rank": n * 4,
        "a2a_Bps": crossing / float(np.median(a2a[1:])),
        "copy_Bps": n * 4 * world / float(np.median(copy[1:])),
    }


def in_process_worker(args: dict) -> dict:
    """One job: warm up, then cycle through the transitions by both in-process paths."""
    import warnings

    warnings.filterwarnings("ignore")
    from copus.runtime.engine.dist import shutdown
    from copus.runtime.state.reconfigure import state_bytes, switch_engine

    first = args["transitions"][0].split(">")[0]
    build, step, plan = _setup(args, first)
    engine = build(plan)
    synthetic = args["model"].startswith("synthetic:")
    if synthetic:
        fake_adam_step(engine)
    else:
        step(engine, 0)
        step(engine, 1)
    per_rank = state_bytes(*engine.state_dicts())
    bw = bandwidths(min(max(per_rank, 8 << 20), 256 << 20), engine.device)
    rows, i = [], 2
    for rep in range(args["repeats"]):
        for path in ("direct", "dcp") if rep % 2 == 0 else ("dcp", "direct"):
            for tr in args["transitions"]:
                src, dst = tr.split(">")
                if engine.plan.layout != make_plan(src, args["batch"], args["nproc"]).layout:
                    raise ValueError(f"transitions must chain: {tr!r} does not start at {engine.plan.describe()}")
                new_plan = make_plan(dst, args["batch"], args["nproc"])
                engine, report = switch_engine(engine, new_plan, build, path=path)
                row = {"transition": tr, "repeat": rep, "path": path, **report.to_dict()}
                if not synthetic:
                    row["first_step_s"] = step(engine, i)
                    row["step_s"] = float(np.median([step(engine, i + 1), step(engine, i + 2)]))
                    i += 3
                rows.append(row)
    engine.close()
    shutdown()
    return {"rows": rows, "bandwidth": bw, "state_bytes_per_rank": per_rank}


def restart_save_worker(args: dict) -> dict:
    """Job 1 of a restart: build X, one step, then (timed from a barrier) checkpoint and exit."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from copus.runtime.state import checkpoint as ckpt
    from copus.runtime.engine.dist import shutdown

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

    from copus.runtime.state import checkpoint as ckpt
    from copus.runtime.engine.dist import shutdown

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

    from copus.runtime.train.launch import free_port

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"bench-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": 120},
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr="127.0.0.1",
    )
    return elastic_launch(config, entry)(args)[0]


# ------------------------------------------------------------------------------------ main


def checkpoint_restart(args: dict, tr: str, rep: int, root: Path) -> dict:
    src, dst = tr.split(">")
    folder = root / f"{tr.replace('>', '-')}-{rep}"
    job = {**args, "src": src, "dst": dst, "ckpt": str(folder)}
    saved = launch(restart_save_worker, job, args["nproc"])
    loaded = launch(restart_load_worker, job, args["nproc"])
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "transition": tr,
        "repeat": rep,
        "restart_s": loaded["t_ready"] - saved["t_start"],
        "restart_to_first_step_s": loaded["t_first"] - saved["t_start"],
        "spawn_to_entry_s": loaded["t_entry"] - saved["t_start"],
        "first_step_s": loaded["first_step_s"],
    }


PHASE_KEYS = ("build_s", "plan_s", "move_s", "teardown_s", "stage_s", "load_s")


def _med(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.median(vals)) if vals else float("nan")


def summarise_model(job: dict, restart: list[dict], transitions: list[str], nproc: int) -> list:
    """Per transition (and "all"): medians per path, the restart, ratios, floor."""
    bw = job["bandwidth"]
    for r in job["rows"]:
        r["floor_s"] = r["moved_bytes"] / bw["a2a_Bps"] + r["local_bytes"] / bw["copy_Bps"]
    out = []
    for tr in [*transitions, "all"]:
        pick = [r for r in job["rows"] if tr in ("all", r["transition"])]
        direct = [r for r in pick if r["path"] == "direct"]
        dcp = [r for r in pick if r["path"] == "dcp"]
        rs = [r for r in restart if tr in ("all", r["transition"])]
        row = {
            "transition": tr,
            "direct_s": _med(direct, "wall_s"),
            "dcp_s": _med(dcp, "wall_s"),
            **{f"direct_{k}": _med(direct, k) for k in PHASE_KEYS[:4]},
            **{f"dcp_{k}": _med(dcp, k) for k in ("stage_s", "teardown_s", "build_s", "load_s")},
            "moved_mb": _med(direct, "moved_bytes") / 2**20,
            "local_mb": _med(direct, "local_bytes") / 2**20,
            "state_mb_per_rank": job["state_bytes_per_rank"] / 2**20,
            "direct_state_peak_mb": _med(direct, "state_peak_mb"),
            "direct_state_mb": _med(direct, "state_mb"),
            "direct_rss_delta_mb": float(np.median([r["rss_peak_mb"] - r["rss_before_mb"] for r in direct])),
            "dcp_rss_delta_mb": float(np.median([r["rss_peak_mb"] - r["rss_before_mb"] for r in dcp])),
            "floor_s": _med(direct, "floor_s"),
            "buckets": _med(direct, "buckets"),
            "step_s": _med(direct + dcp, "step_s"),
        }
        row["achieved_a2a_Bps"] = row["moved_mb"] * 2**20 / row["direct_move_s"]
        row["direct_vs_floor"] = row["direct_s"] / row["floor_s"] if row["floor_s"] else float("nan")
        row["dcp_over_direct"] = row["dcp_s"] / row["direct_s"]
        row["switch_in_steps"] = row["direct_s"] / row["step_s"]
        if rs:
            row["restart_s"] = _med(rs, "restart_s")
            row["restart_over_direct"] = row["restart_s"] / row["direct_s"]
            row["restart_over_dcp"] = row["restart_s"] / row["dcp_s"]
        out.append(row)
    return out


def fit_floor(models: dict) -> dict | None:
    """Least squares wall = c + k · floor over the synthetic states' direct switches."""
    pts = [
        (r["floor_s"], r["wall_s"])
        for name, m in models.items()
        if name.startswith("synthetic:")
        for r in m["in_process"]
        if r["path"] == "direct"
    ]
    if len({round(x, 6) for x, _ in pts}) < 2:
        return None
    x, y = np.array(pts).T
    k, c = np.polyfit(x, y, 1)
    worst = max(w / (3 * f + 0.2) for f, w in pts)
    return {
        "constant_s": float(c),
        "slope": float(k),
        "points": len(pts),
        "max_wall_over_3floor_plus_0.2": float(worst),
    }


def run_model(name: str, ns, transitions: list[str]) -> dict:
    """One model's raw measurements: the in-process job, then the restarts (named models)."""
    args = {"model": name, "nproc": ns.nproc, "batch": ns.batch, "repeats": ns.repeats, "transitions": transitions}
    load = os.getloadavg()[0]
    job = launch(in_process_worker, args, ns.nproc)
    restart = []
    if not name.startswith("synthetic:") and not ns.no_restart:
        root = Path(tempfile.mkdtemp(prefix="copus-bench-restart-"))
        try:
            restart = [
                checkpoint_restart(args, tr, rep, root) for rep in range(ns.restart_repeats) for tr in transitions
            ]
        finally:
            shutil.rmtree(root, ignore_errors=True)
    shape = model_shape(name)
    return {
        "shape": {"n_layers": shape.n_layers, "dim": shape.dim, "ffn_dim": shape.ffn_dim, "params": shape.num_params()},
        "transitions": transitions,
        "loadavg_before": load,
        "loadavg_after": os.getloadavg()[0],
        "bandwidth": job["bandwidth"],
        "state_bytes_per_rank": job["state_bytes_per_rank"],
        "in_process": job["rows"],
        "checkpoint_restart": restart,
    }


def finalise(result: dict) -> dict:
    """Summaries per model and the synthetic fit, from the raw rows."""
    for m in result["models"].values():
        job = {"rows": m["in_process"], "bandwidth": m["bandwidth"], "state_bytes_per_rank": m["state_bytes_per_rank"]}
        m["summary"] = summarise_model(job, m["checkpoint_restart"], m["transitions"], result["nproc"])
    result["floor_fit"] = fit_floor(result["models"])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,small,synthetic:0.1,synthetic:0.5,synthetic:1")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--repeats", type=int, default=3, help="switches per transition and path")
    ap.add_argument("--restart-repeats", type=int, default=2)
    ap.add_argument("--no-restart", action="store_true")
    ap.add_argument(
        "--transitions",
        default=",".join(TRANSITIONS),
        help="chained layout changes, e.g. dp4>dp2tp2,dp2tp2>pp2dp2,pp2dp2>dp4",
    )
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--from-json", default="", help="re-print a saved result, run nothing")
    ns = ap.parse_args()
    if ns.from_json:
        report(finalise(json.loads(Path(ns.from_json).read_text())), Path(ns.out))
        return
    transitions = ns.transitions.split(",")
    names = ns.models.split(",")
    for name in names:
        model_shape(name)
        for tr in transitions:
            for layout in tr.split(">"):
                make_plan(layout, ns.batch, ns.nproc)
    t0 = time.perf_counter()
    result = {
        "bench": "reconfigure",
        "nproc": ns.nproc,
        "batch": ns.batch,
        "repeats": ns.repeats,
        "restart_repeats": ns.restart_repeats,
        "device": "cuda" if _cuda() else "cpu",
        "backend": "nccl" if _cuda() else "gloo",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "uptime_before": _uptime()},
        "target": {
            "restart_over_direct_min": 40.0,
            "switch_in_steps_max": 1.0,
            "synthetic": "wall <= 3 * floor_s + c, c <= 0.2 s",
        },
        "models": {},
    }
    out = Path(ns.out)
    for name in names:
        result["models"][name] = run_model(name, ns, transitions)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")  # raw so far (re-print: --from-json)
    result["host"]["uptime_after"] = _uptime()
    result["bench_s"] = time.perf_counter() - t0
    report(finalise(result), out)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def report(result: dict, out: Path) -> None:
    """Write the JSON and print the tables."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    host = result["host"]
    print(
        f"{result['nproc']} {result['backend']} ranks, B={result['batch']}, medians of "
        f"{result['repeats']} switches per path (restart: {result['restart_repeats']}); "
        f"{host['cpus']} CPUs\nbefore: {host['uptime_before']}\n"
        f"after:  {host.get('uptime_after', '?')}"
    )
    head = (
        "model/transition",
        "direct s",
        "build",
        "plan",
        "move",
        "teardn",
        "dcp s",
        "restart s",
        "rst/dir",
        "dcp/dir",
        "step s",
        "sw/step",
        "moved MB",
        "move GB/s",
        "floor s",
        "dir/floor",
        "peak MB",
        "state MB",
    )
    print(" ".join(f"{h:>24}" if i == 0 else f"{h:>9}" for i, h in enumerate(head)))
    for name, m in result["models"].items():
        for r in m["summary"]:
            vals = (
                r["direct_s"],
                r["direct_build_s"],
                r["direct_plan_s"],
                r["direct_move_s"],
                r["direct_teardown_s"],
                r["dcp_s"],
                r.get("restart_s", float("nan")),
                r.get("restart_over_direct", float("nan")),
                r["dcp_over_direct"],
                r["step_s"],
                r["switch_in_steps"],
                r["moved_mb"],
                r["achieved_a2a_Bps"] / 1e9,
                r["floor_s"],
                r["direct_vs_floor"],
                r["direct_state_peak_mb"],
                r["direct_state_mb"],
            )
            label = f"{name.replace('synthetic:', 'syn')}/{r['transition']}"
            print(f"{label:>24} " + " ".join(f"{v:9.3f}" for v in vals))
        bw = m["bandwidth"]
        print(
            f"{'':>24} bandwidth (all ranks): all_to_all {bw['a2a_Bps'] / 1e9:.2f} GB/s, "
            f"memcpy {bw['copy_Bps'] / 1e9:.2f} GB/s; load {m['loadavg_before']:.1f} -> "
            f"{m['loadavg_after']:.1f}"
        )
    fit = result.get("floor_fit")
    if fit:
        print(
            f"synthetic fit: wall = {fit['constant_s']:.3f} s + {fit['slope']:.2f} x floor_s "
            f"({fit['points']} switches); max wall / (3 floor + 0.2 s) = "
            f"{fit['max_wall_over_3floor_plus_0.2']:.2f}"
        )
    print(
        "rst/dir = checkpoint-restart / direct; floor s = moved/a2a_bw + local/memcpy_bw; "
        "peak MB = moved state held at once per rank (state MB = max(old, new) per rank)\n"
        f"wrote {out}"
    )


if __name__ == "__main__":
    main()
