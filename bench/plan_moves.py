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
`copus.core.memory.MemoryModel` in the fp32 regime the CPU runtime uses); then, for a few
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
def _worker(cfg, run_dir: str, resume: bool = False) -> dict:
    """Build one Engine per layout, then time every plan in `rounds` shuffled rounds."""
    import torch
    import torch.distributed as dist

    from copus.core.models import get_model_shape
    from copus.core.plan import ParallelPlan
    from copus.runtime.dist import MeshCache, init_distributed, shutdown
    from copus.runtime.engine import Engine
    from copus.runtime.profile import engine_settings

    req = json.loads((Path(run_dir) / REQUEST).read_text())
    device = init_distributed(backend=cfg.parallel.backend)
    shape = get_model_shape(cfg.model.name)
    settings = engine_settings(cfg)
    meshes = MeshCache(device.type)
    plans = [ParallelPlan(**p) for p in req["plans"]]
    engines = {}
    for p in plans:
        if p.layout not in engines:
            engines[p.layout] = Engine(shape, p, settings, device, meshes, seed=cfg.train.seed)
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    times: dict[int, list[float]] = {i: [] for i in range(len(plans))}
    cpu: dict[int, list[float]] = {i: [] for i in range(len(plans))}
    cpu_max: dict[int, list[float]] = {i: [] for i in range(len(plans))}
    try:
        for r in range(req["rounds"]):
            order = list(range(len(plans)))
            random.Random(req["seed"] + r).shuffle(order)      # same order on every rank
            for i in order:
                plan = plans[i]
                eng = engines[plan.layout]
                eng.set_plan(plan)
                rows = plan.micro_batch_size * plan.num_microbatches
                tokens = torch.randint(0, shape.vocab_size, (rows, shape.seq_len + 1),
                                       generator=gen)
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
                dist.all_reduce(c)                              # CPU seconds of all ranks
                dist.all_reduce(m, op=dist.ReduceOp.MAX)        # CPU seconds of the busiest
                times[i].append(statistics.median(walls))
                cpu[i].append(float(c.item()))
                cpu_max[i].append(float(m.item()))
            if dist.get_rank() == 0:
                print(f"  round {r + 1}/{req['rounds']} done", flush=True)
    finally:
        for eng in engines.values():
            eng.close()
        shutdown()
    return {"times": [times[i] for i in range(len(plans))],
            "cpu": [cpu[i] for i in range(len(plans))],
            "cpu_max": [cpu_max[i] for i in range(len(plans))]}


# --------------------------------------------------------------------------- analysis (pure)
def _label(row: dict) -> str:
    parts = [f"{k}{row[k]}" for k in ("dp", "tp", "pp") if row[k] > 1]
    return "·".join(parts) or "single"


def memory_bytes(shape, reshard_after_forward: bool, pp_schedule: str, row: dict) -> float:
    """Peak bytes per rank of a plan (MemoryModel, fp32: what the CPU runtime keeps)."""
    from copus.core.memory import MemoryModel

    mm = MemoryModel(shape=shape, mixed_precision=False,
                     reshard_after_forward=reshard_after_forward, pp_schedule=pp_schedule)
    return float(mm.bytes_per_rank(row["dp"], row["tp"], row["pp"], row["micro_batch_size"],
                                   row["num_microbatches"]))


def fastest_per_batch(rows: list[dict], budget_bytes: float = 0.0) -> list[dict]:
    """Per global batch: the best micro-batch of every layout and the fastest plan overall.

    Plans over `budget_bytes` (MemoryModel) are dropped when the budget is > 0. `margin` is how
    much slower the best plan of the runner-up layout is (step_s ratio − 1)."""
    out = []
    for b in sorted({r["global_batch_size"] for r in rows}):
        best: dict[str, dict] = {}
        for r in rows:
            if r["global_batch_size"] != b or (budget_bytes > 0 and r["memory_bytes"] > budget_bytes):
                continue
            name = _label(r)
            if name not in best or r["step_s"] < best[name]["step_s"]:
                best[name] = r
        if not best:
            continue
        ranked = sorted(best.values(), key=lambda r: r["step_s"])
        win = ranked[0]
        margin = ranked[1]["step_s"] / win["step_s"] - 1.0 if len(ranked) > 1 else float("inf")
        out.append({"global_batch_size": b, "fastest": _label(win),
                    "micro_batch_size": win["micro_batch_size"], "step_s": win["step_s"],
                    "samples_per_s": win["samples_per_s"], "margin": margin,
                    "per_layout": {k: {"micro_batch_size": v["micro_batch_size"],
                                       "step_s": v["step_s"], "step_s_min": v["step_s_min"]}
                                   for k, v in best.items()}})
    return out


def goodput_best(rows: list[dict], b_noises: list[float], budget_bytes: float = 0.0) -> list[dict]:
    """For each b_noise: the (B, plan) maximising samples_per_s · E(B) (COPUS Eq. 6)."""
    from copus.core.efficiency import statistical_efficiency

    ok = [r for r in rows if budget_bytes <= 0 or r["memory_bytes"] <= budget_bytes]
    out = []
    for bn in b_noises:
        best = max(ok, key=lambda r: r["samples_per_s"] * float(
            statistical_efficiency(bn, r["global_batch_size"])))
        out.append({"b_noise": bn, "global_batch_size": best["global_batch_size"],
                    "plan": _label(best), "micro_batch_size": best["micro_batch_size"],
                    "goodput": best["samples_per_s"] * float(
                        statistical_efficiency(bn, best["global_batch_size"]))})
    return out


