"""The framework's tax: a plain FSDP2 training loop vs copus's engine, same model, same plan.

Variants, each a separate model + optimizer living side by side on every rank, stepping in
rotating order (step i runs the variants rotated by i, so drift and warm-up hit all equally) on
the same batch:
- "plain": the loop a user writes with FSDP2 alone (no copus): `fully_shard` per block + root,
  torch AdamW, gradient accumulation with `set_requires_gradient_sync`, `clip_grad_norm_`, one
  loss all-reduce per step for logging. Same `Transformer` and per-name initialisation.
- "copus": `Engine.train_step` (noise-scale hooks, one statistics all-reduce, clipping by the
  global norm, AdamW), activation checkpointing "none".
- "copus-selective", "copus-full": the same with selective / full activation checkpointing.

Step time = max over ranks of one step's wall time; reported: medians, ratios to "plain" and
to "copus" (AC cost), with the interquartile range of the per-step ratios. Also, single process
after the run: the exact activation bytes each AC mode keeps for backward on one micro-batch
(`runtime/engine/activation_memory.py`). Goals (issue 24): copus / plain ≤ 1.03; selective /
none ≤ 1.15 with ≥ 40 % of activation bytes saved.

    python bench/framework_tax.py [--nproc 4] [--model small] [--batch 8] [--mbs 1] [--steps 8]

Writes bench/results/framework_tax.json. dp-only plans (the plain loop has no TP / PP). On a
shared, oversubscribed CPU the timings are noisy: the load average is recorded.
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

RESULTS = Path(__file__).resolve().parent / "results" / "framework_tax.json"
VARIANTS = ("plain", "copus", "copus-selective", "copus-full")
AC = {"copus": "none", "copus-selective": "selective", "copus-full": "full"}
LR, CLIP = 1e-3, 1.0


class PlainFSDP2:
    """The plain loop (module docstring), on the dp mesh copus would use."""

    def __init__(self, shape, dp_mesh, device, seed: int = 0) -> None:
        import torch
        from torch.distributed.fsdp import fully_shard

        from copus.runtime.engine.model import build_model, materialize

        model = build_model(shape, "meta")
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        self.model = materialize(model, device, seed)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        rest = [p for p in self.model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            lr=LR,
            betas=(0.9, 0.95),
            eps=1e-8,
        )

    def train_step(self, tokens, num_microbatches: int) -> float:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        k = num_microbatches
        total = torch.zeros((), device=tokens.device)
        for i, (x, y) in enumerate(zip(tokens[:, :-1].chunk(k), tokens[:, 1:].chunk(k))):
            self.model.set_requires_gradient_sync(i == k - 1)
            loss = F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())
            (loss / k).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        return float(total) / (k * dist.get_world_size())


def bench_worker(cfg, run_dir: str, resume: bool) -> dict:
    """Entry on every rank (spawned by copus.runtime.train.launch)."""
    import torch
    import torch.distributed as dist

    from copus.core.plan.plan import ParallelPlan
    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.engine.dist import MeshCache, init_distributed, shutdown
    from copus.runtime.engine.engine import Engine, EngineSettings

    opts = json.loads(Path(run_dir, "bench_opts.json").read_text())
    device = init_distributed(backend=cfg.parallel.backend)
    shape = get_model_shape(cfg.model.name)
    world = dist.get_world_size()
    mbs = opts["mbs"]
    plan = ParallelPlan(dp=world, tp=1, pp=1, micro_batch_size=mbs, num_microbatches=opts["batch"] // (world * mbs))
    cache = MeshCache(device.type)
    variants: dict[str, object] = {"plain": PlainFSDP2(shape, cache.get(dp=world, tp=1, pp=1)["dp"], device)}
    for name in opts["variants"]:
        if name in AC:
            variants[name] = Engine(
                shape, plan, EngineSettings(activation_checkpointing=AC[name], grad_clip=CLIP), device, cache, seed=0
            )
    names = [n for n in VARIANTS if n in variants]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (opts["batch"], shape.seq_len + 1), generator=g)
    rank = dist.get_rank()
    n = opts["batch"] // world
    local = tokens[rank * n : (rank + 1) * n].to(device)
    times: dict[str, list[float]] = {v: [] for v in names}
    for i in range(opts["warmup"] + opts["steps"]):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            if name == "plain":
                variants[name].train_step(local, plan.num_microbatches)
            else:
                variants[name].train_step(local, LR)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= opts["warmup"]:
                times[name].append(float(t))
    for name, v in variants.items():
        if name != "plain":
            v.close()
    shutdown()
    return {"times": times, "plan": plan.describe(), "world_size": world}


def activation_bytes(model_name: str, mbs: int) -> dict[str, int]:
    """Bytes kept for backward per AC mode on one micro-batch (single process, plain model)."""
    import torch

    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.engine.activation_memory import measure_activation_bytes
    from copus.runtime.engine.model import build_model, materialize
    from copus.runtime.engine.parallelize import AC_MODES, apply_ac

    shape = get_model_shape(model_name)
    tokens = torch.randint(0, shape.vocab_size, (mbs, shape.seq_len), generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in AC_MODES:
        model = materialize(build_model(shape, "cpu"), "cpu", 0)
        apply_ac(model, mode)
        logits, nbytes = measure_activation_bytes(model, lambda m=model: m(tokens), (tokens,))
        out[mode] = nbytes.live_bytes
        del logits
    return out


def _ratios(a: list[float], b: list[float]) -> dict:
    pairs = sorted(x / y for x, y in zip(a, b, strict=True))
    return {
        "ratio_of_medians": statistics.median(a) / statistics.median(b),
        "pair_ratio_median": statistics.median(pairs),
        "pair_ratio_iqr": [pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]],
        "ratio_of_minima": min(a) / min(b),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    wanted = args.variants.split(",")
    bad = [v for v in wanted if v not in VARIANTS]
    if bad or "plain" not in wanted or "copus" not in wanted:
        print(
            f"--variants={args.variants!r}: allowed: plain,copus plus any of {', '.join(VARIANTS[2:])}", file=sys.stderr
        )
        return 2
    if args.batch % (args.nproc * args.mbs):
        print(f"--batch={args.batch}: allowed: a multiple of nproc*mbs={args.nproc * args.mbs}", file=sys.stderr)
        return 2

    import tempfile

    from copus.config import load_config
    from copus.runtime.train.launch import launch

    cfg = load_config(None, [f"parallel.nproc={args.nproc}", f"model.name='{args.model}'"])
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "bench_opts.json").write_text(
            json.dumps(
                {"steps": args.steps, "warmup": args.warmup, "batch": args.batch, "mbs": args.mbs, "variants": wanted}
            )
        )
        res = launch(cfg, tmp, max_restarts=0, entry=bench_worker)
    times = res["times"]
    nbytes = activation_bytes(args.model, args.mbs)
    out = {
        "bench": "framework_tax",
        "model": args.model,
        "plan": res["plan"],
        "world_size": res["world_size"],
        "steps": args.steps,
        "warmup": args.warmup,
        "order": "rotating (step i starts at variant i mod n)",
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "min_step_s": {k: min(v) for k, v in times.items()},
        "vs_plain": {k: _ratios(v, times["plain"]) for k, v in times.items() if k != "plain"},
        "vs_copus_none": {k: _ratios(v, times["copus"]) for k, v in times.items() if k.startswith("copus-")},
        "activation_bytes_per_microbatch": nbytes,
        "activation_bytes_saved_vs_none": {k: 1 - v / nbytes["none"] for k, v in nbytes.items()},
        "goals": {"copus_over_plain_max": 1.03, "selective_over_none_max": 1.15, "selective_bytes_saved_min": 0.40},
        "times": times,
        "host": platform.node(),
        "python": sys.version.split()[0],
        "load_average_1min_after": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"{res['plan']}, {res['world_size']} ranks, model {args.model}, {args.steps} steps "
        f"(+{args.warmup} warm-up), load average {out['load_average_1min_after']:.1f}"
    )
    print(f"{'variant':<18}{'median':>10}{'/plain':>9}{'/copus':>9}{'pair IQR vs plain':>22}")
    for k in times:
        med = out["median_step_s"][k]
        vp = out["vs_plain"].get(k, {"ratio_of_medians": 1.0, "pair_ratio_iqr": [1.0, 1.0]})
        vc = out["vs_copus_none"].get(k, {}).get("ratio_of_medians", float("nan"))
        print(
            f"{k:<18}{med * 1e3:>8.0f}ms{vp['ratio_of_medians']:>9.3f}{vc:>9.3f}"
            f"{'[%.3f, %.3f]' % tuple(vp['pair_ratio_iqr']):>22}"
        )
    print(
        "activation bytes per micro-batch: "
        + ", ".join(
            f"{k} {v / 2**20:.1f} MiB ({out['activation_bytes_saved_vs_none'][k]:.0%} saved)" for k, v in nbytes.items()
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
