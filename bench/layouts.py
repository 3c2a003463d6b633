"""Step time and peak memory per (dp, tp, pp) layout and micro-batch size (issue 4).

    python bench/layouts.py                       # 4 CPU ranks (gloo), tiny model, B = 32
    python bench/layouts.py --nproc 8 --model small --global-batch 64   # e.g. on a GPU node (NCCL)

Runs `copus profile` over every valid layout for the world size at one global batch and several
micro-batch sizes (3 timed steps after 1 warm-up, median), then writes
bench/results/layouts.json and prints a layout × micro-batch table of ms/step and peak MB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch-sizes", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    out = RESULTS.parent.parent / "runs" / "bench" / "layouts_profile"  # raw: git-ignored; rows go to layouts.json
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
        str(args.global_batch),
        "--micro-batch-sizes",
        args.micro_batch_sizes,
        "--steps",
        str(args.steps),
        "--warmup",
        "1",
        "--out",
        str(out),
    ]
    for s in args.set:
        cmd += ["--set", s]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    rows = json.loads((out / "profile.json").read_text())
    mbss = sorted({r["micro_batch_size"] for r in rows})
    layouts = sorted({(r["pp"], r["dp"], r["tp"]) for r in rows})
    cell = {(r["pp"], r["dp"], r["tp"], r["micro_batch_size"]): r for r in rows}
    result = {
        "command": " ".join(cmd[1:]),
        "model": args.model,
        "nproc": args.nproc,
        "global_batch_size": args.global_batch,
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "layouts.json").write_text(json.dumps(result, indent=1))
    best = min(rows, key=lambda r: r["step_s"])
    print(f"\n{args.model}, {args.nproc} ranks, B={args.global_batch}: ms/step (peak MB per rank)")
    print("| pp,dp,tp | " + " | ".join(f"mb={m}" for m in mbss) + " |")
    print("|---|" + "---|" * len(mbss))
    for lay in layouts:
        cells = []
        for m in mbss:
            r = cell.get((*lay, m))
            mark = "**" if r is best else ""
            cells.append(
                "–" if r is None else f"{mark}{r['step_s'] * 1e3:.0f}{mark} ({r['peak_memory_bytes'] / 2**20:.0f})"
            )
        print(f"| {lay[0]},{lay[1]},{lay[2]} | " + " | ".join(cells) + " |")
    worst = max(rows, key=lambda r: r["step_s"])
    print(f"\nspread worst/best: {worst['step_s'] / best['step_s']:.1f}x")


if __name__ == "__main__":
    main()
