"""Resident memory of the engine on CPU (2 gloo ranks): gradient accumulation, close, branch
staging, the loss's bytes per logit, and the memory model against measured peaks per plan.

Resident memory = Linux VmRSS / VmHWM (peak reset through /proc/self/clear_refs); glibc is
told to serve blocks ≥ 128 KiB from mmap and return them on free (MALLOC_MMAP_THRESHOLD_), so
resident memory follows live tensors. Sections (each a list of rows in the JSON):

- accumulation: dp 2, micro-batch 1, 1 vs 4 micro-batches, peak over 2 steps after a warm-up,
  with gns.small = "microbatch" (reduce-scatter every micro-batch) and "rank" (gradient sync on
  the last micro-batch only: the former path for both modes); extra = peak(4) − peak(1)
  against 4·P/tp.
- close: resident memory freed by `Engine.close()` + `del` before any `gc.collect()`, and by the
  collection after it; the former close (no reference dropping) side by side.
- staging: peak during stage → one branch step → restore (the probe's pattern) against the
  training step's peak; `host_stage.TensorStage` (a file on CPU) vs the former state-dict clone.
- logits: bytes per logit at the forward+backward peak of head + loss (plain model, one process).
- model: `perf.runtime_memory_model` (fp32 on CPU) against the measured peak above the resident
  memory before the engine was built, per plan (dp2 / tp2 / pp2, micro-batch 1–2, 1–2 micro-batches).

    python bench/engine_memory.py [--sections model,staging] → bench/results/engine_memory.json, .md
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.runtime._workers import run_ranks  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SHAPE_KW = dict(name="mem", n_layers=4, dim=512, n_heads=8, n_kv_heads=4, ffn_dim=1536, vocab_size=8192, seq_len=256)


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return float(line.split()[1]) * 1024.0
    return float("nan")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _tokens(shape, rows: int, seed: int):
    import torch

    return torch.randint(0, shape.vocab_size, (rows, shape.seq_len + 1), generator=torch.Generator().manual_seed(seed))


def _step_peak(eng, tokens, steps: int = 2) -> float:
    import torch.distributed as dist

    eng.train_step(tokens, 0.0)  # warm-up: optimizer state exists
    dist.barrier()
    _reset_peak()
    for _ in range(steps):
        eng.train_step(tokens, 0.0)
    return _status("VmHWM:")


def _accumulation(shape, cache, repeats: int) -> list[dict]:
    from copus.core.plan.plan import ParallelPlan
    from copus.runtime.engine.engine import Engine, EngineSettings

    rows = []
    for rep in range(repeats):
        for mode in ("microbatch", "rank") if rep % 2 == 0 else ("rank", "microbatch"):
            peaks = {}
            for k in (1, 4) if rep % 2 == 0 else (4, 1):
                plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=1, num_microbatches=k)
                eng = Engine(shape, plan, EngineSettings(gns_small=mode), "cpu", cache, seed=0)
                peaks[k] = _step_peak(eng, _tokens(shape, k, 1))
                params = shape.num_params()
                eng.close()
                del eng
            rows.append(
                {
                    "mode": mode,
                    "repeat": rep,
                    "peak_k1": peaks[1],
                    "peak_k4": peaks[4],
                    "extra": peaks[4] - peaks[1],
                    "four_p_over_tp": 4.0 * params,
                }
            )
    return rows


def _close(shape, cache) -> list[dict]:
    import gc

    from copus.core.plan.plan import ParallelPlan
    from copus.runtime.engine import engine as engine_mod
    from copus.runtime.engine.engine import Engine, EngineSettings

    rows = []
    real = engine_mod.drop_tensors
    for how in ("drop references (now)", "former close"):
        engine_mod.drop_tensors = real if how.startswith("drop") else (lambda m, o: None)
        plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=1, num_microbatches=2)
        gc.collect()
        gc.disable()
        try:
            base = _status("VmRSS:")
            eng = Engine(shape, plan, EngineSettings(), "cpu", cache, seed=0)
            eng.train_step(_tokens(shape, 2, 2), 0.0)
            held = _status("VmRSS:")
            eng.close()
            del eng
            after_close = _status("VmRSS:")
            gc.collect()
            after_gc = _status("VmRSS:")
        finally:
            gc.enable()
            engine_mod.drop_tensors = real
        rows.append(
            {
                "how": how,
                "engine_bytes": held - base,
                "freed_by_close": held - after_close,
                "freed_by_gc": after_close - after_gc,
            }
        )
    return rows


def _old_clone(tree):
    import copy

    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _old_clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_old_clone(v) for v in tree]
    return copy.deepcopy(tree)


def _staging(shape, cache, folder: str) -> list[dict]:
    import torch.distributed as dist

    from copus.core.plan.plan import ParallelPlan
    from copus.runtime.engine.engine import Engine, EngineSettings
    from copus.runtime.train.host_stage import TensorStage

    plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=1, num_microbatches=2)
    rows = []
    for how in ("host stage (now)", "state-dict clone (former)", "host stage (now)"):
        eng = Engine(shape, plan, EngineSettings(), "cpu", cache, seed=0)
        tokens = _tokens(shape, 2, 3)
        step_peak = _step_peak(eng, tokens)
        dist.barrier()
        _reset_peak()
        if how.startswith("host"):
            staged = TensorStage(eng, folder, plan.describe())
            eng.train_step(tokens, 1e-3)
            best = TensorStage(eng, folder, plan.describe())  # the probe's best branch
            staged.restore(eng)
            eng.train_step(tokens, 1e-3)
            best.restore(eng)
            staged.close()
            best.close()
        else:
            staged = _old_clone(eng.state_dicts())
            eng.train_step(tokens, 1e-3)
            best = _old_clone(eng.state_dicts())
            eng.load_state(*_old_clone(staged))
            eng.train_step(tokens, 1e-3)
            eng.load_state(*_old_clone(best))
            del staged, best
        probe_peak = _status("VmHWM:")
        rows.append({"how": how, "step_peak": step_peak, "probe_peak": probe_peak, "ratio": probe_peak / step_peak})
        eng.close()
        del eng
    return rows


def _model(shape, cache) -> list[dict]:
    import torch.distributed as dist

    from copus.config import load_config
    from copus.core.plan.plan import ParallelPlan
    from copus.runtime.engine.engine import Engine, settings_from_config
    from copus.runtime.train.perf import runtime_memory_model

    cfg = load_config(None, [])
    mm = runtime_memory_model(cfg, shape, "cpu")
    rows = []
    for dp, tp, pp in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
        for mbs, k in ((1, 2), (2, 2), (2, 4)):
            if pp > 1 and k < pp:
                continue
            plan = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=k)
            dist.barrier()
            base = _status("VmRSS:")
            _reset_peak()
            eng = Engine(shape, plan, settings_from_config(cfg), "cpu", cache, seed=0)
            tokens = _tokens(shape, mbs * k, 4)
            for _ in range(3):
                eng.train_step(tokens, 0.0)
            measured = _status("VmHWM:") - base
            parts = mm.breakdown(dp, tp, pp, mbs, k)
            rows.append(
                {
                    "plan": plan.describe(),
                    "measured": measured,
                    "model": float(parts["total"]),
                    "parts": {k2: float(v) for k2, v in parts.items()},
                }
            )
            eng.close()
            del eng
    return rows


def _work(folder: str, repeats: int, sections: list[str]):
    from copus.core.specs.models import ModelShape
    from copus.runtime.engine.dist import MeshCache

    shape = ModelShape(**SHAPE_KW)
    cache = MeshCache("cpu")
    runs = {
        "accumulation": lambda: _accumulation(shape, cache, repeats),
        "close": lambda: _close(shape, cache),
        "staging": lambda: _staging(shape, cache, folder),
        "model": lambda: _model(shape, cache),
    }
    return {name: runs[name]() for name in sections}


def _logits() -> list[dict]:
    import weakref

    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Live(TorchDispatchMode):
        """Peak of the bytes of op outputs alive at once (freed when their tensor dies)."""

        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.seen: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    key, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                    if key in self.seen or n == 0:
                        continue
                    self.seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)

                    def free(k=key, n=n):
                        self.live -= n
                        self.seen.discard(k)

                    weakref.finalize(t, free)
            return out

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        b, s, d, v = 8, 128, 64, 8192
        head = torch.nn.Linear(d, v, bias=False).to(dtype)
        x = torch.randn(b, s, d, dtype=dtype, requires_grad=True)
        y = torch.randint(0, v, (b, s))
        mode = Live()
        with mode:
            logits = head(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            del logits
            loss.backward()
        weight_grad = d * v * (4 if dtype == torch.float32 else 2)
        input_grad = b * s * d * (4 if dtype == torch.float32 else 2)
        rows.append({"dtype": str(dtype), "bytes_per_logit": (mode.peak - weight_grad - input_grad) / (b * s * v)})
    return rows


def _md(out: dict) -> str:
    mb = 2.0**20
    lines = [
        "# Engine memory on CPU (2 gloo ranks, 2 shared cores)",
        "",
        f"model: {SHAPE_KW}",
        "",
        "## Accumulation: dp 2, micro-batch 1, 4 vs 1 micro-batches",
        "",
        "| gns.small | extra peak RSS (MB, median) | 4·P/tp (MB) | extra / (4·P/tp) |",
        "|---|---|---|---|",
    ]
    for mode in ("microbatch", "rank"):
        rows = [r for r in out["accumulation"] if r["mode"] == mode]
        extra = statistics.median(r["extra"] for r in rows)
        four = rows[0]["four_p_over_tp"]
        lines.append(f"| {mode} | {extra / mb:.1f} | {four / mb:.1f} | {extra / four:.3f} |")
    lines += [
        "",
        "## Close (rank 0)",
        "",
        "| close | engine (MB) | freed by close (MB) | freed by gc after (MB) |",
        "|---|---|---|---|",
    ]
    for r in out["close"]:
        lines.append(
            f"| {r['how']} | {r['engine_bytes'] / mb:.1f} | {r['freed_by_close'] / mb:.1f} | "
            f"{r['freed_by_gc'] / mb:.1f} |"
        )
    lines += [
        "",
        "## Branch staging (probe pattern, rank 0)",
        "",
        "| staging | step peak (MB) | probe peak (MB) | probe / step |",
        "|---|---|---|---|",
    ]
    for r in out["staging"]:
        lines.append(f"| {r['how']} | {r['step_peak'] / mb:.0f} | {r['probe_peak'] / mb:.0f} | {r['ratio']:.3f} |")
    lines += ["", "## Loss bytes per logit (forward + backward peak)", "", "| dtype | bytes/logit |", "|---|---|"]
    for r in out["logits"]:
        lines.append(f"| {r['dtype']} | {r['bytes_per_logit']:.2f} |")
    lines += [
        "",
        "## Memory model vs measured peak above the pre-build resident memory (max over ranks)",
        "",
        "| plan | measured (MB) | model (MB) | model / measured |",
        "|---|---|---|---|",
    ]
    for r in out["model"]:
        lines.append(
            f"| {r['plan']} | {r['measured'] / mb:.1f} | {r['model'] / mb:.1f} | {r['model'] / r['measured']:.3f} |"
        )
    lines += ["", "commands: " + "; ".join(f"{k}: `{v}`" for k, v in out.get("commands", {}).items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--sections",
        default="accumulation,close,staging,model",
        help="a subset re-runs those sections and keeps the others from the last JSON",
    )
    args = ap.parse_args()
    sections = args.sections.split(",")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    with tempfile.TemporaryDirectory() as folder:
        ranks = run_ranks(_work, 2, folder, args.repeats, sections, timeout=3000)
    path = RESULTS / "engine_memory.json"
    out = json.loads(path.read_text()) if path.is_file() else {}
    out.setdefault("commands", {})
    command = "python bench/engine_memory.py " + " ".join(sys.argv[1:])
    out.update(
        {
            "command": command,
            "machine": "2 shared CPU cores (other jobs running), gloo",
            "shape": SHAPE_KW,
            "logits": _logits(),
        }
    )
    for name in sections:
        out["commands"][name] = command
        out[name] = ranks[0][name]
        if name == "model":
            out[name] = [
                dict(r0, measured=max(r0["measured"], r1["measured"]), ranks=[r0["measured"], r1["measured"]])
                for r0, r1 in zip(ranks[0]["model"], ranks[1]["model"])
            ]
    out.pop("ranks", None)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    text = _md(out)
    (RESULTS / "engine_memory.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
