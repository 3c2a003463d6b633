"""Activation checkpointing modes: step time and activation bytes, single process, interleaved.

One model per mode ("none", "selective", "full"; `runtime/engine/parallelize.py`) of the same
shape and weights; each repeat runs forward + backward of every mode in rotating order (repeat i
starts at mode i mod 3) on the same micro-batch, for each micro-batch size. Reported: median
time per mode, the ratios to "none", and the exact bytes each mode keeps for backward
(`runtime/engine/activation_memory.py`, live storages after the forward). Goal (issue 24):
selective ≤ 1.15× none and ≥ 40 % of the bytes saved, on `small`.

    python bench/activation_checkpointing.py [--model small] [--mbs 1,4,8] [--repeats 7] [--compile]

`--compile`: each block torch.compile'd (inductor; warm-up repeats absorb the compiles; bytes
are still counted eagerly); writes activation_checkpointing_compile.json.

Writes bench/results/activation_checkpointing.json. One thread, one process (no communication
noise); on a shared machine the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "activation_checkpointing.json"


def run(model_name: str, mbs: int, repeats: int, warmup: int, compile: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.engine.activation_memory import measure_activation_bytes
    from copus.runtime.engine.model import build_model, materialize
    from copus.runtime.engine.parallelize import AC_MODES, apply_ac, apply_compile

    shape = get_model_shape(model_name)
    tokens = torch.randint(0, shape.vocab_size, (mbs, shape.seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:].flatten()
    models = {}
    for mode in AC_MODES:
        models[mode] = materialize(build_model(shape, "cpu"), "cpu", 0)
        apply_ac(models[mode], mode)
    nbytes = {}
    for mode, m in models.items():
        logits, b = measure_activation_bytes(m, lambda m=m: m(x), (tokens,))
        nbytes[mode] = b.live_bytes
        del logits
    if compile:  # after the byte count (eager): compiled kernels bypass the dispatch mode
        for m in models.values():
            apply_compile(m)
    times: dict[str, list[float]] = {mode: [] for mode in AC_MODES}
    for i in range(warmup + repeats):
        for mode in AC_MODES[i % 3 :] + AC_MODES[: i % 3]:
            m = models[mode]
            t0 = time.perf_counter()
            F.cross_entropy(m(x).flatten(0, 1), y).backward()
            dt = time.perf_counter() - t0
            for p in m.parameters():
                p.grad = None
            if i >= warmup:
                times[mode].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "micro_batch_size": mbs,
        "median_s": med,
        "ratio_to_none": {k: v / med["none"] for k, v in med.items()},
        "bytes": nbytes,
        "saved_vs_none": {k: 1 - v / nbytes["none"] for k, v in nbytes.items()},
        "times": times,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--mbs", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (inductor)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = RESULTS.with_name(RESULTS.stem + "_compile.json") if args.compile else RESULTS
    try:
        sizes = [int(v) for v in args.mbs.split(",")]
        assert sizes and min(sizes) >= 1
    except (ValueError, AssertionError):
        print(f"--mbs={args.mbs!r}: allowed: comma-separated integers >= 1", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    rows = [run(args.model, s, args.repeats, args.warmup, args.compile) for s in sizes]
    out = {
        "bench": "activation_checkpointing",
        "model": args.model,
        "repeats": args.repeats,
        "order": "rotating (repeat i starts at mode i mod 3)",
        "threads": 1,
        "compile": args.compile,
        "rows": rows,
        "goals": {"selective_over_none_max": 1.15, "selective_bytes_saved_min": 0.40},
        "host": platform.node(),
        "python": sys.version.split()[0],
        "load_average_1min_after": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"model {args.model}, compile={args.compile}, 1 thread, {args.repeats} repeats, load "
        f"{out['load_average_1min_after']:.1f}"
    )
    print(
        f"{'mbs':>4}{'none':>10}{'selective':>11}{'full':>9}{'sel/none':>10}{'full/none':>10}"
        f"{'sel saved':>11}{'full saved':>11}"
    )
    for r in rows:
        m, q, s = r["median_s"], r["ratio_to_none"], r["saved_vs_none"]
        print(
            f"{r['micro_batch_size']:>4}{m['none'] * 1e3:>8.0f}ms{m['selective'] * 1e3:>9.0f}ms"
            f"{m['full'] * 1e3:>7.0f}ms{q['selective']:>10.3f}{q['full']:>10.3f}"
            f"{s['selective']:>11.1%}{s['full']:>11.1%}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
