"""Same seed and plan → bit-identical runs; resume → bit-identical continuation.

Every run here is a real `copus train` (one in-process rank, so it is quick); two-process resume
equality lives in tests/runtime/test_trainer.py and in the fault harness (tests/reliability/
test_faults.py). Where bit-identity cannot hold — a different micro-batch split of the same
global batch sums the gradient in another order — the losses agree to float rounding, and that is
what docs/reliability.md promises.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from copus.cli import main

BASE = [
    "--nproc",
    "1",
    "--set",
    "data.max_chars=60000",
    "--set",
    "eval.interval_steps=0",
    "--set",
    "log.progress=false",
    "--set",
    "log.tensorboard=false",
    "--set",
    "train.warmup_tokens=0",
    "--set",
    "checkpoint.keep=10",
]
# Fields that must repeat bit for bit (times and rates are wall-clock, never compared).
EXACT = (
    "step",
    "samples",
    "tokens",
    "loss",
    "lr",
    "global_batch_size",
    "micro_batch_size",
    "grad_norm",
    "small_sqnorm",
    "big_sqnorm",
    "grad_sqnorm",
    "grad_trace_cov",
    "b_noise",
)


def _train(run: Path, *argv: str, capsys) -> list[dict]:
    code = main(["train", *BASE, "--run-dir", str(run), *argv])
    assert code == 0, capsys.readouterr().err[-2000:]
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _exact(rows: list[dict]) -> list[tuple]:
    return [tuple(r.get(k) for k in EXACT) for r in rows]


# ramp policy: the global batch grows 4 → 8 → 12 during the run (a plan change that every
# run takes at the same step, because it depends only on samples consumed)
RAMP = [
    "--policy",
    "ramp",
    "--set",
    "batch.initial=4",
    "--set",
    "batch.min=4",
    "--set",
    "batch.ramp_to=12",
    "--set",
    "batch.ramp_kind='stepwise'",
    "--set",
    "batch.ramp_samples=24",
    "--set",
    "batch.ramp_steps=2",
    "--set",
    "batch.warmup_steps=1",
    "--set",
    "batch.interval_steps=1",
]


def test_same_seed_same_plan_is_bit_identical_and_the_seed_matters(tmp_path, capsys):
    args = ["--seed", "3", "--max-steps", "5", *RAMP, "--set", "checkpoint.interval_steps=2"]
    a = _train(tmp_path / "a", *args, capsys=capsys)
    b = _train(tmp_path / "b", *args, capsys=capsys)
    assert [r["step"] for r in a] == list(range(1, 6))
    assert len({r["global_batch_size"] for r in a}) >= 2  # the plan did change
    assert _exact(a) == _exact(b)
    assert all(math.isfinite(r["loss"]) for r in a)
    other_seed = [x if x != "3" else "4" for x in args]
    other_seed[other_seed.index("--max-steps") + 1] = "1"
    c = _train(tmp_path / "c", *other_seed, capsys=capsys)
    assert c[0]["loss"] != a[0]["loss"]


def test_resume_is_bit_identical_to_the_uninterrupted_run(tmp_path, capsys):
    """Checkpoint at step 3 (after the first batch change), resume in a fresh run folder."""
    args = ["--seed", "5", "--max-steps", "6", *RAMP, "--set", "checkpoint.interval_steps=3"]
    full = _train(tmp_path / "full", *args, capsys=capsys)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-3", cut / "checkpoints" / "step-3")
    shutil.copy(tmp_path / "full" / "config.toml", cut / "config.toml")
    code = main(["train", "--resume", "--run-dir", str(cut), "--max-steps", "6"])
    assert code == 0, capsys.readouterr().err[-2000:]
    resumed = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert _exact(resumed) == _exact(full[3:])


@pytest.mark.parametrize("split", ["8"])
def test_another_micro_batch_split_agrees_to_rounding_only(tmp_path, capsys, split):
    """Global batch 8 as 2x4 or as 1x8: the same samples, gradients summed
    in another order. Losses agree to ~1e-6 relative; bit-identity is not promised."""
    args = ["--seed", "1", "--max-steps", "3", "--policy", "constant", "--set", "checkpoint.interval_steps=0"]
    ref = _train(tmp_path / "ref", *args, "--set", "parallel.micro_batch_size=4", capsys=capsys)
    other = _train(tmp_path / split, *args, "--set", f"parallel.micro_batch_size={split}", capsys=capsys)
    assert [r["samples"] for r in ref] == [r["samples"] for r in other]
    for r, o in zip(ref, other, strict=True):
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-6)
