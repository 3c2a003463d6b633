"""`copus profile`: measure step time, tokens/s and peak memory of parallel plans.

    copus profile --nproc 4 --global-batch 8,32,128 --micro-batch-sizes 1,2,4,8 --out profile/

Writes `profile.json` (list of rows) and `profile.csv` in `--out`; the rows are what the
step-time model is fitted on (`copus.core.cost.fit`) and what `controller.profile` reads.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import tempfile
from pathlib import Path

COLUMNS = (
    "dp",
    "tp",
    "pp",
    "micro_batch_size",
    "num_microbatches",
    "global_batch_size",
    "step_s",
    "samples_per_s",
    "tokens_per_s",
    "peak_memory_bytes",
)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag}={text!r} is invalid; allowed: comma-separated integers >= 1")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=4, help="local worker processes (default 4)")
    p.add_argument("--model", default="tiny", help="model name (default tiny)")
    p.add_argument("--global-batch", default="8,32,128", help="global batch sizes to profile")
    p.add_argument("--micro-batch-sizes", default="1,2,4,8,16", help="micro-batch sizes")
    p.add_argument(
        "--layouts",
        default="",
        help="only these comma-separated layouts, e.g. dp4.tp1.pp1,dp2.tp1.pp2 (older 4x1x1 spellings accepted)",
    )
    p.add_argument("--sample", type=int, default=0, help="profile a random sample of N plans (0 = all)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per plan (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per plan")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and of --sample")
    p.add_argument("--config", default=None, help="TOML config (engine settings)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)"
    )
    p.add_argument("--out", default="profile", help="output folder (default profile/)")


def select_plans(args: argparse.Namespace, shape):
    from copus.core.plan.layout_names import parse_layout
    from copus.core.plan.plan import enumerate_plans

    plans = list(
        enumerate_plans(
            args.nproc,
            _ints(args.global_batch, "--global-batch"),
            _ints(args.micro_batch_sizes, "--micro-batch-sizes"),
            shape,
        )
    )
    if args.layouts:
        wanted = set()
        for item in args.layouts.split(","):
            try:
                wanted.add(parse_layout(item))
            except ValueError as err:
                raise ValueError(f"--layouts item {item.strip()!r}: {err}") from None
        plans = [p for p in plans if p.layout in wanted]
    if args.sample:
        random.Random(args.seed).shuffle(plans)
        plans = plans[: args.sample]
    if not plans:
        raise ValueError(
            "no valid plan matches --global-batch/--micro-batch-sizes/--layouts "
            f"for --nproc={args.nproc} and --model={args.model!r}"
        )
    return sorted(plans, key=lambda p: (p.layout, p.global_batch_size, p.micro_batch_size))


def check_out_folder(out: Path, given: str) -> None:
    """Fail before profiling (minutes of work) when `out` cannot become a folder: it, or the
    nearest part of its path that exists, is a file, or that part is not writable."""
    here = out
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        what = "exists and is not a folder" if here == out else f"is inside {str(here)!r}, a file"
        raise ValueError(f"--out={given!r} {what}; allowed: a folder path")
    if not os.access(here, os.W_OK):
        raise ValueError(f"--out={given!r}: {str(here)!r} is not writable; allowed: a writable folder")


def write_table(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(rows, indent=1))
    with open(out / "profile.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def run(args: argparse.Namespace) -> int:
    from copus.config import load_config
    from copus.core.specs.resolve import get_model_shape

    if args.nproc < 1 or args.steps < 1 or args.warmup < 0:
        raise ValueError(
            f"--nproc={args.nproc} --steps={args.steps} --warmup={args.warmup}: "
            "allowed: nproc >= 1, steps >= 1, warmup >= 0"
        )
    cfg = load_config(
        args.config,
        [*args.set, f"model.name={args.model!r}", f"parallel.nproc={args.nproc}", f"train.seed={args.seed}"],
    )
    shape = get_model_shape(cfg.model.name, cfg.model.seq_len)
    plans = select_plans(args, shape)
    out = Path(args.out)
    check_out_folder(out, args.out)
    print(f"profiling {len(plans)} plans of {shape.name} on {args.nproc} ranks")
    from copus.runtime.train.launch import launch
    from copus.runtime.train.profile import profile_worker, write_request

    with tempfile.TemporaryDirectory(prefix="copus-profile-") as tmp:
        write_request(Path(tmp), plans, args.steps, args.warmup)
        result = launch(cfg, tmp, entry=profile_worker, max_restarts=0)
    from copus.core.plan.layout_names import layout_name

    rows = sorted(result["rows"], key=lambda r: -r["samples_per_s"])
    write_table(rows, out)
    print(
        f"wrote {args.out}/profile.json and profile.csv; fastest: "
        f"{layout_name(rows[0]['dp'], rows[0]['tp'], rows[0]['pp'], rows[0]['micro_batch_size'])} "
        f"B={rows[0]['global_batch_size']} {rows[0]['tokens_per_s']:.0f} tokens/s"
    )
    return 0
