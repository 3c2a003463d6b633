"""`copus calibrate RUN_DIR`: the measured critical batch and noise-scale calibration `c`.

From each chosen checkpoint of a run, branches train at `k·B` (the run's LR rule applied to the
new batch: √k for the default "sqrt") on the same samples and for the same tokens, in the same
processes (`runtime/train/branching.py`), and are scored on the same validation windows. Per
checkpoint: the critical batch (Merrill et al. 2025, §3.1, ε from the measured noise floor of
repeats), the McCandlish B_noise fit, the online b_noise and their ratio `c`
(`core/stats/critical_batch.py`). Writes `<out>/calibration.json`, `calibration.md` (the table) and
`calibration.png` (critical batch and c·b_noise against tokens); prints the table and the cost.

Everything is checked before a worker starts: a folder without checkpoints, a checkpoint of
another model, multipliers that are not positive or give a batch no plan can run, --tokens ≤ 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from copus.atomic import atomic_write_text

DEFAULT_MULTIPLIERS = "0.5,1,2,4,8"
DEFAULT_BASE_STEPS = 64  # default --tokens: 64 steps at the checkpoint's batch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run folder with config.toml and checkpoints/")
    p.add_argument("--steps", help="checkpoint steps, comma-separated (default: first, middle, last)")
    p.add_argument(
        "--multipliers",
        default=DEFAULT_MULTIPLIERS,
        help=f"batch multipliers k, comma-separated (default {DEFAULT_MULTIPLIERS})",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help=f"tokens per branch T (default {DEFAULT_BASE_STEPS} steps at the checkpoint's "
        "batch; rounded up so every branch takes whole steps)",
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="repeats of every branch on disjoint samples (noise floor ε; default 2)"
    )
    p.add_argument("--epsilon", type=float, default=None, help="fixed ε instead of the measured noise floor")
    p.add_argument(
        "--marks", type=int, default=4, help="evaluations per branch (the EMA-smoothed loss curve; default 4)"
    )
    p.add_argument("--out", metavar="DIR", help="output folder (default RUN_DIR/calibration)")


# ------------------------------------------------------------------------------------ checks


def parse_multipliers(text: str) -> list[float]:
    try:
        ks = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--multipliers={text!r}: allowed: comma-separated numbers > 0") from None
    bad = [k for k in ks if not (math.isfinite(k) and k > 0)]
    if not ks or bad:
        raise ValueError(
            f"--multipliers={text!r}: {bad[0] if bad else 'empty'} is not allowed; allowed: comma-separated numbers > 0"
        )
    if len(set(ks)) != len(ks):
        raise ValueError(f"--multipliers={text!r}: allowed: distinct values")
    return sorted(ks)


def _valid_checkpoints(run_dir: Path) -> dict[int, Path]:
    from copus.runtime.state import checkpoint as ckpt

    root = run_dir / "checkpoints"
    found = {step: path for step, path in ckpt.step_dirs(root) if ckpt.verify(path) is None}
    if not found:
        raise ValueError(
            f"{run_dir}: no valid checkpoint in {root}; allowed: a run folder "
            "written by copus train with checkpoints (checkpoint.interval_steps)"
        )
    return found


def choose_checkpoints(found: dict[int, Path], steps: str | None) -> list[Path]:
    """The --steps checkpoints, else the first, middle and last."""
    avail = sorted(found)
    if steps is None:
        picks = sorted({avail[0], avail[len(avail) // 2], avail[-1]})
        return [found[s] for s in picks]
    try:
        wanted = [int(x) for x in steps.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--steps={steps!r}: allowed: comma-separated checkpoint steps ({', '.join(map(str, avail))})"
        ) from None
    missing = [s for s in wanted if s not in found]
    if not wanted or missing:
        raise ValueError(
            f"--steps={steps!r}: no checkpoint step {missing[0] if missing else ''}; "
            f"allowed: {', '.join(map(str, avail))}"
        )
    return [found[s] for s in sorted(set(wanted))]


def check_checkpoint(path: Path, cfg, multipliers: list[float], tokens: int | None) -> int:
    """A checkpoint of the run's model whose k·B all have a plan; returns its world size."""
    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.train.branching import branch_plan
    from copus.runtime.state.checkpoint import TRAINER_STATE
    from copus.runtime.train.progress import plan_from_dict

    state = json.loads((path / TRAINER_STATE).read_text())
    if state.get("model") != cfg.model.name:
        raise ValueError(
            f"{path}: a checkpoint of model {state.get('model')!r}; allowed: the "
            f"run's model {cfg.model.name!r} (config.toml)"
        )
    world = int(state.get("world_size") or cfg.parallel.nproc)
    plan = plan_from_dict(state["plan"])
    shape = get_model_shape(cfg.model.name)
    for k in multipliers:
        try:
            branch_plan(plan, k * plan.global_batch_size, world, shape)
        except ValueError as exc:
            raise ValueError(f"--multipliers: k={k:g} at {path.name} (B={plan.global_batch_size}): {exc}") from None
    return world


