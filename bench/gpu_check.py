"""The GPU check a GPU owner runs (through bench/gpu.sh): copus's training loop on a ~1B Llama,
one leg per process, each leg a row of one JSON and one table.

Model: a config.json of the TinyLlama-1.1B shape (22 layers, dim 2048, 32 heads, 4 kv heads,
ffn 5632, vocab 32000), seq 2048, one rank per GPU, NCCL, bf16 (FSDP2 mixed precision).
Legs (`LEGS`, in this order):

    eager        micro-batch 2, two micro-batches per rank, eager, no AC; + the gradient
                 statistics' overhead (steps with / without the GradStats hooks, ABBA)
    growth       the `ramp` policy doubling the global batch half-way (a batch growth)
    switch       >= 2 GPUs: a layout map dpN@B0 -> dp(N/2).tp2@2B0 (a layout switch in the
                 running processes); 1 GPU: skipped with that reason
    throughput   the micro-batch the memory model picks (largest power of two <= 16 that fits
                 the device with selective AC), one micro-batch per rank, `train.compile = true`,
                 selective AC; + the statistics' overhead
    torchtitan   the peer: torchtitan's Llama on the throughput leg's shape, sequence, batch,
                 dtype, layout, compile and AC for the same steps (bench/gpu_check_titan.py);
                 skipped with the reason when torchtitan is not importable or there is no CUDA

Per leg and plan (segment): median step time (first step of a plan left out), tokens/s, MFU
(against the device's datasheet peak, `core/specs/gpu_peaks.py`; null with "peak unknown"
otherwise), peak allocated / reserved / device-used bytes (`mem_get_info`) against the memory
model's prediction (peaks reset at every plan change), compile time (first step − median),
GNS overhead where measured. A leg that fails writes its error; the next leg still runs.

    python bench/gpu_check.py --devices --nproc N --out DIR   # validate N, write DIR/devices.json
    python bench/gpu_check.py --leg eager --out DIR            # one leg -> DIR/legs/eager.json
    python bench/gpu_check.py --collect --out DIR              # DIR/gpu_check.json + .md

bench/gpu.sh runs these in order, each leg under `timeout`; bench/gpu_check_report.py reads
them. `--dry-run`: the same code on 2 CPU ranks (gloo, fp32, a 2-layer model, 8 steps;
tests/bench). Budget: docs/gpu-check.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_report import (  # noqa: E402 (bench/ on the path first)
    LEGS,
    NCCL_TIMEOUT_S,
    collect,
    markdown,
    read_rows,
    segments,
    switches,
)

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"
FAIL_ENV = "GPU_CHECK_FAIL_LEG"  # comma-separated legs whose ranks raise (tests)
HANG_ENV = "GPU_CHECK_HANG_LEG"  # comma-separated legs whose ranks sleep (timeout tests)
MAX_MICRO_BATCH = 16

TINYLLAMA = {
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "intermediate_size": 5632,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
DRY = {
    **TINYLLAMA,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 320,
    "max_position_embeddings": 64,
}


def settings(dry: bool, nproc: int) -> dict:
    """The run's knobs: the real check, or the dry run's tiny CPU version of the same."""
    if dry:
        return {
            "config": DRY,
            "seq_len": 64,
            "mbs": 2,
            "steps": 8,
            "gns_pairs": 1,
            "backend": "gloo",
            "dtype": "fp32",
            "nproc": nproc,
            "dry_run": True,
            "compile": os.environ.get("GPU_CHECK_DRY_COMPILE", "0") == "1",
        }
    return {
        "config": TINYLLAMA,
        "seq_len": 2048,
        "mbs": 2,
        "steps": 12,
        "gns_pairs": 3,
        "backend": "nccl",
        "dtype": "auto",
        "nproc": nproc,
        "dry_run": False,
        "compile": True,
    }


def check_nproc(nproc: int, count: int) -> str | None:
    """One line when `nproc` ranks cannot each get a device of the `count` torch sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f"torch.cuda.device_count() = {count}" + (
        f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    )
    if count < 1:
        return f"gpu_check: no CUDA device ({where}); allowed: a CUDA host, or --dry-run"
    if not 1 <= nproc <= count:
        return f"gpu_check: --nproc {nproc} is invalid ({where}); allowed: 1..{count}"
    return None


