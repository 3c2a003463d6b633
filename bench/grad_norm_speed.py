"""‖ḡ‖² over a model's gradients: the per-tensor Python loop copus had vs one
`torch._foreach_norm` per group (`runtime/engine/grad_stats.weighted_sqnorm`), CPU, 1 thread.

291 tensors (32 blocks x 9 + 3, the `small` shape's widths), interleaved (ABAB...), median of
`--repeats` calls each. The machine is shared: load average beside the figures.

    python bench/grad_norm_speed.py [--repeats 30]

Writes bench/results/grad_norm_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from copus.runtime.engine.grad_stats import local_sqnorm, replication_weight, weighted_sqnorm

RESULTS = Path(__file__).resolve().parent / "results" / "grad_norm_speed.json"


def loop_sqnorm(tensors: list[torch.Tensor], tp: int) -> torch.Tensor:
    """The former `weighted_sqnorm`: one reduction and one add per tensor."""
    out = torch.zeros((), dtype=torch.float32)
    for t in tensors:
        out = out.to(t.device) + replication_weight(t, tp) * local_sqnorm(t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    d, f, kv = 384, 1024, 192
    shapes: list[tuple[int, ...]] = []
    for _ in range(32):
        shapes += [(d, d), (kv, d), (kv, d), (d, d), (f, d), (d, f), (f, d), (d,), (d,)]
    shapes += [(256, d), (d,), (256, d)]
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=gen) for s in shapes]
    times: dict[str, list[float]] = {"loop": [], "foreach": []}
    fns = (("loop", loop_sqnorm), ("foreach", weighted_sqnorm))
    for i in range(args.repeats):
        for name, fn in fns if i % 2 == 0 else fns[::-1]:
            t0 = time.perf_counter()
            fn(ts, 1)
            times[name].append(time.perf_counter() - t0)
    loop, fe = statistics.median(times["loop"]), statistics.median(times["foreach"])
    out = {
        "bench": "grad_norm_speed",
        "tensors": len(ts),
        "elements": sum(t.numel() for t in ts),
        "median_loop_s": loop,
        "median_foreach_s": fe,
        "ratio": loop / fe,
        "rel_diff": abs(float(loop_sqnorm(ts, 1)) / float(weighted_sqnorm(ts, 1)) - 1),
        "load_average_1min": os.getloadavg()[0],
        "repeats": args.repeats,
        "command": "python bench/grad_norm_speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"{len(ts)} tensors ({out['elements']:,} elements): loop {loop * 1e3:.2f} ms, "
        f"foreach {fe * 1e3:.2f} ms ({loop / fe:.1f}x), same value to {out['rel_diff']:.1e}; "
        f"load {out['load_average_1min']:.1f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