def markdown(result: dict) -> str:
    """The fastest plan per global batch (with and without the budget) as Markdown tables."""
    layouts = sorted({_label(r) for r in result["rows"]},
                     key=lambda s: [r for r in result["rows"] if _label(r) == s][0]["pp"])
    lines = [f"model {result['model']}, {result['nproc']} ranks, "
             f"reshard_after_forward={result['reshard_after_forward']}, "
             f"{result['rounds']} rounds × {result['steps']} steps, median over rounds (ms/step, "
             "best micro-batch per layout)", ""]
    for title, table in (("no memory budget", result["fastest"]),
                         (f"memory budget {result['memory_budget_gb']} GB/rank",
                          result.get("fastest_budget") or [])):
        if not table:
            continue
        lines += [f"**{title}**", "",
                  "| B | " + " | ".join(layouts) + " | fastest | margin |",
                  "|---|" + "---|" * (len(layouts) + 2)]
        for t in table:
            cells = []
            for name in layouts:
                v = t["per_layout"].get(name)
                cells.append("—" if v is None else
                             f"{v['step_s'] * 1e3:.0f} (mb{v['micro_batch_size']})")
            lines.append(f"| {t['global_batch_size']} | " + " | ".join(cells) +
                         f" | **{t['fastest']}** mb{t['micro_batch_size']} | {t['margin']:+.0%} |")
        lines.append("")
    if result.get("goodput"):
        lines += ["**goodput-best (B, plan) per b_noise**", "", "| b_noise | B | plan | goodput |",
                  "|---|---|---|---|"]
        for g in result["goodput"]:
            lines.append(f"| {g['b_noise']:g} | {g['global_batch_size']} | {g['plan']} "
                         f"mb{g['micro_batch_size']} | {g['goodput']:.2f} |")
    return "\n".join(lines) + "\n"


def analyse(result: dict) -> dict:
    from copus.core.models import get_model_shape

    shape = get_model_shape(result["model"])
    for r in result["rows"]:
        r["memory_bytes"] = memory_bytes(shape, result["reshard_after_forward"],
                                         result["pp_schedule"], r)
    budget = result["memory_budget_gb"] * GB
    result["fastest"] = fastest_per_batch(result["rows"])
    result["fastest_budget"] = fastest_per_batch(result["rows"], budget) if budget > 0 else []
    result["goodput"] = goodput_best(result["rows"], result["b_noises"], budget)
    result["plan_moves"] = len({t["fastest"] for t in (result["fastest_budget"]
                                                        or result["fastest"])}) > 1
    return result


# --------------------------------------------------------------------------- driver
def measure(args) -> dict:
    from copus.commands.profile import select_plans
    from copus.config import load_config
    from copus.core.models import get_model_shape
    from copus.runtime.launch import launch

    cfg = load_config(None, [*args.set, f"model.name={args.model!r}", f"parallel.nproc={args.nproc}"])
    shape = get_model_shape(cfg.model.name)
    sel = argparse.Namespace(nproc=args.nproc, global_batch=args.global_batch,
                             micro_batch_sizes=args.micro_batch_sizes, layouts=args.layouts,
                             sample=0, seed=0, model=args.model)
    plans = select_plans(sel, shape)
    print(f"timing {len(plans)} plans of {shape.name} on {args.nproc} ranks, "
          f"{args.rounds} rounds", flush=True)
    with tempfile.TemporaryDirectory(prefix="copus-plan-moves-") as tmp:
        (Path(tmp) / REQUEST).write_text(json.dumps({
            "plans": [{"dp": p.dp, "tp": p.tp, "pp": p.pp, "micro_batch_size": p.micro_batch_size,
                       "num_microbatches": p.num_microbatches} for p in plans],
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "seed": args.seed}))
        t0 = time.time()
        res = launch(cfg, tmp, entry=_worker, max_restarts=0)
        wall = time.time() - t0
    rows = []
    for p, ts, cs, cm in zip(plans, res["times"], res["cpu"], res["cpu_max"]):
        step_s = statistics.median(ts)
        rows.append({"dp": p.dp, "tp": p.tp, "pp": p.pp, "micro_batch_size": p.micro_batch_size,
                     "num_microbatches": p.num_microbatches,
                     "global_batch_size": p.global_batch_size, "step_s": step_s,
                     "step_s_min": min(ts), "step_s_rounds": ts,
                     "cpu_s_all_ranks": statistics.median(cs),
                     "cpu_s_max_rank": statistics.median(cm),
                     "samples_per_s": p.global_batch_size / step_s,
                     "tokens_per_s": p.global_batch_size * shape.seq_len / step_s})
    return {"model": shape.name, "nproc": args.nproc, "settings": args.set,
            "reshard_after_forward": cfg.parallel.reshard_after_forward,
            "pp_schedule": cfg.parallel.pp_schedule,
            "memory_budget_gb": args.memory_budget_gb or cfg.parallel.memory_budget_gb,
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
            "b_noises": args.b_noise, "wall_s": wall,
            "load_avg": os.getloadavg(), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--global-batch", default="8,32,128")
    ap.add_argument("--micro-batch-sizes", default="1,2,4,8,16,32")
    ap.add_argument("--layouts", default="4x1x1,2x1x2,1x1x4", help="DPxTPxPP list")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--memory-budget-gb", type=float, default=0.0,
                    help="per-rank budget for the second table (default parallel.memory_budget_gb)")
    ap.add_argument("--b-noise", type=float, nargs="*", default=[2.0, 8.0, 32.0, 128.0])
    ap.add_argument("--from", dest="source", help="re-analyse an existing result JSON")
    ap.add_argument("--out", default=str(RESULTS / "plan_moves.json"))
    args = ap.parse_args(argv)
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