# --------------------------------------------------------------------------- leg settings
def common_overrides(s: dict, config_path: Path) -> list[str]:
    n = s["nproc"]
    return [
        f"model.name={str(config_path)!r}",
        f"model.seq_len={s['seq_len']}",
        "data.tokenizer='byte'",
        f"parallel.nproc={n}",
        f"parallel.backend={s['backend']!r}",
        f"train.dtype={s['dtype']!r}",
        f"train.max_steps={s['steps']}",
        f"train.nccl_timeout_s={NCCL_TIMEOUT_S}",
        "train.lr=1e-4",
        "train.lr_schedule='constant'",
        "batch.interval_steps=1",
        "batch.warmup_steps=0",
        "eval.interval_steps=0",
        "checkpoint.interval_steps=0",
        "checkpoint.keep=1",
        "log.tensorboard=false",
        "log.progress=false",
        "gns.calibration=1.0",
    ]


def leg_overrides(leg: str, s: dict, mbs: int) -> list[str]:
    """Each copus leg's own keys on top of `common_overrides`."""
    n = s["nproc"]
    b0 = 2 * n * s["mbs"]
    ramp = [
        "batch.policy='ramp'",
        "batch.ramp_kind='stepwise'",
        "batch.ramp_steps=1",
        f"batch.initial={b0}",
        f"batch.min={b0}",
        f"batch.max={2 * b0}",
        f"batch.ramp_to={2 * b0}",
        f"batch.ramp_samples={b0 * s['steps'] // 2}",
        f"parallel.micro_batch_size={s['mbs']}",
    ]
    if leg == "eager":
        return [
            "batch.policy='constant'",
            f"batch.initial={b0}",
            f"batch.min={b0}",
            f"batch.max={b0}",
            f"batch.ramp_to={b0}",
            f"parallel.micro_batch_size={s['mbs']}",
            f"parallel.dp={n}",
        ]
    if leg == "growth":
        return ramp + [f"parallel.dp={n}"]
    if leg == "switch":
        return ramp + [f"parallel.layouts='dp{n}@{b0},dp{n // 2}.tp2@{2 * b0}'"]
    if leg == "throughput":
        b = n * mbs
        return [
            "batch.policy='constant'",
            f"batch.initial={b}",
            f"batch.min={b}",
            f"batch.max={b}",
            f"batch.ramp_to={b}",
            f"parallel.micro_batch_size={mbs}",
            f"parallel.dp={n}",
            f"train.compile={'true' if s['compile'] else 'false'}",
            "parallel.activation_checkpointing='selective'",
        ]
    raise ValueError(f"leg={leg!r} has no copus overrides; allowed: eager, growth, switch, throughput")


def skip_reason(leg: str, s: dict) -> str | None:
    if leg == "switch" and (s["nproc"] < 2 or s["nproc"] % 2):
        return f"a layout switch needs an even number >= 2 of GPUs (here {s['nproc']})"
    if leg == "torchtitan":
        import gpu_check_titan

        return gpu_check_titan.unavailable(s["dry_run"])
    return None