def prepare(args: argparse.Namespace) -> tuple[object, list[Path], dict, Path]:
    """Everything checked, nothing started: (config, checkpoints, request, out folder)."""
    from copus.config import load_config

    if args.tokens is not None and args.tokens <= 0:
        raise ValueError(f"--tokens={args.tokens}: allowed: an integer > 0")
    if args.repeats < 1 or (args.repeats < 2 and args.epsilon is None):
        raise ValueError(f"--repeats={args.repeats}: allowed: >= 2 (the noise floor ε), or >= 1 with --epsilon")
    if args.epsilon is not None and not (math.isfinite(args.epsilon) and args.epsilon >= 0):
        raise ValueError(f"--epsilon={args.epsilon}: allowed: a number >= 0")
    if args.marks < 1:
        raise ValueError(f"--marks={args.marks}: allowed: an integer >= 1")
    multipliers = parse_multipliers(args.multipliers)
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ValueError(f"{run_dir}: no config.toml; allowed: a run folder written by copus train")
    cfg = load_config(str(run_dir / "config.toml"))
    paths = choose_checkpoints(_valid_checkpoints(run_dir), args.steps)
    worlds = {check_checkpoint(p, cfg, multipliers, args.tokens) for p in paths}
    if len(worlds) != 1:
        raise ValueError(
            f"checkpoints {', '.join(p.name for p in paths)} were written at world "
            f"sizes {sorted(worlds)}; allowed: one world size per call (--steps)"
        )
    world = worlds.pop()
    cfg = load_config(
        str(run_dir / "config.toml"), [f"parallel.nproc={world}", "log.progress=false", "log.tensorboard=false"]
    )
    from copus.core.specs.resolve import get_model_shape

    seq = get_model_shape(cfg.model.name).seq_len
    tokens = args.tokens if args.tokens is not None else DEFAULT_BASE_STEPS * cfg.batch.initial * seq
    request = {
        "checkpoints": [str(p) for p in paths],
        "multipliers": multipliers,
        "tokens": int(tokens),
        "repeats": int(args.repeats),
        "epsilon": args.epsilon,
        "num_marks": int(args.marks),
    }
    out = Path(args.out) if args.out else run_dir / "calibration"
    return cfg, paths, request, out


# ------------------------------------------------------------------------------------ output


