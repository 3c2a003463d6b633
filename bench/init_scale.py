"""Per-rank cost of initialising the model at world 1, 2 and 4 (gloo ranks on this CPU).

For each world W (layout dp = W, FSDP2 over all ranks) every rank builds the engine on the meta
device, then times three ways to fill its parameters, in interleaved order:

- "tiles" (the runtime's `init_weights`): this rank's shard only, tile by tile;
- "full" (the former runtime): every parameter's full tensor drawn from one per-name generator,
  then this rank's shard copied out (`distribute_tensor(..., src_data_rank=None)`);
- "none" (`init=False`, resume / --init-from / checkpoint-path switch): nothing drawn.

Per rank: values drawn, CPU seconds (process time: the 2 shared cores make wall time at W = 4
a measure of contention, not of per-rank work), wall seconds, and the resident-memory peak
(VmHWM after resetting it) above the resident memory before the fill, against the shard's bytes.
Output: bench/results/init_scale.json and init_scale.md.

    python bench/init_scale.py [--model tinyllama-1.1b] [--layers 8] [--worlds 1,2,4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.runtime._workers import run_ranks  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return float(line.split()[1]) * 1024.0
    return float("nan")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _full_init(model, seed: int) -> int:
    """The former initialisation: a full tensor per parameter, this rank's shard copied out."""
    import math

    import torch
    from torch.distributed.tensor import distribute_tensor

    from copus.runtime.engine.model import init_std, param_seed

    drawn = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = init_std(name, model.shape)
            if std is None:
                full = torch.ones(p.shape) if name.endswith("norm.weight") else torch.zeros(p.shape)
            else:
                gen = torch.Generator().manual_seed(param_seed(seed, name))
                full = torch.randn(p.shape, generator=gen) * std
                drawn += math.prod(p.shape)
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(local.to_local())
            del full, local
    return drawn


def _work(model_name: str, repeats: int, layers: int):
    import time

    import torch.distributed as dist

    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.model import DrawCounter, build_model, init_weights, reset_rope
    from copus.runtime.engine.parallelize import parallelize
    from copus.runtime.engine.release import drop_tensors

    world = dist.get_world_size()
    shape = get_model_shape(model_name)
    if layers:
        shape = replace(shape, n_layers=layers)
    mesh = MeshCache("cpu").get(dp=world, tp=1, pp=1)
    rows, shard, sums = [], 0, {}
    for rep in range(repeats):
        order = ["tiles", "full", "none"] if rep % 2 == 0 else ["full", "tiles", "none"]
        for how in order:
            model = parallelize(build_model(shape, "meta"), mesh)
            dist.barrier()
            before = _status("VmRSS:")
            _reset_peak()
            c0, w0, d0 = time.process_time(), time.perf_counter(), DrawCounter.values
            model.to_empty(device="cpu")  # the build: memory, then values
            reset_rope(model)
            if how == "tiles":
                init_weights(model, 0)
                drawn = DrawCounter.values - d0
            elif how == "full":
                drawn = _full_init(model, 0)
            else:
                drawn = 0  # init=False: materialize skips init_weights
            rows.append(
                {
                    "how": how,
                    "repeat": rep,
                    "drawn": drawn,
                    "cpu_s": time.process_time() - c0,
                    "wall_s": time.perf_counter() - w0,
                    "peak_above_fill_start": _status("VmHWM:") - before,
                }
            )
            shard = sum(p.to_local().numel() * 4 for p in model.parameters())
            if how != "none":
                sums[how] = float(sum(p.to_local().double().sum() for p in model.parameters()))
            drop_tensors(model, None)  # FSDP2's cycles would keep it until a gc
            del model
            dist.barrier()
    return {"world": world, "shard_bytes": shard, "local_values": shard // 4, "rows": rows, "checksums": sums}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tinyllama-1.1b")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layers", type=int, default=0, help="override the shape's depth (0: its own)")
    args = ap.parse_args()
    # large blocks straight from mmap, returned on free: resident memory follows live tensors
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    out = {
        "command": "python bench/init_scale.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "layers": args.layers or "the shape's own",
        "machine": "2 shared CPU cores (other jobs running), gloo",
        "worlds": {},
    }
    for w in [int(x) for x in args.worlds.split(",")]:
        ranks = run_ranks(_work, w, args.model, args.repeats, args.layers, timeout=1800)
        summary = {}
        for how in ("tiles", "full", "none"):
            per_rank = [[r for r in rk["rows"] if r["how"] == how] for rk in ranks]
            summary[how] = {
                "drawn_per_rank": max(rows[0]["drawn"] for rows in per_rank),
                "cpu_s_median_max_rank": max(statistics.median(r["cpu_s"] for r in rows) for rows in per_rank),
                "wall_s_median_max_rank": max(statistics.median(r["wall_s"] for r in rows) for rows in per_rank),
                "peak_above_start_bytes": max(max(r["peak_above_fill_start"] for r in rows) for rows in per_rank),
            }
        out["worlds"][w] = {
            "shard_bytes": ranks[0]["shard_bytes"],
            "local_values": ranks[0]["local_values"],
            "summary": summary,
            "ranks": ranks,
        }
        print(w, json.dumps(summary), flush=True)
    w1 = out["worlds"][min(out["worlds"])]["summary"]
    depth = f", {args.layers} layers" if args.layers else ""
    lines = [
        f"# Initialisation per rank, {args.model}{depth} (dp = world, gloo, 2 shared CPU cores)",
        "",
        "| world | method | values drawn / rank | / local shard | CPU s / rank | vs world 1 "
        "| wall s | build peak RSS above start (MB) | shard (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w, d in out["worlds"].items():
        for how in ("tiles", "full", "none"):
            s = d["summary"][how]
            ratio = s["cpu_s_median_max_rank"] / max(w1[how]["cpu_s_median_max_rank"], 1e-9)
            lines.append(
                f"| {w} | {how} | {s['drawn_per_rank']:,} | "
                f"{s['drawn_per_rank'] / d['local_values']:.3f} | "
                f"{s['cpu_s_median_max_rank']:.2f} | {ratio:.2f} | "
                f"{s['wall_s_median_max_rank']:.2f} | {s['peak_above_start_bytes'] / 2**20:.0f} | "
                f"{d['shard_bytes'] / 2**20:.0f} |"
            )
    lines += [
        "",
        f"command: `{out['command']}`; medians over {args.repeats} interleaved repeats, "
        "the slowest rank's; 'tiles' = the runtime's shard-local init, 'full' = the former "
        "full-tensor init, 'none' = init=False (a load follows).",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "init_scale.json").write_text(json.dumps(out, indent=1))
    (RESULTS / "init_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