def pick_micro_batch(cfg_overrides: list[str], s: dict, capacity_bytes: float) -> dict:
    """The throughput leg's micro-batch: the largest power of two <= MAX_MICRO_BATCH whose
    predicted peak (memory model, selective AC, dp = N, one micro-batch) fits `capacity_bytes`
    less parallel.memory_margin; 1 when none does."""
    from copus.config import load_config
    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.train.perf import runtime_memory_model

    cfg = load_config(None, cfg_overrides + ["parallel.activation_checkpointing='selective'"])
    shape = get_model_shape(cfg.model.name, s["seq_len"])
    mm = runtime_memory_model(cfg, shape, "cpu" if s["dry_run"] else "cuda")
    limit = capacity_bytes * (1.0 - cfg.parallel.memory_margin)
    best, table = 1, {}
    b = 1
    while b <= MAX_MICRO_BATCH:
        table[b] = float(mm.bytes_per_rank(s["nproc"], 1, 1, b, 1))
        if table[b] <= limit:
            best = b
        b *= 2
    return {
        "micro_batch_size": best,
        "capacity_bytes": capacity_bytes,
        "limit_bytes": limit,
        "predicted_bytes_by_micro_batch": table,
    }


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
    """ABBA steps with and without the statistics hooks on the leg's final engine, same batch,
    the peak-memory window reset first (this plan's peak only)."""
    import torch.distributed as dist

    from copus.runtime.engine.grad_stats import GradStats
    from copus.runtime.train import perf

    engine, device = trainer.engine, trainer.device
    perf.reset_peak_memory(device)
    with_stats = engine.stats
    without = _NoStats(device)
    ids = trainer.sampler.ids(trainer.progress.samples, trainer.plan.global_batch_size)
    tokens = trainer.batch_to_device(trainer.train_set.batch(trainer.local_ids(ids)))
    times: dict[str, list[float]] = {"with": [], "without": []}
    for i in range(pairs + 1):  # the first pair is a warm-up
        for name in ("with", "without") if i % 2 == 0 else ("without", "with"):
            if name == "with" and engine.stats is not with_stats:
                engine.stats = with_stats = GradStats(engine.model, engine.plan.tp, engine.gns_small)
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
    end = trainer.step_end(0.0)
    w, wo = times["with"], times["without"]
    return {
        "plan": trainer.plan.describe(),
        "pairs": pairs,
        "median_step_s_with_stats": statistics.median(w),
        "median_step_s_without_stats": statistics.median(wo),
        "overhead": statistics.median(w) / statistics.median(wo) - 1.0,
        "pair_ratios": [a / b for a, b in zip(w, wo)],
        "peak_allocated_bytes": end.peak_memory_bytes,
        "peak_reserved_bytes": _na(end.peak_reserved_bytes),
        "device_used_bytes": _na(end.device_used_bytes),
        "predicted_memory_bytes": perf.predicted_memory_bytes(trainer.memory.model, trainer.plan),
    }


def _na(x: float) -> float | None:
    return None if x is None or x < 0 else x


def _injected(leg: str, run_dir: str) -> None:
    """The failure / hang a test asks for through FAIL_ENV / HANG_ENV (every rank). A hanging
    rank first writes RUN_DIR/hanging-rank<RANK>: the test's proof that the ranks were up (and
    so were killed by the leg's timeout, not never started)."""
    if leg in os.environ.get(FAIL_ENV, "").split(","):
        raise RuntimeError(f"injected failure ({FAIL_ENV}={leg})")
    if leg in os.environ.get(HANG_ENV, "").split(","):
        Path(run_dir, f"hanging-rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
        time.sleep(3600)


def worker(cfg, run_dir: str, resume: bool = False) -> dict:
    """Every rank: the leg's steps through the trainer's own step, decision and switch
    (`Trainer.train_step`, `decide`, `apply_decision`) without its end-of-run checkpoint
    (13 GB of weights and AdamW moments at 1.1B: 20-60 s the check does not need), then the
    GNS overhead steps when asked."""
    import torch

    from copus.runtime.engine.dist import init_distributed, shutdown
    from copus.runtime.train import perf
    from copus.runtime.train.trainer import Trainer

    opts = json.loads(Path(run_dir, "leg.json").read_text())
    _injected(opts["leg"], run_dir)
    device = init_distributed(backend=cfg.parallel.backend, timeout_s=cfg.train.nccl_timeout_s)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, run_dir, device)
    build_s = time.perf_counter() - t0
    perf.reset_peak_memory(device)  # the first plan's peak without the build's transients
    t0 = time.perf_counter()
    while not trainer.done():
        record = trainer.memory.guarded(trainer.train_step, trainer._where)
        decision = trainer.decide(record)
        if decision is not None:
            trainer.apply_decision(decision)
    run_s = time.perf_counter() - t0
    gns = _timed_steps(trainer, opts["gns_pairs"]) if opts["gns_pairs"] else None
    summary = trainer.finish()
    result = {
        "build_s": build_s,
        "run_s": run_s,
        "summary": summary,
        "gns": gns,
        "memory_capacity_bytes": trainer.memory.capacity,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "hardware": trainer.hardware.name if trainer.hardware is not None else "cpu",
        "peak_flops": trainer.peak_flops,
        "flops_per_token": trainer.shape.model_flops_per_token(),
        "num_params": trainer.shape.num_params(),
    }
    trainer.close()
    shutdown()
    return result


