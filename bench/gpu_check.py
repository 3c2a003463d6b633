"""The GPU check a GPU owner runs (through bench/gpu.sh): copus's own training loop on a ~1B Llama.

One launch (`copus.runtime.train.launch`, one rank per GPU, NCCL, bf16 (FSDP2 mixed precision)), the model from a
config.json (the TinyLlama-1.1B shape: 22 layers, dim 2048, 32 heads, 4 kv heads, ffn 5632,
vocab 32000, seq 2048), the `ramp` policy doubling the global batch half-way (a batch growth)
and, on >= 2 GPUs, a layout map that switches dpN -> dp(N/2).tp2 at the grown batch (a layout
switch in the running processes). Then, on the same engine, the gradient statistics' overhead:
steps with and without the `GradStats` hooks in ABBA order. Measured: step time, tokens/s, MFU
(`runtime/train/perf.py`), peak memory (CUDA max allocated) against the memory model's
prediction (`core/cost/memory.py`) for the same plan, GNS overhead, the switch's cost.

    python bench/gpu_check.py --out bench/results/gpu             # the real check (CUDA)
    python bench/gpu_check.py --dry-run --out /tmp/gpu_dry          # tiny, CPU, gloo, fp32

`--dry-run` runs the same code on 2 CPU ranks with a 2-layer model (CI: tests/bench). Writes
DIR/gpu_check.json and DIR/gpu_check.md; run folders under DIR/runs.

Time budget of the real check on one H100/H200 (reasoned, not measured): building the 1.1B
model ~20 s (every rank materialises the full model on the host), 24 steps at 8k-16k tokens
(1.1B: 7.7 GFLOP per token, ~0.2-0.5 s per step at 40 % MFU) ~15 s, the GNS leg 2x8 steps
~10 s, the final checkpoint (13 GB of weights and AdamW moments) 20-60 s: about 2 minutes,
well inside 8.
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

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"

TINYLLAMA = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "intermediate_size": 5632,
             "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "tie_word_embeddings": False}
DRY = {**TINYLLAMA, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 320,
       "max_position_embeddings": 64}


def settings(dry: bool, nproc: int) -> dict:
    """The run's knobs: the real check, or the dry run's tiny CPU version of the same."""
    if dry:
        return {"config": DRY, "seq_len": 64, "mbs": 2, "steps": 8, "gns_pairs": 1,
                "backend": "gloo", "dtype": "fp32", "nproc": nproc}
    return {"config": TINYLLAMA, "seq_len": 2048, "mbs": 2, "steps": 24, "gns_pairs": 4,
            "backend": "nccl", "dtype": "auto", "nproc": nproc}


def overrides(s: dict, config_path: Path) -> list[str]:
    """Config overrides: B0 = 2 micro-batches per rank, ramp to 2·B0 half-way, fixed layout
    (a layout map dpN@B0, dp(N/2).tp2@2·B0 on an even N >= 2)."""
    n, mbs = s["nproc"], s["mbs"]
    b0 = 2 * n * mbs
    out = [f"model.name={str(config_path)!r}", f"model.seq_len={s['seq_len']}",
           "data.tokenizer='byte'", f"parallel.nproc={n}", f"parallel.backend={s['backend']!r}",
           f"parallel.micro_batch_size={mbs}", f"train.dtype={s['dtype']!r}",
           f"train.max_steps={s['steps']}", "train.lr=1e-4", "train.lr_schedule='constant'",
           "batch.policy='ramp'", "batch.ramp_kind='stepwise'", "batch.ramp_steps=1",
           f"batch.initial={b0}", f"batch.min={b0}", f"batch.max={2 * b0}",
           f"batch.ramp_to={2 * b0}", f"batch.ramp_samples={b0 * s['steps'] // 2}",
           "batch.interval_steps=1", "batch.warmup_steps=0",
           "eval.interval_steps=0", "checkpoint.interval_steps=0", "checkpoint.keep=1",
           "log.tensorboard=false", "log.progress=false", "gns.calibration=1.0"]
    if n >= 2 and n % 2 == 0:
        out.append(f"parallel.layouts='dp{n}@{b0},dp{n // 2}.tp2@{2 * b0}'")
    else:
        out.append(f"parallel.dp={n}")
    return out


# --------------------------------------------------------------------------- worker (every rank)
class _NoStats:
    """GradStats without hooks: the engine then collects no per-micro-batch norm."""

    def __init__(self, device) -> None:
        self.kept: dict = {}
        self.device = device

    def begin(self, num_microbatches: int, grad_scale: float) -> None:
        return None

    def small_sqnorm_sum(self):
        import torch

        return torch.zeros((), device=self.device)

    def close(self) -> None:
        return None


def _timed_steps(trainer, pairs: int) -> dict:
    """ABBA steps with and without the statistics hooks on the run's final engine, same batch;
    CUDA's peak memory reset first, so the peak is this plan's."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from copus.runtime.engine.grad_stats import GradStats
    from copus.runtime.train import perf

    engine, device = trainer.engine, trainer.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with_stats = engine.stats
    without = _NoStats(device)
    ids = trainer.sampler.ids(trainer.progress.samples, trainer.plan.global_batch_size)
    tokens = trainer.batch_to_device(trainer.train_set.batch(trainer.local_ids(ids)))
    times: dict[str, list[float]] = {"with": [], "without": []}
    for i in range(pairs + 1):                       # the first pair is a warm-up
        for name in (("with", "without") if i % 2 == 0 else ("without", "with")):
            if name == "with" and engine.stats is not with_stats:
                engine.stats = with_stats = GradStats(engine.model, engine.plan.tp,
                                                      engine.gns_small)
            elif name == "without":
                engine.stats.close()
                engine.stats = without
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_step(tokens, 1e-5)
            perf.wait_for_device(device)
            t = trainer.step_end(time.perf_counter() - t0).step_s
            if i > 0:
                times[name].append(t)
    if engine.stats is without:
        engine.stats = GradStats(engine.model, engine.plan.tp, engine.gns_small)
    peak = trainer.step_end(0.0).peak_memory_bytes
    w, wo = times["with"], times["without"]
    return {"plan": trainer.plan.describe(), "pairs": pairs,
            "median_step_s_with_stats": statistics.median(w),
            "median_step_s_without_stats": statistics.median(wo),
            "overhead": statistics.median(w) / statistics.median(wo) - 1.0,
            "pair_ratios": [a / b for a, b in zip(w, wo)],
            "peak_memory_bytes": peak,
            "predicted_memory_bytes": perf.predicted_memory_bytes(trainer.memory.model,
                                                                  trainer.plan),
            "tokens": int(np.asarray(tokens.shape).prod())}


