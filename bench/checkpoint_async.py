"""Benchmark: training step time while a checkpoint is being written, synchronous vs asynchronous.

Hypothesis: with `checkpoint.save` every rank stops training for the whole write (plus, before,
a read-back to hash the files); with `async_checkpoint.AsyncCheckpointer` (DCP `async_save`, hashes
computed while writing) a step only pays for staging the state to host memory, and the steps
that overlap the background write run at ≤ 1.1 × a normal step.

Run: one process, CPU, the named model (default `small`) with AdamW in fp32, `torch` on one
thread (as a copus CPU worker: OMP_NUM_THREADS=1), random tokens. Per repeat: `--steps` normal
steps, then a save started at a step boundary followed by steps until it has finished (async),
or one synchronous save followed by the same steps (sync); the two modes alternate between
repeats. Reported: the median normal step, the median step overlapping an asynchronous write,
the time the training loop is blocked by the save call (staging for async; the whole save for
sync), and the write's duration. Bytes re-read for hashing are counted (`checkpoint_integrity._sha256`).

Writes bench/results/checkpoint_async_<kind>.json and .md.
Run: python bench/checkpoint_async.py [--model small] [--repeats 5] [--steps 8] [--nice 0]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from copus.core.specs.resolve import get_model_shape
from copus.runtime.engine.model import build_model, materialize
from copus.runtime.state import checkpoint as ckpt
from copus.runtime.state import checkpoint_integrity as ci
from copus.runtime.state.async_checkpoint import AsyncCheckpointer

OUT = Path(__file__).resolve().parent / "results" / "checkpoint_async"
COUNTING = [True]  # off while the bench itself verifies a finished checkpoint
NICE = [0]
KIND = ["thread"]
SAVERS: dict = {}  # one per kind: a process-based one keeps its daemon between saves


def make(model_name: str):
    shape = get_model_shape(model_name)
    model = materialize(build_model(shape, "meta"), "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, shape.vocab_size, (4, shape.seq_len + 1), generator=torch.Generator().manual_seed(0))
    return shape, model, opt, tokens


def step(model, opt, tokens) -> float:
    t0 = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def one_repeat(mode: str, model, opt, tokens, root: Path, k: int, steps: int) -> dict:
    normal = [step(model, opt, tokens) for _ in range(steps)]
    t0 = time.perf_counter()
    if mode == "sync":
        ckpt.save(root, k, state(model, opt), {"step": k})
        blocked = time.perf_counter() - t0
        during = [step(model, opt, tokens) for _ in range(steps)]
        return {"normal": normal, "during": during, "blocked_s": blocked, "write_s": blocked, "overlapped_steps": 0}
    reuse = mode == "async"  # "async_fresh": new staging tensors at every save (the former way)
    if (KIND[0], reuse) not in SAVERS:
        SAVERS[KIND[0], reuse] = AsyncCheckpointer(nice=NICE[0], kind=KIND[0], reuse_staging=reuse)
    saver = SAVERS[KIND[0], reuse]
    saver.save(root, k, state(model, opt), {"step": k})
    blocked = time.perf_counter() - t0
    thread = saver._pending[0]
    during = []
    while thread.is_alive() or not during:
        during.append(step(model, opt, tokens))
    saver.wait()
    write = time.perf_counter() - t0
    COUNTING[0] = False
    assert ckpt.verify(root / f"step-{k}") is None
    COUNTING[0] = True
    return {"normal": normal, "during": during, "blocked_s": blocked, "write_s": write, "overlapped_steps": len(during)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--nice", type=int, default=0, help="the writing thread's nice offset")
    ap.add_argument("--kind", default="thread", choices=("thread", "process"))
    args = ap.parse_args()
    NICE[0], KIND[0] = args.nice, args.kind
    if args.kind == "process":  # DCP's checkpoint process needs a process group
        import os

        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    shape, model, opt, tokens = make(args.model)
    for _ in range(3):
        step(model, opt, tokens)  # warm-up, AdamW state allocated
    hashed: list[int] = []
    real = ci._sha256
    ci._sha256 = lambda p: (COUNTING[0] and hashed.append(Path(p).stat().st_size)) or real(p)
    root = Path(tempfile.mkdtemp(prefix="copus-ckpt-bench-"))
    modes = ["async", "async_fresh", "sync"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        k = 0
        for rep in range(args.repeats):
            for mode in modes[rep % 3 :] + modes[: rep % 3]:  # interleaved, rotating order
                k += 1
                runs[mode].append(one_repeat(mode, model, opt, tokens, root, k, args.steps))
    finally:
        ci._sha256 = real
        shutil.rmtree(root, ignore_errors=True)
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    result = {
        "machine": platform.processor() or platform.machine(),
        "model": args.model,
        "state_bytes": state_bytes,
        "torch_threads": 1,
        "writer_nice": args.nice,
        "kind": args.kind,
        "note": "2 CPU cores shared with other jobs; one process; medians over repeats, the three modes interleaved",
        "command": f"python bench/checkpoint_async.py --model {args.model} --repeats "
        f"{args.repeats} --steps {args.steps} --nice {args.nice} --kind {args.kind}",
        "bytes_reread_for_hashing": sum(hashed),
    }
    for mode, reps in runs.items():
        normal = statistics.median(x for r in reps for x in r["normal"])
        during = statistics.median(x for r in reps for x in r["during"])
        result[mode] = {
            "normal_step_s": normal,
            "step_during_save_s": during,
            "ratio_during_over_normal": during / normal,
            "blocked_s": statistics.median(r["blocked_s"] for r in reps),
            "write_s": statistics.median(r["write_s"] for r in reps),
            "overlapped_steps": [r["overlapped_steps"] for r in reps],
        }
    result["goal_ok"] = result["async"]["ratio_during_over_normal"] <= 1.1
    for saver in SAVERS.values():
        saver.close()
    out = OUT.with_name(f"{OUT.name}_{args.kind}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(table(result))
    print(table(result))


def table(r: dict) -> str:
    a, s, f = r["async"], r["sync"], r["async_fresh"]
    lines = [
        f"Model `{r['model']}`, state (weights + AdamW) {r['state_bytes'] / 2**20:.1f} MiB, CPU, 1 torch thread.",
        "",
        "| save | normal step ms | step during the write ms | ratio | training blocked by "
        "the save call ms | write ms |",
        "|---|---|---|---|---|---|",
        f"| synchronous (`checkpoint.save`) | {s['normal_step_s'] * 1e3:.1f} | (blocked) | — | "
        f"{s['blocked_s'] * 1e3:.1f} | {s['write_s'] * 1e3:.1f} |",
        f"| asynchronous (`AsyncCheckpointer`, {r['kind']}, staging reused) | {a['normal_step_s'] * 1e3:.1f} | "
        f"{a['step_during_save_s'] * 1e3:.1f} | {a['ratio_during_over_normal']:.2f} | "
        f"{a['blocked_s'] * 1e3:.1f} | {a['write_s'] * 1e3:.1f} |",
        f"| asynchronous ({r['kind']}, fresh staging tensors per save) | {f['normal_step_s'] * 1e3:.1f} | "
        f"{f['step_during_save_s'] * 1e3:.1f} | {f['ratio_during_over_normal']:.2f} | "
        f"{f['blocked_s'] * 1e3:.1f} | {f['write_s'] * 1e3:.1f} |",
        "",
        f"Bytes re-read for hashing during the saves: {r['bytes_reread_for_hashing']}.",
        f"({r['note']}; command: `{r['command']}`)",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
