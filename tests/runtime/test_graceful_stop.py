"""Real SIGINT / SIGTERM to a 2-rank `copus train` (runtime/train/stop.py): the run stops at a step
with a checkpoint and exit 130 / 143, a second signal aborts without harming the last complete
checkpoint, and `--resume` logs every step exactly once with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from copus.runtime.state import checkpoint as ckpt

STEPS = 8
ARGS = [
    "--nproc",
    "2",
    "--policy",
    "constant",
    "--seed",
    "2",
    "--set",
    "data.max_chars=200000",
    "--set",
    "eval.interval_steps=2",
    "--set",
    "eval.num_samples=8",
    "--set",
    "log.tensorboard=false",
    "--set",
    "train.lr_schedule='constant'",
    "--set",
    "train.warmup_tokens=2048",
    "--set",
    "checkpoint.keep=10",
]


def _env() -> dict:
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _start(run_dir: Path, *argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "copus", "train", "--run-dir", str(run_dir), *argv],
        cwd=run_dir.parent,
        env=_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _rows(path: Path, superseded: bool = False) -> list[dict]:
    """A log's live rows (or, with `superseded`, every row)."""
    if not path.exists():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return rows if superseded else [r for r in rows if not r.get("superseded")]


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 240, every: float = 0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = predicate()
        if found:
            return found
        if proc.poll() is not None:
            return None
        time.sleep(every)
    return None


def _signal_after_rows(proc: subprocess.Popen, run_dir: Path, n: int, sig: int) -> None:
    if not _wait_for(lambda: len(_rows(run_dir / "metrics.jsonl")) >= n, proc):
        proc.kill()
        pytest.fail(f"the run ended before step {n}: {proc.communicate()[1][-2000:]}")
    proc.send_signal(sig)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("ref") / "run"
    code, _, err = _finish(_start(run, *ARGS, "--max-steps", str(STEPS), "--set", "checkpoint.interval_steps=0"))
    assert code == 0, err[-3000:]
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return {r["step"]: r["loss"] for r in rows}


def _assert_resumes_like_the_reference(run: Path, reference: dict[int, float]) -> str:
    code, out, err = _finish(_start(run, "--resume", "--max-steps", str(STEPS)))
    assert code == 0, err[-3000:]
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step exactly once
    assert {r["step"]: r["loss"] for r in rows} == pytest.approx(reference, rel=1e-6)
    evals = [e["step"] for e in _rows(run / "eval.jsonl")]
    assert evals == sorted(set(evals)) == list(range(2, STEPS + 1, 2))
    assert json.loads((run / "run.json").read_text())["state"] == "finished"
    return out


@pytest.mark.slow
def test_sigint_stops_after_the_step_with_a_checkpoint_and_resume_matches(tmp_path, reference):
    run = tmp_path / "run"
    proc = _start(run, *ARGS, "--max-steps", str(STEPS), "--set", "checkpoint.interval_steps=0")
    _signal_after_rows(proc, run, 3, signal.SIGINT)
    code, _, err = _finish(proc)
    assert code == 130, err[-3000:]
    stopped_at = _rows(run / "metrics.jsonl")[-1]["step"]
    assert 3 <= stopped_at < STEPS
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"copus train: stopped by SIGINT at step {stopped_at} "), last
    assert last.endswith(f"resume: copus train --run-dir {run} --resume"), last
    assert sum("stopped by SIGINT" in line for line in err.splitlines()) == 1
    latest = ckpt.find_latest(run / "checkpoints", log=lambda _: None)
    assert latest is not None and latest.name == f"step-{stopped_at}"
    assert ckpt.verify(latest) is None and "Traceback" not in err
    state = json.loads((run / "run.json").read_text())
    assert (state["state"], state["step"], state["checkpoint"]) == ("stopped", stopped_at, f"step-{stopped_at}")
    _assert_resumes_like_the_reference(run, reference)


@pytest.mark.slow
def test_a_second_signal_during_the_save_keeps_the_previous_checkpoint(tmp_path, reference):
    """SIGTERM, then SIGINT while a checkpoint is being written: exit 143 at once, the
    half-written save stays a tmp-step-* folder, the previous step-N verifies, and --resume
    from it marks the log rows written after it superseded (one live row per step). (A repeat
    of the same signal within stop.DUPLICATE_WINDOW_S counts as one delivery, test_stop.py.)"""
    run = tmp_path / "run"
    proc = _start(run, *ARGS, "--max-steps", "40", "--set", "checkpoint.interval_steps=2")
    _signal_after_rows(proc, run, 3, signal.SIGTERM)
    tmp = _wait_for(lambda: next((run / "checkpoints").glob("tmp-step-*"), None), proc)
    if tmp is None:
        code, _, err = _finish(proc)
        pytest.fail(f"no save in progress was seen after SIGTERM (exit {code}): {err[-2000:]}")
    proc.send_signal(signal.SIGINT)
    code, _, err = _finish(proc, timeout=60)
    assert code == 143, err[-3000:]
    assert "aborted by a second signal (SIGINT)" in err.strip().splitlines()[-1]
    saving = int(tmp.name.rsplit("-", 1)[1])
    latest = ckpt.find_latest(run / "checkpoints", log=lambda _: None)
    assert latest is not None and ckpt.verify(latest) is None
    kept = int(latest.name.split("-")[1])
    assert kept < saving
    lost = [r["step"] for r in _rows(run / "metrics.jsonl") if r["step"] > kept]
    assert lost  # rows after the checkpoint
    _assert_resumes_like_the_reference(run, reference)
    marked = [r["step"] for r in _rows(run / "metrics.jsonl", superseded=True) if r.get("superseded")]
    assert marked == lost  # kept as a record, marked, skipped by readers
