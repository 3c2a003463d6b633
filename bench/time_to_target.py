"""Head-to-head: wall time to target validation losses, every policy on the same data (issue 7).

    python bench/time_to_target.py --set parallel.reshard_after_forward=false   # full: ~1 h
    python bench/time_to_target.py --quick               # a smoke run (1 seed, 4 policies, tiny)
    python bench/time_to_target.py --from runs/time_to_target   # re-analyse, no training
    python bench/time_to_target.py --max-tokens 1000000 --warmup-tokens 50000 \
        --static 8,16,32,64,128 --profile bench/results/time_to_target_long_profile.json \
        --policies static-8,gns-start --seeds 0 --runs runs/ttt_a --out bench/results/ttt_a.json
    python bench/time_to_target.py --from runs/ttt_a,runs/ttt_b --out bench/results/ttt.json

One training run per (policy, seed): the `tiny` model on the embedded corpus, 4 CPU ranks, the
same seed, data order (GlobalSampler(seed)), LR schedule (in tokens) and token budget for every
policy. Runs of one seed share one set of worker processes (the `copus train` Trainer, run
back to back; spawning 4 torch workers costs 30-90 s on this host) and go in a rotated order per
seed, so slow stretches on a shared machine hit every policy alike. A 3-step warm-up run in
each worker set is discarded.

Policies (COPUS §3.1 baselines):
  static-B     fixed global batch B with the fastest plan for B from `copus profile` (run first,
               or --profile FILE); LR = lr·sqrt(B/B0) (what the adaptive policies use at B).
  ramp         linear batch ramp B0 → batch.max over the first half of the tokens, start plan.
  norm-test    Lau et al.'s norm test (η = batch.norm_test_eta), start plan.
  gns-start    CBS: B ≈ gns_c·b_noise, plan (layout, micro-batch) tuned for B0 ("pessimistic").
  gns-large    CBS with the layout tuned for the largest static batch ("optimistic"); the
               micro-batch is the largest that divides B0/dp (batch policies keep it fixed).
  goodput      batch, micro-batch and (dp, tp, pp) chosen by goodput with copus's defaults;
               starts on the B0 plan.
  goodput-copus  the same controller with the COPUS paper's settings (c = 2, LR-aware sqrt(B)
               factor, one EMA 0.95 → 0.99, point estimate): `batch.policy='goodput-copus'`.

Legs: `--policies`/`--seeds` pick a subset; each leg writes its own runs root (`--runs`) and
results file (`--out`); `--from ROOT1,ROOT2,...` merges the roots into one analysis (a
(policy, seed) found twice is taken from the first root). Next to the wall time every run gets
a replay time (bench/ttt_replay.py: profiled median step time of each step's plan + measured
switch and probe costs), and the issue-14 goal is checked at the last target in both clocks.

Evaluation: the same fixed validation windows (eval.num_samples) after the step that crosses
each multiple of max_tokens/num_evals tokens: one token grid for every policy (eval.interval_steps
counts steps, which cover 16x more tokens at B=128 than at B=8, and a coarser grid alone delays
a first crossing). Time to a target = wall time of the first evaluation at or below it, linearly
interpolated with the previous one, EXCLUDING evaluation time (the metrics line of a step is
written before its evaluation, so an evaluation's cost is its eval.jsonl wall_s minus that
step's metrics wall_s; every earlier evaluation's cost is subtracted). wall_s starts when the
run's writer is created: the engine build and first steps count. Decisions and layout switches
count. Speed-up at a target = (T_base − T_goodput)/T_base (COPUS §3.1), T_base = the baseline
with the lowest mean time over seeds at that target (a tuned choice, not a per-seed oracle);
spread = per-seed speed-ups against that baseline.
Writes bench/results/time_to_target.json and .md (or --out) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttt_replay import first_crossing as time_to_target  # noqa: E402
from ttt_replay import plan_key, read_jsonl  # noqa: E402  (the one reader of run folders)

RESULTS = Path(__file__).resolve().parent / "results"
REQUEST = "ttt_request.json"
ALL_POLICIES = (
    "static-8",
    "static-16",
    "static-32",
    "static-64",
    "static-128",
    "ramp",
    "norm-test",
    "gns-start",
    "gns-large",
    "goodput",
    "goodput-copus",
)
STATIC_GROUP, CBS_GROUP = "static", "cbs"


# --------------------------------------------------------------------------- worker (every rank)
def _token_eval_trainer():
    """Trainer that evaluates at every multiple of `eval_every_tokens` (a common token grid:
    eval.interval_steps counts steps, which cover more tokens as the batch grows)."""
    from copus.runtime.train.trainer import Trainer

    class TokenEvalTrainer(Trainer):
        eval_every_tokens = 0

        def train_step(self):
            record = super().train_step()  # logs the metrics line, then we evaluate
            if self.progress.tokens >= self.next_eval:
                self.evaluate()
                self.next_eval = (self.progress.tokens // self.eval_every_tokens + 1) * self.eval_every_tokens
            return record

    return TokenEvalTrainer


def _free_layout_policy(cfg, plan, world_size: int, shape):
    """The configured policy, but goodput may leave the start layout: copus pins the layout when
    a degree is set in [parallel] (setup.make_run_policy), and the bench sets them only to give
    every policy the same start plan."""
    from dataclasses import replace

    from copus.runtime.train.setup import make_run_policy

    free = replace(cfg, parallel=replace(cfg.parallel, dp=0, tp=0, pp=0))
    return make_run_policy(free, plan, world_size, shape)


def _worker(cfg, run_dir: str, resume: bool = False) -> dict:
    """Run every training in the request back to back in these processes (Trainer.run each)."""
    from copus.config import load_config
    from copus.runtime.engine.dist import init_distributed, shutdown

    req = json.loads((Path(run_dir) / REQUEST).read_text())
    device = init_distributed(backend=cfg.parallel.backend)
    trainer_cls = _token_eval_trainer()
    done = []
    try:
        for item in req["runs"]:
            run_cfg = load_config(None, item["overrides"])
            trainer = trainer_cls(run_cfg, item["run_dir"], device, policy_factory=_free_layout_policy)
            trainer.eval_every_tokens = trainer.next_eval = int(item["eval_every_tokens"])
            load0, t0 = os.getloadavg(), time.time()
            try:
                trainer.run()
            finally:
                trainer.close()
            if trainer.rank == 0:  # the machine's load beside each run's wall time
                (Path(item["run_dir"]) / "load.json").write_text(
                    json.dumps(
                        {
                            "start_unix": t0,
                            "wall_s": time.time() - t0,
                            "load_avg_start": load0,
                            "load_avg_end": os.getloadavg(),
                        }
                    )
                )
            done.append(item["name"])
    finally:
        shutdown()
    return {"done": done}


# --------------------------------------------------------------------------- run specifications
def plan_overrides(plan: dict) -> list[str]:
    return [f"parallel.{k}={int(plan[k])}" for k in ("dp", "tp", "pp", "micro_batch_size")]


def best_plans(rows: list[dict]) -> dict[int, dict]:
    """The fastest profiled plan (samples_per_s) for each global batch size."""
    best: dict[int, dict] = {}
    for r in rows:
        b = int(r["global_batch_size"])
        if b not in best or r["samples_per_s"] > best[b]["samples_per_s"]:
            best[b] = r
    return best


def start_plan_for_layout(plan: dict, batch: int) -> dict:
    """`plan`'s layout with the largest micro-batch ≤ its own that fits `batch` (≥ pp micro-batches)."""
    per = batch // plan["dp"]
    mbs = max(m for m in range(1, int(plan["micro_batch_size"]) + 1) if per % m == 0 and per // m >= plan["pp"])
    return {**plan, "micro_batch_size": mbs}


def run_specs(args, best: dict[int, dict], seq_len: int, profile_path: str = "") -> dict[str, list[str]]:
    """Policy name → config overrides (common settings first). `profile_path`: the profile the
    static baselines were tuned by, given to goodput too (`controller.profile`: the same
    information; "goodput-bare" runs without it)."""
    b0, bmax = args.initial_batch, max(args.static)
    # the adaptive policies' batch.max: --max-batch, else the largest static (which capped a
    # run side by side with static B=8 alone at B = 8)
    bmax_adaptive = getattr(args, "max_batch", 0) or bmax
    common = [
        f"model.name={args.model!r}",
        f"parallel.nproc={args.nproc}",
        f"train.max_tokens={args.max_tokens}",
        f"train.warmup_tokens={args.warmup_tokens}",
        f"train.lr={args.lr}",
        "checkpoint.interval_steps=0",
        "checkpoint.keep=1",
        "log.progress=false",
        "log.tensorboard=false",
        "eval.interval_steps=0",
        f"eval.num_samples={args.eval_samples}",
        f"batch.ramp_to={bmax}",
        *args.set,
    ]
    start = start_plan_for_layout(best[b0], b0)
    large = start_plan_for_layout(best[bmax], b0)
    adaptive = [f"batch.initial={b0}", f"batch.min={b0}", f"batch.max={bmax_adaptive}"]
    specs: dict[str, list[str]] = {}
    for b in args.static:
        lr = args.lr * math.sqrt(b / b0)
        specs[f"static-{b}"] = [
            *common,
            "batch.policy='constant'",
            f"batch.initial={b}",
            f"batch.min={min(b, b0)}",
            f"batch.max={max(b, bmax)}",
            f"train.lr={lr:.6g}",
            *plan_overrides(best[b]),
        ]
    ramp = [f"batch.ramp_samples={args.max_tokens // seq_len // 2}"]
    specs["ramp"] = [*common, "batch.policy='ramp'", *adaptive, *ramp, *plan_overrides(start)]
    specs["norm-test"] = [*common, "batch.policy='norm-test'", *adaptive, *plan_overrides(start)]
    specs["gns-start"] = [*common, "batch.policy='gns'", *adaptive, *plan_overrides(start)]
    specs["gns-large"] = [*common, "batch.policy='gns'", *adaptive, *plan_overrides(large)]
    # goodput: the library's defaults, nothing bench-specific; goodput-copus: the paper's
    # settings (core/control/policy_presets.py)
    specs["goodput-bare"] = [*common, "batch.policy='goodput'", *adaptive, *plan_overrides(start)]
    specs["goodput"] = [*specs["goodput-bare"], *([f"controller.profile={profile_path!r}"] if profile_path else [])]
    specs["goodput-copus"] = [*common, "batch.policy='goodput-copus'", *adaptive, *plan_overrides(start)]
    return specs


def default_policies(static: list[int], given: str = "") -> list[str]:
    """The legs to run: `given` (comma-separated) when set, else static-B for each static batch
    B (the ones profiled and given a plan) and every adaptive policy. Before, the default was
    every name of ALL_POLICIES, whose static-16 and static-64 have no spec unless --static
    lists them (bench/gpu.sh passed 8,32,128 and failed with "--policies ... unknown")."""
    if given:
        return [p for p in given.split(",") if p]
    return [f"static-{b}" for b in static] + [p for p in ALL_POLICIES if not p.startswith("static-")]


def group_of(policy: str) -> str:
    if policy.startswith("static-"):
        return STATIC_GROUP
    return CBS_GROUP if policy.startswith("gns-") else "other"


# --------------------------------------------------------------------------- running
def profile(args, out: Path) -> list[dict]:
    """`copus profile` at each static batch (the tuning the baselines get for free), with
    micro-batches ≥ B/16 (≤ 16 sequential micro-batches: smaller ones are slow and never best)."""
    rows = []
    for b in sorted({args.initial_batch, *args.static}):
        mbs = [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= b and 16 * m >= b]
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
            str(b),
            "--micro-batch-sizes",
            ",".join(map(str, mbs)),
            "--steps",
            str(args.profile_steps),
            "--out",
            str(out / f"B{b}"),
        ]
        for s in args.set:
            cmd += ["--set", s]
        print("profiling:", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
        rows += json.loads((out / f"B{b}" / "profile.json").read_text())
    (out / "profile.json").write_text(json.dumps(rows, indent=1))
    return rows


def run_seed(args, specs: dict[str, list[str]], seed: int, order: list[str], root: Path) -> None:
    """All policies of one seed in one worker set, in `order`, after a discarded warm-up."""
    from copus.config import load_config
    from copus.runtime.train.launch import launch

    seed_dir = root / f"seed{seed}"
    seed_dir.mkdir(parents=True, exist_ok=True)
    every = max(args.max_tokens // args.num_evals, 1)
    warm = [*specs[order[0]], "train.max_steps=3"]
    runs = [{"name": "warmup", "run_dir": str(seed_dir / "_warmup"), "overrides": warm, "eval_every_tokens": 1 << 62}]
    runs += [
        {
            "name": p,
            "run_dir": str(seed_dir / p),
            "overrides": [*specs[p], f"train.seed={seed}"],
            "eval_every_tokens": every,
        }
        for p in order
    ]
    for r in runs:
        load_config(None, r["overrides"])  # a bad setting fails here, not in a worker
        shutil.rmtree(r["run_dir"], ignore_errors=True)  # a writer appends to an old folder
    (seed_dir / REQUEST).write_text(json.dumps({"runs": runs}, indent=1))
    cfg = load_config(None, specs[order[0]])
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    launch(cfg, str(seed_dir), entry=_worker, max_restarts=0)
    info = {
        "seed": seed,
        "order": order,
        "wall_s": time.perf_counter() - t0,
        "load_avg_1min": [load0, os.getloadavg()[0]],
    }
    with open(seed_dir / "launches.jsonl", "a") as f:
        f.write(json.dumps(info) + "\n")
    print(
        f"seed {seed}: {', '.join(order)} in {info['wall_s']:.0f} s, load average "
        f"{load0:.1f} -> {info['load_avg_1min'][1]:.1f}",
        flush=True,
    )


# --------------------------------------------------------------------------- analysis (pure)
def eval_curve(run_dir: Path) -> tuple[list[float], list[float], float]:
    """(training wall times excluding evaluation, val losses, total eval seconds) of one run."""
    step_wall = {int(r["step"]): float(r["wall_s"]) for r in read_jsonl(run_dir / "metrics.jsonl")}
    times, losses, eval_total = [], [], 0.0
    for e in read_jsonl(run_dir / "eval.jsonl"):
        w = step_wall.get(int(e["step"]))
        if w is None or e.get("val_loss") is None or not math.isfinite(e["val_loss"]):
            continue
        times.append(w - eval_total)
        losses.append(float(e["val_loss"]))
        eval_total += max(float(e["wall_s"]) - w, 0.0)
    return times, losses, eval_total


def eval_tokens(run_dir: Path) -> tuple[list[float], list[float]]:
    """(tokens, val losses): the statistical side alone (no clock)."""
    rows = [
        e for e in read_jsonl(run_dir / "eval.jsonl") if e.get("val_loss") is not None and math.isfinite(e["val_loss"])
    ]
    return [float(e["tokens"]) for e in rows], [float(e["val_loss"]) for e in rows]


def loss_at(times: list[float], losses: list[float], when: float) -> float:
    """Val loss at wall time `when`, linear between evaluations (NaN outside the run)."""
    for i in range(1, len(times)):
        if times[i - 1] <= when <= times[i]:
            f = (when - times[i - 1]) / max(times[i] - times[i - 1], 1e-12)
            return losses[i - 1] + f * (losses[i] - losses[i - 1])
    return math.nan


def auto_targets(curves: dict, n: int = 5) -> list[float]:
    """n targets evenly from the median loss at a fifth of each run down to the best loss of
    the best static batch (per seed the lowest loss of any static run; the highest of those
    over seeds, so that every seed's best static run reaches it; the median best loss when
    there is no static run): spread over the whole run, the last one reached by the best
    static batch only at its end."""
    hi = statistics.median(loss_at(t, v, t[-1] * 0.2) for t, v in curves.values() if len(t) > 1)
    per_seed: dict[int, float] = {}
    for (p, seed), (_, v) in curves.items():
        if p.startswith("static-") and v:
            per_seed[seed] = min(per_seed.get(seed, math.inf), min(v))
    lo = max(per_seed.values()) if per_seed else statistics.median(min(v) for _, v in curves.values() if v)
    return [round(hi + (lo - hi) * k / (n - 1), 3) for k in range(n)]


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.fmean(xs) if xs else math.nan


def speedups(tt: dict[str, dict[int, float]], seeds: list[int], group: str | None) -> dict:
    """goodput vs the baseline (in `group`, None = any) with the lowest mean time at a target."""
    base = {p: s for p, s in tt.items() if not p.startswith("goodput") and (group is None or group_of(p) == group)}
    reached = {p: _mean([s[k] for k in seeds]) for p, s in base.items() if all(not math.isnan(s[k]) for k in seeds)}
    if not reached or "goodput" not in tt:
        return {"baseline": None}
    best = min(reached, key=reached.get)
    per_seed = [(tt[best][k] - tt["goodput"][k]) / tt[best][k] for k in seeds]
    finite = [x for x in per_seed if not math.isnan(x)]
    return {
        "baseline": best,
        "per_seed": per_seed,
        "mean": _mean(per_seed),
        "min": min(finite) if finite else math.nan,
        "max": max(finite) if finite else math.nan,
        "of_means": (reached[best] - _mean([tt["goodput"][k] for k in seeds])) / reached[best],
    }


def run_dirs(roots: list[Path]) -> dict[tuple[str, int], Path]:
    """(policy, seed) → run folder over every root (the first root wins on a duplicate)."""
    out: dict[tuple[str, int], Path] = {}
    for root in roots:
        for seed_dir in sorted(root.glob("seed*")):
            seed = int(seed_dir.name[4:])
            for run in sorted(p for p in seed_dir.iterdir() if p.is_dir() and p.name != "_warmup"):
                out.setdefault((run.name, seed), run)
    return out


def analyse(
    roots: list[Path], targets: list[float] | None, times_at: list[float] | None, medians: dict | None = None
) -> dict:
    """Time to each target (wall and replay) and loss at fixed times for every run under
    root/seed*/policy/ of every root."""
    from ttt_replay import replay_curve, replay_eval_curve

    curves, tok_curves, meta, replay = {}, {}, {}, {}
    for (name, seed), run in run_dirs(roots).items():
        t, v, ev = eval_curve(run)
        if len(t) < 2:
            continue
        curves[(name, seed)] = (t, v)
        tok_curves[(name, seed)] = eval_tokens(run)
        steps = read_jsonl(run / "metrics.jsonl")
        evals = [e for e in read_jsonl(run / "eval.jsonl") if e.get("val_loss") is not None]
        b_at = {int(r["step"]): r.get("b_noise") for r in steps}
        meta[(name, seed)] = {
            "eval_s": ev,
            "train_wall_s": steps[-1]["wall_s"] - ev,
            "tokens": steps[-1]["tokens"],
            "steps": steps[-1]["step"],
            "batch_end": steps[-1].get("global_batch_size"),
            "b_noise_first_eval": b_at.get(int(evals[0]["step"])),
            "b_noise_last_eval": b_at.get(int(evals[-1]["step"])),
            "root": str(run.parent.parent),
            "machine": json.loads((run / "load.json").read_text()) if (run / "load.json").exists() else None,
            "layouts": sorted({f"{r.get('dp')}x{r.get('tp')}x{r.get('pp')}" for r in steps}),
        }
        if medians:
            replay[(name, seed)] = replay_eval_curve(run, medians)
            rc = replay_curve(run, medians)
            meta[(name, seed)].update(
                replay_s=rc["replay_s"],
                unprofiled_steps=rc["unprofiled_steps"],
                interpolated_steps=rc["interpolated_steps"],
                switch_s=rc["switch_s"],
                probe_s=rc["probe_s"],
            )
    if not curves:
        raise ValueError(f"no runs with >= 2 evaluations under {', '.join(map(str, roots))}")
    policies = sorted({p for p, _ in curves}, key=lambda p: (ALL_POLICIES + (p,)).index(p))
    seeds = sorted({s for _, s in curves})
    targets = targets or auto_targets(curves)
    shortest = min(t[-1] for t, _ in curves.values())
    times_at = times_at or [round(shortest * f, 1) for f in (0.25, 0.5, 0.75, 1.0)]
    empty = ([], [])
    tt = {
        f"{x:g}": {p: {s: time_to_target(*curves.get((p, s), empty), x) for s in seeds} for p in policies}
        for x in targets
    }
    la = {f"{w:g}": {p: {s: loss_at(*curves.get((p, s), empty), w) for s in seeds} for p in policies} for w in times_at}
    rt = (
        {
            f"{x:g}": {p: {s: time_to_target(*replay.get((p, s), empty), x) for s in seeds} for p in policies}
            for x in targets
        }
        if replay
        else {}
    )
    most = max(m["tokens"] for m in meta.values())
    tokens_at = [round(most * f, -3) for f in (0.25, 0.5, 0.95)]
    lt = {
        f"{x:g}": {p: {s: loss_at(*tok_curves.get((p, s), empty), x) for s in seeds} for p in policies}
        for x in tokens_at
    }
    return {
        "targets": targets,
        "times_s": times_at,
        "seeds": seeds,
        "policies": policies,
        "time_to_target_s": tt,
        "replay_time_to_target_s": rt,
        "loss_at_time": la,
        "loss_at_tokens": lt,
        "speedup": {
            x: {
                "static": speedups(tt[x], seeds, STATIC_GROUP),
                "cbs": speedups(tt[x], seeds, CBS_GROUP),
                "any": speedups(tt[x], seeds, None),
            }
            for x in tt
        },
        "runs": {f"{p}/seed{s}": m for (p, s), m in meta.items()},
        "curves": {
            f"{p}/seed{s}": {
                "train_s": t,
                "val_loss": v,
                "replay_s": replay.get((p, s), ([], []))[0],
                "tokens": tok_curves[(p, s)][0],
            }
            for (p, s), (t, v) in curves.items()
        },
    }


# --------------------------------------------------------------------------- why (diagnostics)
def train_wall_at(run_dir: Path, steps: list[dict], step: int) -> float:
    """wall_s at `step` minus the evaluations before it."""
    wall = {int(r["step"]): float(r["wall_s"]) for r in steps}
    evals = [e for e in read_jsonl(run_dir / "eval.jsonl") if int(e["step"]) < step]
    return wall[step] - sum(max(float(e["wall_s"]) - wall[int(e["step"])], 0.0) for e in evals)


def noise_floor(roots: list[Path]) -> dict:
    """Wall-time spread of runs that trained IDENTICALLY so far (same plan, batch and seed, so
    the same losses): at the last step before any of them changed plan, (max − min)/min of
    wall_s. This is what timing noise alone does to a time-to-target on this machine."""
    out = {}
    by_seed: dict[int, dict[tuple, list[tuple[Path, list[dict]]]]] = {}
    for (_, seed), run in run_dirs(roots).items():
        steps = read_jsonl(run / "metrics.jsonl")
        if steps:
            by_seed.setdefault(seed, {}).setdefault(plan_key(steps[0]), []).append((run, steps))
    for seed, groups in sorted(by_seed.items()):
        for key, runs in groups.items():
            if len(runs) < 2:
                continue
            common = min(
                next((int(r["step"]) - 1 for r in st if plan_key(r) != key), int(st[-1]["step"])) for _, st in runs
            )
            if common < 2:
                continue
            walls = {run.name: train_wall_at(run, st, common) for run, st in runs}
            lo = min(walls.values())
            out[f"seed{seed}/B{key[-1]}"] = {
                "steps": common,
                "wall_s": walls,
                "spread": (max(walls.values()) - lo) / lo,
            }
    return out


def run_costs(run_dir: Path) -> dict:
    """Decisions, layout switches and their measured cost, batch trajectory, tokens/s."""
    steps = read_jsonl(run_dir / "metrics.jsonl")
    dec = [
        d for d in read_jsonl(run_dir / "decisions.jsonl") if d.get("applied", True) and "event" not in d
    ]  # not calibration/considered rows
    switches = [d for d in dec if d.get("kind") != "batch"]
    batches, layouts = [], []
    for r in steps:
        b, lay = r.get("global_batch_size"), f"{r.get('dp')}x{r.get('tp')}x{r.get('pp')}"
        if not batches or batches[-1][1] != b:
            batches.append((r["tokens"], b))
        if not layouts or layouts[-1][1] != lay:
            layouts.append((r["tokens"], lay))
    return {
        "num_decisions": len(dec),
        "num_layout_switches": len(switches),
        "switch_s": sum(float(d.get("switch_s") or 0.0) for d in dec),
        "batch_at_tokens": batches,
        "layout_at_tokens": layouts,
        "b_noise_end": steps[-1].get("b_noise") if steps else None,
    }


def throughput_surface(rows: list[dict]) -> dict:
    """Per global batch from the profile: the fastest plan, and how much slower the fastest plan
    of every other layout is (a flat surface leaves the layout choice little to win)."""
    out = {}
    for b in sorted({int(r["global_batch_size"]) for r in rows}):
        by_layout: dict[str, dict] = {}
        for r in rows:
            if int(r["global_batch_size"]) == b:
                lay = f"{r['dp']}x{r['tp']}x{r['pp']}"
                if lay not in by_layout or r["samples_per_s"] > by_layout[lay]["samples_per_s"]:
                    by_layout[lay] = r
        best = max(by_layout.values(), key=lambda r: r["samples_per_s"])
        out[str(b)] = {
            "best": f"{best['dp']}x{best['tp']}x{best['pp']} mb{best['micro_batch_size']}",
            "samples_per_s": best["samples_per_s"],
            "layout_vs_best": {
                k: round(v["samples_per_s"] / best["samples_per_s"], 3) for k, v in sorted(by_layout.items())
            },
        }
    return out


# --------------------------------------------------------------------------- report
def _cell(xs: list[float], spec: str = ".0f") -> str:
    ok = [x for x in xs if not math.isnan(x)]
    if not ok:
        return "–"
    m = statistics.fmean(ok)
    miss = f" ({len(xs) - len(ok)} miss)" if len(ok) < len(xs) else ""
    return (f"{m:{spec}} ± {statistics.stdev(ok):{spec}}" if len(ok) > 1 else f"{m:{spec}}") + miss


def _fmt_num(x) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.0f}"


def _pct(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else f"{100 * x:+.1f}%"


def markdown(res: dict) -> str:
    seeds, pols = res["seeds"], res["policies"]
    keys = list(res["time_to_target_s"])
    lines = [
        f"Time to target validation loss (s, mean ± sd over seeds {seeds}; training wall "
        "time without evaluation) and loss at fixed wall times.",
        "",
        "| policy | "
        + " | ".join(f"t→{k}" for k in keys)
        + " | "
        + " | ".join(f"loss@{w}s" for w in res["loss_at_time"])
        + " |",
        "|" + "---|" * (1 + len(keys) + len(res["loss_at_time"])),
    ]
    for p in pols:
        cells = [_cell([res["time_to_target_s"][k][p][s] for s in seeds]) for k in keys]
        cells += [_cell([res["loss_at_time"][w][p][s] for s in seeds], ".3f") for w in res["loss_at_time"]]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lt = res.get("loss_at_tokens", {})
    if lt:
        lines += [
            "",
            "Same tokens, no clock (statistical efficiency) and throughput:",
            "",
            "| policy | " + " | ".join(f"loss@{float(x) / 1000:.0f}k tokens" for x in lt) + " | tokens/s (train) |",
            "|" + "---|" * (2 + len(lt)),
        ]
        for p in pols:
            tps = [
                res["runs"][f"{p}/seed{s}"]["tokens"] / res["runs"][f"{p}/seed{s}"]["train_wall_s"]
                for s in seeds
                if f"{p}/seed{s}" in res["runs"]
            ]
            cells = [_cell([lt[x][p][s] for s in seeds], ".3f") for x in lt]
            lines.append(f"| {p} | " + " | ".join(cells) + f" | {_cell(tps)} |")
    rt = res.get("replay_time_to_target_s") or {}
    if rt:
        lines += [
            "",
            "Replay time to target (s; profiled median step time of each step's plan "
            "+ measured switch and probe costs: no timing noise):",
            "",
            "| policy | " + " | ".join(f"t→{k}" for k in rt) + " | replay s (run) | "
            "wall s (run) | b_noise first → last eval |",
            "|" + "---|" * (4 + len(rt)),
        ]
        for p in pols:
            cells = [_cell([rt[k][p][s] for s in seeds]) for k in rt]
            runs = [res["runs"].get(f"{p}/seed{s}") for s in seeds]
            runs = [r for r in runs if r]
            bn = "; ".join(
                f"{_fmt_num(r.get('b_noise_first_eval'))} → {_fmt_num(r.get('b_noise_last_eval'))}" for r in runs
            )
            cells += [_cell([r.get("replay_s", math.nan) for r in runs]), _cell([r["train_wall_s"] for r in runs]), bn]
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    goal = res.get("goal") or {}
    for clock, g in goal.items():
        vs, vc = g["vs_static"], g["vs_cbs"]
        lines.append(
            f"- goal ({clock} time, last target {g['target']}): goodput vs best static "
            f"{vs['baseline']} {_pct(vs['median'])} (needs >= +12%), vs best CBS "
            f"{vc['baseline']} {_pct(vc['median'])} (needs >= +5%): "
            f"{'MET' if g['met'] else 'NOT MET'}"
        )
    lines += [
        "",
        "Speed-up of goodput = (T_base − T_goodput)/T_base, T_base = the baseline with "
        "the lowest mean time at that target; mean [min, max] of the per-seed speed-ups.",
        "",
        "| target | best static | vs static | best CBS | vs CBS | best of all | vs all |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in keys:
        row = [k]
        for g in ("static", "cbs", "any"):
            s = res["speedup"][k][g]
            row += [
                s["baseline"] or "–",
                "–" if s["baseline"] is None else f"{_pct(s['mean'])} [{_pct(s['min'])}, {_pct(s['max'])}]",
            ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines + diagnostics_lines(res)) + "\n"


def diagnostics_lines(res: dict) -> list[str]:
    """Timing noise, goodput's switches and the profiled throughput surface, in a few lines."""
    out = ["", "Diagnostics:"]
    nf = res.get("noise_floor", {})
    if nf:
        spreads = ", ".join(f"{k} {100 * v['spread']:.0f}% over {v['steps']} steps" for k, v in nf.items())
        out.append(f"- timing noise (runs with identical steps so far; (max-min)/min of training wall time): {spreads}")
    for name, c in sorted(res.get("costs", {}).items()):
        if name.startswith("goodput"):
            b = " → ".join(f"{bs}@{t // 1000}k" for t, bs in c["batch_at_tokens"])
            lay = " → ".join(f"{x}@{t // 1000}k" for t, x in c["layout_at_tokens"])
            out.append(
                f"- {name}: {c['num_decisions']} decisions, {c['num_layout_switches']} "
                f"layout switches ({c['switch_s']:.1f} s); batch {b}; layouts {lay}"
            )
    for b, t in res.get("throughput_surface", {}).items():
        others = ", ".join(f"{k} {v:.2f}" for k, v in t["layout_vs_best"].items())
        out.append(
            f"- profile B={b}: fastest {t['best']} ({t['samples_per_s']:.1f} samples/s); "
            f"best plan per layout relative to it: {others}"
        )
    return out


def plot(res: dict, seed: int, path: Path) -> None:
    """Validation loss vs training wall time (evaluation excluded), one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for p in res["policies"]:
        c = res["curves"].get(f"{p}/seed{seed}")
        if p.startswith("goodput-"):  # diagnostic variants (maybe run at another time)
            continue
        if c:
            ax.plot(
                c["train_s"],
                c["val_loss"],
                label=p,
                lw=2.2 if p == "goodput" else 1.2,
                color="black" if p == "goodput" else None,
            )
    for x in res["targets"]:
        ax.axhline(x, color="grey", lw=0.5, ls=":")
    lo = min(res["targets"]) - 0.15
    ax.set_ylim(lo, max(res["targets"]) + 0.6)
    ax.set_xlabel("training wall time, evaluation excluded (s)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"tiny model, 4 CPU ranks, seed {seed}; dotted: targets")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main
def _json_safe(x):
    """NaN → None (strict JSON), int dict keys → str."""
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def _floats(text: str) -> list[float] | None:
    return None if text in ("", "auto") else [float(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--policies",
        default="",
        help="comma-separated; default: static-B for each --static B, then every adaptive policy",
    )
    ap.add_argument("--static", default="8,32,128", help="static global batch sizes")
    ap.add_argument("--initial-batch", type=int, default=8, help="B0: start of adaptive policies")
    ap.add_argument(
        "--max-batch", type=int, default=0, help="batch.max of the adaptive policies (0: the largest --static)"
    )
    ap.add_argument("--max-tokens", type=int, default=250_000)
    ap.add_argument("--warmup-tokens", type=int, default=25_000)
    ap.add_argument("--lr", type=float, default=3e-3, help="LR at B0 (sqrt rule above it)")
    ap.add_argument(
        "--num-evals", type=int, default=40, help="evaluate every max_tokens/num_evals tokens (same grid for every run)"
    )
    ap.add_argument("--eval-samples", type=int, default=32, help="fixed validation windows")
    ap.add_argument("--targets", default="auto", help="val-loss targets, or auto")
    ap.add_argument("--times", default="auto", help="wall times (s) for loss-at-time, or auto")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="tiny")
    ap.add_argument(
        "--profile",
        default="",
        help="copus profile.json file(s) to reuse, comma-separated (also priced for the replay time)",
    )
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="extra config override for every run and the profile",
    )
    ap.add_argument("--runs", default="", help="run folders root (default runs/time_to_target)")
    ap.add_argument("--from", dest="from_", default="", help="analyse these runs roots only (comma-separated: merged)")
    ap.add_argument("--quick", action="store_true", help="1 seed, 4 policies, 40k tokens")
    ap.add_argument("--out", default="", help="JSON path (default bench/results/time_to_target.json)")
    ap.add_argument("--plot", default="", help="PNG: val loss vs time of the first seed")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.max_tokens, args.warmup_tokens = "0", 40_000, 5_000
        args.policies, args.static, args.num_evals = "static-8,static-32,gns-start,goodput", "8,32", 20
        args.profile_steps = 1
    args.static = [int(x) for x in args.static.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    policies = default_policies(args.static, args.policies)
    out = (
        Path(args.out) if args.out else RESULTS / ("time_to_target_quick.json" if args.quick else "time_to_target.json")
    )
    roots = [
        Path(r)
        for r in (args.from_ or args.runs or ("runs/time_to_target" + ("_quick" if args.quick else ""))).split(",")
        if r
    ]
    root = roots[0]
    prof_rows = [r for f in args.profile.split(",") if f for r in json.loads(Path(f).read_text())]
    if not args.from_:
        from copus.core.specs.resolve import get_model_shape

        seq_len = get_model_shape(args.model).seq_len
        rows = prof_rows or profile(args, root / "profile")
        root.mkdir(parents=True, exist_ok=True)
        (root / "profile_all.json").write_text(json.dumps(rows, indent=1))
        specs = run_specs(args, best_plans(rows), seq_len, str((root / "profile_all.json").resolve()))
        unknown = [p for p in policies if p not in specs]
        if unknown:
            raise ValueError(f"--policies: {unknown} unknown; allowed: {', '.join(specs)}")
        root.mkdir(parents=True, exist_ok=True)
        old = json.loads((root / "specs.json").read_text()) if (root / "specs.json").exists() else {}
        (root / "specs.json").write_text(json.dumps({**old, **{p: specs[p] for p in policies}}, indent=1))
        for i, seed in enumerate(seeds):  # each policy at a different place per seed
            k = i * len(policies) // len(seeds)
            order = policies[k:] + policies[:k]
            run_seed(args, specs, seed, order[::-1] if i % 2 else order, root)
    from ttt_replay import goal_check, profile_medians

    for r in roots:
        if (r / "profile" / "profile.json").exists() and not prof_rows:
            prof_rows = json.loads((r / "profile" / "profile.json").read_text())
    res = analyse(roots, _floats(args.targets), _floats(args.times), profile_medians(prof_rows) if prof_rows else None)
    res["goal"] = goal_check(res)
    res["specs"] = {}
    for r in roots:
        if (r / "specs.json").exists():
            res["specs"].update(json.loads((r / "specs.json").read_text()))
    res["seed_runs"] = [
        {**x, "root": str(r)} for r in roots for p in sorted(r.glob("seed*/launches.jsonl")) for x in read_jsonl(p)
    ]
    res["noise_floor"] = noise_floor(roots)
    res["costs"] = {f"{name}/seed{seed}": run_costs(run) for (name, seed), run in run_dirs(roots).items()}
    if prof_rows:
        res["throughput_surface"] = throughput_surface(prof_rows)
    res["command"] = "python bench/time_to_target.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_json_safe(res), indent=1))
    if args.plot:
        plot(res, res["seeds"][0], Path(args.plot))
    table = markdown(res)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