def titan_worker(cfg, run_dir: str, resume: bool = False) -> dict:
    """Every rank of the torchtitan leg (bench/gpu_check_titan.py)."""
    import gpu_check_titan

    _injected("torchtitan", run_dir)
    return gpu_check_titan.worker(cfg, run_dir, resume)


# --------------------------------------------------------------------------- one leg
def _error_text(exc: BaseException) -> str:
    """The failure's last meaningful line (a child's error when the launcher wraps it)."""
    text = str(exc).strip() or type(exc).__name__
    failures = getattr(exc, "failures", None)  # torch elastic's ChildFailedError
    if failures:
        first = next(iter(failures.values()))
        msg = getattr(first, "message", "") or ""
        if isinstance(msg, dict):
            msg = msg.get("message", "") or json.dumps(msg)[:500]
        text = (str(msg).strip().splitlines() or [text])[-1] or text
    return f"{type(exc).__name__}: {text.splitlines()[-1][:500]}"


def run_leg(leg: str, s: dict, out: Path) -> dict:
    """Launch one leg and return its row (status ok / error / skipped)."""
    import shutil

    from copus.config import load_config
    from copus.runtime.train.launch import launch

    row: dict = {"leg": leg, "status": "ok", "nproc": s["nproc"]}
    reason = skip_reason(leg, s)
    if reason is not None:
        return {**row, "status": "skipped", "reason": reason}
    run_dir = out / "runs" / leg
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config_path = out / "runs" / "config.json"
    config_path.write_text(json.dumps(s["config"], indent=1))
    base = common_overrides(s, config_path)
    devices = json.loads((out / "devices.json").read_text())
    mbs = s["mbs"]
    if leg in ("throughput", "torchtitan"):
        pick = pick_micro_batch(base, s, devices["memory_bytes"])
        mbs = pick["micro_batch_size"]
        row["micro_batch_pick"] = pick
    opts = {"leg": leg, "gns_pairs": s["gns_pairs"] if leg in ("eager", "throughput") else 0}
    if leg == "torchtitan":
        cfg = load_config(None, base + [f"parallel.dp={s['nproc']}"])
        opts.update(
            config=s["config"],
            seq_len=s["seq_len"],
            mbs=mbs,
            steps=s["steps"],
            global_batch_size=s["nproc"] * mbs,
            dp=s["nproc"],
            tp=1,
            compile=s["compile"],
            activation_checkpointing="selective",
            nccl_timeout_s=NCCL_TIMEOUT_S,
        )
        entry = titan_worker
    else:
        cfg = load_config(None, base + leg_overrides(leg, s, mbs))
        entry = worker
    row.update(
        compile=leg in ("throughput", "torchtitan") and s["compile"],
        activation_checkpointing="selective" if leg in ("throughput", "torchtitan") else "none",
        micro_batch_size=mbs,
    )
    (run_dir / "leg.json").write_text(json.dumps(opts))
    t0 = time.perf_counter()
    try:
        res = launch(cfg, str(run_dir), max_restarts=0, entry=entry)
    except Exception as exc:  # noqa: BLE001 - the leg's failure is its result (a signal from
        # `timeout` is not: KeyboardInterrupt propagates and gpu.sh records the timeout)
        return {**row, "status": "error", "error": _error_text(exc), "wall_s": time.perf_counter() - t0}
    row["wall_s"] = time.perf_counter() - t0
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if "error" in res:
        return {**row, "status": "error", "error": str(res["error"])}
    if leg == "torchtitan":
        return {**row, **res}
    return {**row, **copus_leg_row(res, cfg, s, run_dir)}