def worker(cfg, run_dir: str, resume: bool = False) -> dict:
    """Every rank: the training run (the trainer's own loop), then the GNS overhead leg."""
    import torch

    from copus.runtime.engine.dist import init_distributed, shutdown
    from copus.runtime.train import perf
    from copus.runtime.train.trainer import Trainer

    opts = json.loads(Path(run_dir, "gpu_check_opts.json").read_text())
    device = init_distributed(backend=cfg.parallel.backend, timeout_s=cfg.train.nccl_timeout_s)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, run_dir, device)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    summary = trainer.run()
    run_s = time.perf_counter() - t0
    gns = _timed_steps(trainer, opts["gns_pairs"])
    result = {"build_s": build_s, "run_s": run_s, "summary": summary, "gns": gns,
              "memory_capacity_bytes": trainer.memory.capacity,
              "device_memory_bytes": perf.device_memory_bytes(device, trainer.hardware),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "hardware": trainer.hardware.name if trainer.hardware is not None else "cpu",
              "peak_flops": trainer.peak_flops,
              "flops_per_token": trainer.shape.model_flops_per_token(),
              "num_params": trainer.shape.num_params()}
    trainer.close()
    shutdown()
    return result


# --------------------------------------------------------------------------- analysis
def read_rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not row.get("superseded"):
            rows.append(row)
    return rows


