"""Blocking host syncs per training step (issue 23): at most 2 on a step without evaluation,
checkpoint or decision, counted on 2 CPU ranks by patching every host read of a tensor
(`Tensor.item` / `.cpu()` / `.tolist()` / `float()` / `int()` / `bool()`) and every collective
the trainer can issue (`torch.distributed.all_reduce`, `broadcast`, `broadcast_object_list`,
`all_gather_object`, `barrier`). On CUDA each of these waits for the device; FSDP2's own
all-gathers and reduce-scatters are asynchronous and not counted."""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

import pytest

from tests.runtime._workers import run_ranks

SRC = Path(__file__).resolve().parents[2] / "src" / "copus"
READS = ("item", "cpu", "tolist", "__float__", "__int__", "__bool__")
COLLECTIVES = ("all_reduce", "broadcast", "broadcast_object_list", "all_gather_object", "barrier")


def _count(fn, counts):
    import torch
    import torch.distributed as dist

    saved = []
    for obj, names in ((torch.Tensor, READS), (dist, COLLECTIVES)):
        for name in names:
            orig = getattr(obj, name)

            def wrapped(*a, _orig=orig, _name=name, **k):
                caller = sys._getframe(1).f_globals.get("__name__", "")
                # AdamW reads its per-parameter step counters (host tensors unless
                # capturable/fused, checked below): no device sync on CUDA
                counts[f"{_name}@torch.optim" if caller.startswith("torch.optim") else _name] += 1
                return _orig(*a, **k)

            saved.append((obj, name, orig))
            setattr(obj, name, wrapped)
    try:
        return fn()
    finally:
        for obj, name, orig in saved:
            setattr(obj, name, orig)


def _syncs_worker(run_dir: str, policy: str) -> list[dict]:
    import torch

    from copus.config import load_config
    from copus.runtime.train.trainer import Trainer

    cfg = load_config(
        None,
        [
            "data.max_chars=200000",
            "eval.interval_steps=0",
            "checkpoint.interval_steps=0",
            "log.progress=false",
            "log.tensorboard=false",
            "batch.initial=8",
            "batch.min=8",
            f"batch.policy={policy!r}",
            "batch.ramp_kind='stepwise'",
            "batch.ramp_steps=1",
            "batch.ramp_to=16",
            "batch.ramp_samples=40",
            "batch.interval_steps=1",
            "batch.warmup_steps=0",
            "parallel.micro_batch_size=2",
            "train.max_steps=20",
        ],
    )
    trainer = Trainer(cfg, run_dir, torch.device("cpu"))
    per_step = []
    for _ in range(7):
        counts: collections.Counter = collections.Counter()

        def one_step():
            signum, _due = trainer.boundary_flags()
            assert signum == 0
            record = trainer.train_step()
            decision = trainer.decide(record)
            if decision is not None:
                trainer.apply_decision(decision)
            return decision is not None

        decided = _count(one_step, counts)
        per_step.append({"step": trainer.progress.step, "decided": decided, **counts})
    steps_on_host = all(st["step"].device.type == "cpu" for st in trainer.engine.optimizer.state.values())
    per_step.append(
        {"optimizer_steps_on_host": steps_on_host, "num_params": len(list(trainer.engine.model.parameters()))}
    )
    trainer.close()
    return per_step


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["constant", "ramp"])
def test_at_most_two_host_syncs_per_step(tmp_path, policy):
    """Steps 2..7 of a 2-rank run: the statistics all-reduce and the end-of-step all-reduce
    (step time, peak memory, stop flags, decision flag), each read once; the decision is
    broadcast only at the step that decided (ramp: B 8 -> 16 at 40 samples, step 5)."""
    *rows, opt = run_ranks(_syncs_worker, 2, str(tmp_path), policy)[0]
    assert opt["optimizer_steps_on_host"]
    for row in rows[1:]:  # step 1 also polls the boundary (no previous step end)
        assert row.pop("item@torch.optim", 0) == opt["num_params"]  # host step counters
        extra = 1 if row["decided"] else 0
        assert row.get("all_reduce", 0) == 2, row
        assert row.get("broadcast_object_list", 0) == extra, row
        assert row.get("tolist", 0) == 2, row
        others = {
            k: v
            for k, v in row.items()
            if k not in ("step", "decided", "all_reduce", "broadcast_object_list", "tolist")
        }
        assert not any(others.values()), others
        assert row.get("all_reduce", 0) + row.get("broadcast_object_list", 0) <= 2 + extra
    assert [r["decided"] for r in rows].count(True) == (1 if policy == "ramp" else 0)
    assert rows[0].get("all_reduce", 0) == 3  # step 1: Boundary.poll's own all-reduce


# --------------------------------------------------------------------- code-level device check
HOT_PATH = {
    "runtime/engine/grad_stats.py": None,
    "runtime/engine/engine.py": {"Engine.train_step", "Engine._forward_backward"},
    "runtime/train/step.py": {  # the trainer's step (`StepMixin`, a base of `Trainer`)
        "StepMixin.step_once",
        "StepMixin.step_end",
        "StepMixin.train_step",
        "StepMixin.batch_to_device",
        "StepMixin.decide",
    },
    "adapt.py": {
        "AdaptiveBatch.end_step",
        "AdaptiveBatch._statistics",
        "AdaptiveBatch._big_sqnorm_share",
        "AdaptiveBatch._agree",
        "AdaptiveBatch._extras",
    },
}
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "zeros_like"}
# a factory whose result is on the right device without device=: documented exceptions
ALLOWED = {
    ("runtime/engine/grad_stats.py", "weighted_sqnorm"),  # the empty list's zero (no device)
    ("runtime/train/step.py", "StepMixin.batch_to_device"),  # host rows, then pinned + copied
    ("adapt.py", "AdaptiveBatch._statistics"),  # torch.tensor(..., device=device)
}


def _functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    yield f"{node.name}.{sub.name}", sub


def test_hot_path_tensors_are_created_on_the_models_device():
    """Every torch factory call (zeros, tensor, ...) in the per-step code names its device
    (`device=`), or derives it from an existing tensor (`*_like`): a tensor created on the host
    while the model is on CUDA is a device error (torch.stack) or a host-to-device copy (a
    stream sync). Checked in the source, so it holds for CUDA without a GPU."""
    bad = []
    for rel, names in HOT_PATH.items():
        tree = ast.parse((SRC / rel).read_text())
        for qual, fn in _functions(tree):
            if names is not None and qual not in names:
                continue
            for node in ast.walk(fn):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch"
                    and node.func.attr in FACTORIES
                ):
                    continue
                if node.func.attr.endswith("_like") or any(k.arg == "device" for k in node.keywords):
                    continue
                if (rel, qual) not in ALLOWED:
                    bad.append(f"{rel}:{node.lineno} {qual}: torch.{node.func.attr}(...) without device=")
    assert not bad, "\n".join(bad)