def copus_leg_row(res: dict, cfg, s: dict, run_dir: Path) -> dict:
    from copus.core.specs.gpu_peaks import peak_unknown_reason
    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.train.perf import runtime_memory_model

    shape = get_model_shape(cfg.model.name, s["seq_len"])
    memory_model = runtime_memory_model(cfg, shape, "cpu" if s["dry_run"] else "cuda")
    rows = read_rows(run_dir / "metrics.jsonl")
    segs = segments(rows, memory_model)
    out = {
        k: res[k]
        for k in (
            "build_s",
            "run_s",
            "device",
            "hardware",
            "peak_flops",
            "flops_per_token",
            "num_params",
            "memory_capacity_bytes",
            "gns",
            "summary",
        )
    }
    out.update(
        segments=segs,
        switches=switches(run_dir),
        batch_grew=len({r["global_batch_size"] for r in rows}) > 1,
        compile_s=(segs[0]["first_step_excess_s"] if segs and cfg.train.compile else None),
    )
    if res["peak_flops"] is None:
        out["mfu_note"] = peak_unknown_reason(res["device"])
    if s["dry_run"]:
        for seg in segs:
            seg["peak_over_predicted"] = None  # RSS against a device-memory model
        out["memory_note"] = (
            "CPU: peak allocated = the process's RSS high-water mark (VmHWM, "
            "reset per plan; libraries and the Python heap included: not "
            "comparable to the model's prediction); reserved and device-used "
            "bytes are CUDA-only (null)"
        )
    return out


# --------------------------------------------------------------------------- CLI
def devices(nproc: int, dry: bool, out: Path) -> int:
    """Validate the rank count against the devices torch sees; write DIR/devices.json."""
    out.mkdir(parents=True, exist_ok=True)
    if dry:
        n = nproc or 2
        from copus.core.specs.hardware import get_hardware

        info = {"count": n, "nproc": n, "name": "cpu", "memory_bytes": get_hardware("cpu").memory_bytes}
    else:
        import torch

        count = torch.cuda.device_count()  # honours CUDA_VISIBLE_DEVICES; a MIG slice is one
        n = nproc or count
        problem = check_nproc(n, count)
        if problem:
            print(problem, file=sys.stderr)
            return 2
        props = torch.cuda.get_device_properties(0)
        info = {
            "count": count,
            "nproc": n,
            "name": torch.cuda.get_device_name(0),
            "memory_bytes": float(props.total_memory),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        }
    (out / "devices.json").write_text(json.dumps(info, indent=1) + "\n")
    print(n)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model, 2 CPU ranks, gloo, fp32")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU; 2 dry)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for gpu_check.json/.md")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--devices", action="store_true", help="validate --nproc; devices.json")
    mode.add_argument("--leg", choices=LEGS, help="run one leg -> DIR/legs/LEG.json")
    mode.add_argument("--collect", action="store_true", help="DIR/gpu_check.json and .md")
    ap.add_argument("--wall-s", type=float, default=None, help="(collect) the check's wall time")
    ap.add_argument("--budget-s", type=float, default=None, help="(collect) its time budget")
    args = ap.parse_args(argv)
    out = args.out
    if args.devices:
        return devices(args.nproc, args.dry_run, out)
    info = json.loads((out / "devices.json").read_text())
    s = settings(args.dry_run, info["nproc"])
    if args.leg:
        (out / "legs").mkdir(parents=True, exist_ok=True)
        try:
            row = run_leg(args.leg, s, out)
        except Exception as exc:  # noqa: BLE001 - a leg's own setup failure is its result
            row = {
                "leg": args.leg,
                "status": "error",
                "error": _error_text(exc),
                "traceback": traceback.format_exc()[-2000:],
            }
        (out / "legs" / f"{args.leg}.json").write_text(json.dumps(row, indent=1) + "\n")
        print(
            f"gpu_check: leg {args.leg}: {row['status']}"
            + (f" ({row.get('reason') or row.get('error')})" if row["status"] != "ok" else "")
        )
        return 0
    res = collect(out, s, args.wall_s, args.budget_s)
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1) + "\n")
    table = markdown(res)
    (out / "gpu_check.md").write_text(table)
    print(table)
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