def segments(rows: list[dict], memory_model) -> list[dict]:
    """Per plan of the run: steps, median step time, tokens/s and MFU (the first step of each
    plan left out: warm-up, allocator growth), the peak so far and the model's prediction."""
    from copus.core.plan.plan import ParallelPlan
    from copus.runtime.train.perf import predicted_memory_bytes

    out: list[dict] = []
    key = None
    for row in rows:
        k = (row["dp"], row["tp"], row["pp"], row["micro_batch_size"], row["num_microbatches"])
        if k != key:
            key = k
            out.append({"plan": dict(zip(("dp", "tp", "pp", "micro_batch_size",
                                          "num_microbatches"), k)),
                        "global_batch_size": row["global_batch_size"], "first_step": row["step"],
                        "rows": []})
        out[-1]["rows"].append(row)
    for seg in out:
        rows_, steady = seg.pop("rows"), None
        steady = rows_[1:] or rows_
        seg["steps"] = len(rows_)
        seg["median_step_s"] = statistics.median(r["step_s"] for r in steady)
        seg["median_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steady)
        mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
        seg["median_mfu"] = statistics.median(mfus) if mfus else None
        seg["peak_memory_bytes"] = max(r.get("peak_memory_bytes") or 0 for r in rows_)
        seg["predicted_memory_bytes"] = predicted_memory_bytes(memory_model,
                                                               ParallelPlan(**seg["plan"]))
    return out


def switches(run_dir: Path) -> list[dict]:
    rows = []
    for d in read_rows(run_dir / "decisions.jsonl"):
        if d.get("applied") and "event" not in d:
            sw = d.get("switch") or {}
            rows.append({"step": d.get("step"), "kind": d.get("kind"),
                         "global_batch_size": d.get("global_batch_size"),
                         "to": f"dp{d.get('dp')}.tp{d.get('tp')}.pp{d.get('pp')}",
                         "switch_s": d.get("switch_s"), "method": sw.get("method"),
                         "groups_released": sw.get("groups_released")})
    return rows


def markdown(res: dict) -> str:
    gib = 2**30
    lines = [f"# gpu_check ({'dry run, CPU' if res['dry_run'] else res['device']}, "
             f"{res['nproc']} rank(s))", "",
             f"model {res['model']['hidden_size']}d x {res['model']['num_hidden_layers']} layers, "
             f"{res['num_params'] / 1e6:,.1f} M parameters, seq {res['seq_len']}, "
             f"{res['flops_per_token'] / 1e9:.3g} GFLOP/token, peak "
             f"{res['peak_flops'] / 1e12:.3g} TFLOP/s per device ({res['hardware']}); "
             f"wall {res['wall_s']:.0f} s (build {res['build_s']:.0f} s, run "
             f"{res['run_s']:.0f} s)", "",
             "| plan | B | steps | median step s | tokens/s | MFU | peak GiB | predicted GiB | "
             "peak/predicted |", "|---|---|---|---|---|---|---|---|---|"]
    for s in res["segments"]:
        p = s["plan"]
        name = f"dp{p['dp']}.tp{p['tp']}.pp{p['pp']} mb{p['micro_batch_size']}x{p['num_microbatches']}"
        mfu = "–" if s["median_mfu"] is None else f"{s['median_mfu']:.1%}"
        lines.append(f"| {name} | {s['global_batch_size']} | {s['steps']} | "
                     f"{s['median_step_s']:.3f} | {s['median_tokens_per_s']:,.0f} | {mfu} | "
                     f"{s['peak_memory_bytes'] / gib:.2f} | {s['predicted_memory_bytes'] / gib:.2f}"
                     f" | {s['peak_memory_bytes'] / s['predicted_memory_bytes']:.2f} |")
    g = res["gns"]
    lines += ["", f"GNS statistics overhead on {g['plan']}: {g['overhead']:+.1%} "
              f"(median {g['median_step_s_with_stats']:.3f} s with vs "
              f"{g['median_step_s_without_stats']:.3f} s without, {g['pairs']} ABBA pairs); "
              f"this plan's peak {g['peak_memory_bytes'] / gib:.2f} GiB vs predicted "
              f"{g['predicted_memory_bytes'] / gib:.2f} GiB "
              f"(ratio {g['peak_memory_bytes'] / g['predicted_memory_bytes']:.2f}; "
              f"{'RSS high-water mark of the process: not comparable' if res['dry_run'] else 'CUDA max allocated'})"]
    for sw in res["switches"]:
        lines.append(f"- step {sw['step']}: {sw['kind']} -> {sw['to']} B={sw['global_batch_size']}"
                     f", {sw['switch_s']:.2f} s" + (f" ({sw['method']}, {sw['groups_released']} "
                                                    "process groups released)" if sw['method'] else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model, 2 CPU ranks, gloo, fp32")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: GPUs, 2 for --dry-run)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for gpu_check.json/.md")
    args = ap.parse_args(argv)
    nproc = args.nproc or (2 if args.dry_run else _gpu_count())
    if nproc < 1:
        print("gpu_check: no GPU found (torch.cuda.device_count() == 0); allowed: a CUDA host, "
              "or --dry-run", file=sys.stderr)
        return 2
    s = settings(args.dry_run, nproc)
    import shutil

    from copus.config import load_config
    from copus.runtime.train.launch import launch

    out = args.out
    run_dir = out / "runs" / "train"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    config_path = out / "runs" / "config.json"
    config_path.write_text(json.dumps(s["config"], indent=1))
    cfg = load_config(None, overrides(s, config_path))
    (run_dir / "gpu_check_opts.json").write_text(json.dumps({"gns_pairs": s["gns_pairs"]}))
    t0 = time.perf_counter()
    res = launch(cfg, str(run_dir), max_restarts=0, entry=worker)
    wall = time.perf_counter() - t0
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)   # 13 GB for the 1.1B model
    if "error" in res:
        print(f"gpu_check: the run failed: {res['error']}", file=sys.stderr)
        return 1
    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.train.perf import runtime_memory_model

    shape = get_model_shape(str(config_path), s["seq_len"])
    memory_model = runtime_memory_model(cfg, shape, "cpu" if args.dry_run else "cuda")
    rows = read_rows(run_dir / "metrics.jsonl")
    result = {"bench": "gpu_check", "dry_run": args.dry_run, "nproc": nproc,
              "model": s["config"], "seq_len": s["seq_len"], "wall_s": wall,
              **{k: res[k] for k in ("build_s", "run_s", "device", "hardware", "peak_flops",
                                     "flops_per_token", "num_params", "memory_capacity_bytes",
                                     "device_memory_bytes", "gns", "summary")},
              "segments": segments(rows, memory_model), "switches": switches(run_dir),
              "batch_grew": len({r["global_batch_size"] for r in rows}) > 1,
              "command": "python bench/gpu_check.py " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv),
              "host": platform.node(), "load_average_1min": os.getloadavg()[0]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (out / "gpu_check.md").write_text(table)
    print(table)
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


if __name__ == "__main__":
    raise SystemExit(main())
