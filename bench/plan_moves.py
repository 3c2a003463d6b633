"""Does the fastest parallel plan move as the global batch grows? (issue 11, item 4)

    python bench/plan_moves.py                                   # the recommended defaults
    python bench/plan_moves.py --model tiny --nproc 4 --set parallel.reshard_after_forward=true
    python bench/plan_moves.py --from bench/results/plan_moves.json   # re-analyse, no timing

Times every (layout, micro_batch_size) plan at each global batch on the real `Engine` (the
code `copus profile` and `copus train` run: TP → AC → FSDP2, PP with 1F1B), but unlike
`copus profile` it keeps one engine per layout alive and runs the plans in ROUNDS, in a new
random order each round. On a shared 2-core machine other jobs slow whole minutes down; with
interleaved rounds every plan sees the same mix of quiet and busy moments, and the per-plan
median over rounds compares plans side by side. Each round times `--steps` steps after
`--warmup` untimed ones (a pipeline needs a new schedule per micro-batching).

For each global batch B the table shows the best micro-batch of every layout and the fastest
plan, with and without a per-rank memory budget (`parallel.memory_budget_gb`, priced by
`copus.core.cost.memory.MemoryModel` in the fp32 regime the CPU runtime uses); then, for a few
gradient-noise scales, the goodput-best (B, plan): goodput = samples_per_s · E(B),
E(B) = (b_noise + 1)/(b_noise + B) (COPUS Eq. 6, `core.efficiency.statistical_efficiency`).

JSON: bench/results/plan_moves.json (or --out); a Markdown table is printed and written beside
it (`.md`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9
REQUEST = "plan_moves_request.json"


# --------------------------------------------------------------------------- worker (every rank)
def keep_unsharded_during_accumulation(model) -> None:
    """FSDP2: keep parameters unsharded between the micro-batches of one step (prototype).

    The engine's dp path calls `set_requires_gradient_sync(i == k - 1)` per micro-batch; this
    makes the same call also `set_reshard_after_backward(i == k - 1)`, so with
    reshard_after_forward=false the parameters are all-gathered once per step instead of once
    per micro-batch. torch.distributed.pipelining's stage does exactly this for FSDP stages
    (stage.py, backward_maybe_with_nosync), so without it dp-only plans pay a re-gather per
    micro-batch that pipeline plans do not.
    """
    orig = model.set_requires_gradient_sync

    def patched(flag: bool, *, recurse: bool = True) -> None:
        orig(flag, recurse=recurse)
        model.set_reshard_after_backward(flag, recurse=recurse)

    model.set_requires_gradient_sync = patched


def _worker(cfg, run_dir: str, resume: bool = False) -> dict:
    """Build one Engine per layout, then time every plan in `rounds` shuffled rounds."""
    import torch
    import torch.distributed as dist

    from copus.core.specs.resolve import get_model_shape
    from copus.core.plan.plan import ParallelPlan
    from copus.runtime.engine.dist import MeshCache, init_distributed, shutdown
    from copus.runtime.engine.engine import Engine
    from copus.runtime.engine.engine import settings_from_config

    req = json.loads((Path(run_dir) / REQUEST).read_text())
    device = init_distributed(backend=cfg.parallel.backend)
    shape = get_model_shape(cfg.model.name)
    settings = settings_from_config(cfg)
    meshes = MeshCache(device.type)
    plans = [ParallelPlan(**p) for p in req["plans"]]
    keeps = req["keep"]
    engines = {}
    for p, keep in zip(plans, keeps):
        if (p.layout, keep) not in engines:
            eng = Engine(shape, p, settings, device, meshes, seed=cfg.train.seed)
            if keep:
                keep_unsharded_during_accumulation(eng.model)
            engines[(p.layout, keep)] = eng
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    times: dict[int, list[float]] = {i: [] for i in range(len(plans))}
    cpu: dict[int, list[float]] = {i: [] for i in range(len(plans))}
    cpu_max: dict[int, list[float]] = {i: [] for i in range(len(plans))}
    try:
        for r in range(req["rounds"]):
            order = list(range(len(plans)))
            random.Random(req["seed"] + r).shuffle(order)  # same order on every rank
            for i in order:
                plan = plans[i]
                eng = engines[(plan.layout, keeps[i])]
                eng.set_plan(plan)
                rows = plan.micro_batch_size * plan.num_microbatches
                tokens = torch.randint(0, shape.vocab_size, (rows, shape.seq_len + 1), generator=gen)
                walls, cpus = [], []
                for k in range(req["warmup"] + req["steps"]):
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    eng.train_step(tokens, lr=0.0)
                    dist.barrier()
                    if k >= req["warmup"]:
                        walls.append(time.perf_counter() - t0)
                        cpus.append(time.process_time() - c0)
                c = torch.tensor([statistics.median(cpus)], dtype=torch.float64)
                m = c.clone()
                dist.all_reduce(c)  # CPU seconds of all ranks
                dist.all_reduce(m, op=dist.ReduceOp.MAX)  # CPU seconds of the busiest
                times[i].append(statistics.median(walls))
                cpu[i].append(float(c.item()))
                cpu_max[i].append(float(m.item()))
            if dist.get_rank() == 0:
                print(f"  round {r + 1}/{req['rounds']} done", flush=True)
    finally:
        for eng in engines.values():
            eng.close()
        shutdown()
    return {
        "times": [times[i] for i in range(len(plans))],
        "cpu": [cpu[i] for i in range(len(plans))],
        "cpu_max": [cpu_max[i] for i in range(len(plans))],
    }


# --------------------------------------------------------------------------- analysis (pure)
def _label(row: dict) -> str:
    parts = [f"{k}{row[k]}" for k in ("dp", "tp", "pp") if row[k] > 1]
    return ("·".join(parts) or "single") + ("+keep" if row.get("keep_unsharded") else "")


def memory_bytes(shape, reshard_after_forward: bool, pp_schedule: str, row: dict) -> float:
    """Peak bytes per rank of a plan (MemoryModel, fp32: what the CPU runtime keeps)."""
    from copus.core.cost.memory import MemoryModel

    mm = MemoryModel(
        shape=shape, mixed_precision=False, reshard_after_forward=reshard_after_forward, pp_schedule=pp_schedule
    )
    return float(mm.bytes_per_rank(row["dp"], row["tp"], row["pp"], row["micro_batch_size"], row["num_microbatches"]))


METRICS = {
    "step_s": "wall-clock step time, median over rounds",
    "cpu_step_s": "CPU-time estimate max(Σ_ranks CPU / cores, busiest rank's CPU)",
}


def cpu_step_s(row: dict, cores: int) -> float:
    """Step time the plan's CPU work needs on `cores` cores that nobody else uses.

    max(CPU seconds of all ranks / cores, CPU seconds of the busiest rank): a lower bound of the
    wall time on an idle machine that other jobs' load does not inflate. Close to the wall time
    when ranks outnumber cores (an idle rank's core is taken by another rank); with one rank per
    core it misses the time a rank waits idle (pipeline bubbles), so it favours pipelines there.
    """
    return max(row["cpu_s_all_ranks"] / cores, row.get("cpu_s_max_rank", 0.0))


def fastest_per_batch(rows: list[dict], budget_bytes: float = 0.0, key: str = "step_s") -> list[dict]:
    """Per global batch: the best micro-batch of every layout and the fastest plan overall.

    Plans over `budget_bytes` (MemoryModel) are dropped when the budget is > 0; `key` is the
    step-time column compared. `margin` is how much slower the runner-up layout's best plan is
    (step-time ratio − 1)."""
    out = []
    for b in sorted({r["global_batch_size"] for r in rows}):
        best: dict[str, dict] = {}
        for r in rows:
            if r["global_batch_size"] != b or (budget_bytes > 0 and r["memory_bytes"] > budget_bytes):
                continue
            name = _label(r)
            if name not in best or r[key] < best[name][key]:
                best[name] = r
        if not best:
            continue
        ranked = sorted(best.values(), key=lambda r: r[key])
        win = ranked[0]
        margin = ranked[1][key] / win[key] - 1.0 if len(ranked) > 1 else float("inf")
        out.append(
            {
                "global_batch_size": b,
                "fastest": _label(win),
                "micro_batch_size": win["micro_batch_size"],
                "step_s": win[key],
                "samples_per_s": b / win[key],
                "margin": margin,
                "per_layout": {
                    k: {"micro_batch_size": v["micro_batch_size"], "step_s": v[key]} for k, v in best.items()
                },
            }
        )
    return out


def goodput_best(rows: list[dict], b_noises: list[float], budget_bytes: float = 0.0, key: str = "step_s") -> list[dict]:
    """For each b_noise: the (B, plan) maximising B/step · E(B) (COPUS Eq. 6)."""
    from copus.core.stats.efficiency import statistical_efficiency

    ok = [r for r in rows if budget_bytes <= 0 or r["memory_bytes"] <= budget_bytes]
    out = []
    for bn in b_noises:

        def score(r: dict, bn: float = bn) -> float:
            return r["global_batch_size"] / r[key] * float(statistical_efficiency(bn, r["global_batch_size"]))

        best = max(ok, key=score)
        out.append(
            {
                "b_noise": bn,
                "global_batch_size": best["global_batch_size"],
                "plan": _label(best),
                "micro_batch_size": best["micro_batch_size"],
                "goodput": score(best),
            }
        )
    return out


def _table(table: list[dict], layouts: list[str]) -> list[str]:
    lines = ["| B | " + " | ".join(layouts) + " | fastest | margin |", "|---|" + "---|" * (len(layouts) + 2)]
    for t in table:
        cells = []
        for name in layouts:
            v = t["per_layout"].get(name)
            cells.append("—" if v is None else f"{v['step_s'] * 1e3:.0f} (mb{v['micro_batch_size']})")
        lines.append(
            f"| {t['global_batch_size']} | "
            + " | ".join(cells)
            + f" | **{t['fastest']}** mb{t['micro_batch_size']} | {t['margin']:+.0%} |"
        )
    return lines + [""]


def markdown(result: dict) -> str:
    """Fastest plan per global batch (each metric, with and without the budget), goodput-best."""
    rows = result["rows"]
    layouts = sorted({_label(r) for r in rows}, key=lambda s: ([r for r in rows if _label(r) == s][0]["pp"], s))
    lines = [
        f"model {result['model']}, {result['nproc']} ranks on {result.get('cores', '?')} "
        f"cores, reshard_after_forward={result['reshard_after_forward']}, "
        f"{result['rounds']} rounds × {result['steps']} steps, load average during the run "
        f"{result['load_avg'][2]:.1f}; ms/step of the best micro-batch per layout",
        "",
    ]
    budget = result["memory_budget_gb"]
    for key, text in METRICS.items():
        for title, table in (
            ("no memory budget", result["fastest"][key]),
            (f"memory budget {budget} GB/rank", result["fastest_budget"][key]),
        ):
            if table:
                lines += [f"**{text}, {title}**", ""] + _table(table, layouts)
    lines += [
        "**goodput-best (B, plan) per b_noise" + (f", memory budget {budget} GB/rank" if budget else "") + "**",
        "",
        "| b_noise | metric | B | plan | goodput (samples/s · E) |",
        "|---|---|---|---|---|",
    ]
    for key, table in result["goodput"].items():
        for g in table:
            lines.append(
                f"| {g['b_noise']:g} | {key} | {g['global_batch_size']} | {g['plan']} "
                f"mb{g['micro_batch_size']} | {g['goodput']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def analyse(result: dict) -> dict:
    """Add memory and CPU-time columns, the per-batch tables and whether the plan moves."""
    from copus.core.specs.resolve import get_model_shape

    shape = get_model_shape(result["model"])
    cores = int(result.get("cores") or 2)
    for r in result["rows"]:
        r["memory_bytes"] = memory_bytes(shape, result["reshard_after_forward"], result["pp_schedule"], r)
        r["cpu_step_s"] = cpu_step_s(r, cores)
    budget = result["memory_budget_gb"] * GB
    result["fastest"] = {k: fastest_per_batch(result["rows"], 0.0, k) for k in METRICS}
    result["fastest_budget"] = {k: fastest_per_batch(result["rows"], budget, k) if budget > 0 else [] for k in METRICS}
    result["goodput"] = {k: goodput_best(result["rows"], result["b_noises"], budget, k) for k in METRICS}
    result["plan_moves"] = {
        k: len({t["fastest"] for t in (result["fastest_budget"][k] or result["fastest"][k])}) > 1 for k in METRICS
    }
    return result


# --------------------------------------------------------------------------- driver
def measure(args) -> dict:
    from copus.commands.profile import select_plans
    from copus.config import load_config
    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.train.launch import launch

    cfg = load_config(None, [*args.set, f"model.name={args.model!r}", f"parallel.nproc={args.nproc}"])
    shape = get_model_shape(cfg.model.name)
    sel = argparse.Namespace(
        nproc=args.nproc,
        global_batch=args.global_batch,
        micro_batch_sizes=args.micro_batch_sizes,
        layouts=args.layouts,
        sample=0,
        seed=0,
        model=args.model,
    )
    plans = [
        p for p in select_plans(sel, shape) if not args.max_microbatches or p.num_microbatches <= args.max_microbatches
    ]
    keep_opts = {"off": [False], "on": [True], "both": [False, True]}[args.keep_unsharded]
    # only dp-only engines differ (pipeline stages already keep parameters unsharded)
    pairs = [(p, k) for p in plans for k in (keep_opts if p.pp == 1 and p.dp > 1 else [False])]
    plans, keeps = [p for p, _ in pairs], [k for _, k in pairs]
    print(f"timing {len(plans)} plans of {shape.name} on {args.nproc} ranks, {args.rounds} rounds", flush=True)
    with tempfile.TemporaryDirectory(prefix="copus-plan-moves-") as tmp:
        (Path(tmp) / REQUEST).write_text(
            json.dumps(
                {
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
                    "keep": keeps,
                    "rounds": args.rounds,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "seed": args.seed,
                }
            )
        )
        t0 = time.time()
        res = launch(cfg, tmp, entry=_worker, max_restarts=0)
        wall = time.time() - t0
    rows = []
    for p, keep, ts, cs, cm in zip(plans, keeps, res["times"], res["cpu"], res["cpu_max"]):
        step_s = statistics.median(ts)
        rows.append(
            {
                "dp": p.dp,
                "tp": p.tp,
                "pp": p.pp,
                "micro_batch_size": p.micro_batch_size,
                "num_microbatches": p.num_microbatches,
                "keep_unsharded": keep,
                "global_batch_size": p.global_batch_size,
                "step_s": step_s,
                "step_s_min": min(ts),
                "step_s_rounds": ts,
                "cpu_s_all_ranks": statistics.median(cs),
                "cpu_s_max_rank": statistics.median(cm),
                "samples_per_s": p.global_batch_size / step_s,
                "tokens_per_s": p.global_batch_size * shape.seq_len / step_s,
            }
        )
    return {
        "model": shape.name,
        "nproc": args.nproc,
        "settings": args.set,
        "keep_unsharded": args.keep_unsharded,
        "reshard_after_forward": cfg.parallel.reshard_after_forward,
        "pp_schedule": cfg.parallel.pp_schedule,
        "memory_budget_gb": args.memory_budget_gb or cfg.parallel.memory_budget_gb,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "b_noises": args.b_noise,
        "wall_s": wall,
        "cores": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--global-batch", default="8,32,128")
    ap.add_argument("--micro-batch-sizes", default="2,4")
    ap.add_argument("--layouts", default="4x1x1,2x1x2,1x1x4", help="DPxTPxPP list")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-microbatches", type=int, default=0, help="skip plans with more micro-batches per step (0 = keep all)"
    )
    ap.add_argument(
        "--keep-unsharded",
        choices=("off", "on", "both"),
        default="on",
        help="dp-only plans: keep FSDP2 parameters unsharded during accumulation",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=None,
        metavar="SECTION.KEY=VALUE",
        help="config overrides (default: parallel.reshard_after_forward=false)",
    )
    ap.add_argument(
        "--memory-budget-gb",
        type=float,
        default=0.04,
        help="per-rank budget for the second table (default parallel.memory_budget_gb)",
    )
    ap.add_argument("--b-noise", type=float, nargs="*", default=[2.0, 8.0, 32.0, 128.0])
    ap.add_argument("--from", dest="source", help="re-analyse an existing result JSON")
    ap.add_argument("--out", default=str(RESULTS / "plan_moves.json"))
    args = ap.parse_args(argv)
    if args.set is None:
        args.set = ["parallel.reshard_after_forward=false"]
    if args.source:
        result = json.loads(Path(args.source).read_text())
        if args.memory_budget_gb:
            result["memory_budget_gb"] = args.memory_budget_gb
        result["b_noises"] = args.b_noise
    else:
        result = measure(args)
    result = analyse(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    table = markdown(result)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