def _f(x, spec: str = ".3g") -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def table(rows: list[dict]) -> str:
    """The calibration table (markdown)."""
    head = (
        "| step | tokens | B | critical batch [interval] | ε | B_noise fit | online b_noise "
        "| c = fit/online | c per repeat | cost tokens | cost s |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        cb = r["critical_batch"]
        interval = f"{_f(cb['lower'], 'g')}–{_f(cb['upper'], 'g') if cb['upper'] else '∞'}"
        reps = ", ".join(_f(c, ".2f") for c in r["c_repeats"])
        lines.append(
            f"| {r['step']} | {r['tokens']:,} | {r['base_batch']:g} | "
            f"{_f(cb['value'], '.3g')} [{interval}] | {_f(r['epsilon'], '.4f')} | "
            f"{_f(r['b_noise_fit'])} | {_f(r['b_noise_online'])} | {_f(r['c'], '.2f')} | "
            f"{reps} | {r['cost']['tokens']:,} | {r['cost']['seconds']:.1f} |"
        )
    loss_lines = [
        "",
        "| step | " + " | ".join(f"B={b}" for b in _batches(rows)) + " |",
        "|---|" + "---|" * len(_batches(rows)),
    ]
    for r in rows:
        means = {float(b): v for b, v in r["mean_loss"].items()}
        loss_lines.append(
            f"| {r['step']} | "
            + " | ".join(_f(means.get(float(b)), ".4f") for b in _batches(rows))
            + f" |  (start {r['start_loss']:.4f})"
        )
    return "\n".join(lines + loss_lines) + "\n"


def _batches(rows: list[dict]) -> list[int]:
    return sorted({int(float(b)) for r in rows for b in r["mean_loss"]})


def plot(rows: list[dict], metrics_path: Path, path: Path) -> None:
    """Critical batch (interval) and B_noise fit per checkpoint; the run's online b_noise
    times the median measured c, against tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    tok = [r["tokens"] for r in rows]
    cb = [r["critical_batch"] for r in rows]
    val = np.array([c["value"] for c in cb], float)
    lo = val - np.array([c["lower"] for c in cb], float)
    hi = np.array([(c["upper"] or c["value"]) for c in cb], float) - val
    ax.errorbar(tok, val, yerr=[lo, hi], fmt="o", capsize=4, label="critical batch (branching)")
    ax.plot(tok, [r["b_noise_fit"] if r["b_noise_fit"] is not None else np.nan for r in rows], "s", label="B_noise fit")
    cs = [r["c"] for r in rows if r["c"] is not None and math.isfinite(r["c"])]
    if cs and metrics_path.is_file():
        c = float(np.median(cs))
        pts = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        xs = [p["tokens"] for p in pts if p.get("b_noise") is not None]
        ys = [c * p["b_noise"] for p in pts if p.get("b_noise") is not None]
        ax.plot(xs, ys, "-", lw=1, label=f"c·b_noise (online, c = {c:.2f})")
    ax.set_xlabel("tokens")
    ax.set_ylabel("global batch (samples)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(rows: list[dict], run_dir: Path, out: Path, command: str) -> str:
    from copus.runtime.state.metrics import json_safe

    out.mkdir(parents=True, exist_ok=True)
    text = table(rows)
    cost_tokens = sum(r["cost"]["tokens"] for r in rows)
    cost_s = sum(r["cost"]["seconds"] for r in rows)
    footer = f"\ncost: {cost_tokens:,} tokens, {cost_s:.1f} s ({command})\n"
    atomic_write_text(
        out / "calibration.json",
        json.dumps(
            json_safe({"command": command, "checkpoints": rows, "cost": {"tokens": cost_tokens, "seconds": cost_s}}),
            indent=1,
        ),
    )
    atomic_write_text(out / "calibration.md", text + footer)
    plot(json_safe(rows), run_dir / "metrics.jsonl", out / "calibration.png")
    return text + footer


def run(args: argparse.Namespace) -> int:
    cfg, paths, request, out = prepare(args)

    from copus.runtime.train import launch
    from copus.runtime.train.branching import REQUEST
    from copus.runtime.train.launch import calibrate_worker

    print(
        f"copus calibrate: {len(paths)} checkpoint(s) {', '.join(p.name for p in paths)}; "
        f"k = {', '.join(f'{k:g}' for k in request['multipliers'])}; {request['tokens']:,} "
        f"tokens per branch, {request['repeats']} repeats",
        file=sys.stderr,
    )
    work = out / "workers"
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_text(work / REQUEST, json.dumps(request))
    try:
        result = launch.launch(cfg, str(work), max_restarts=0, entry=calibrate_worker)
    except Exception as exc:  # ChildFailedError and friends
        print(
            f"copus calibrate: error: workers failed ({exc.__class__.__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})",
            file=sys.stderr,
        )
        return 1
    if result.get("error"):
        print(f"copus calibrate: error: {result['error']}", file=sys.stderr)
        return 2 if result.get("kind") == "value" else 1
    command = "copus calibrate " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "copus calibrate"
    print(write_outputs(result["checkpoints"], Path(args.run_dir), out, command))
    print(f"copus calibrate: wrote {out}/calibration.{{json,md,png}}", file=sys.stderr)
    return 0
