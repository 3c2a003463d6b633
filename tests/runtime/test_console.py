"""What `copus train` prints: one line per decision, log lines above the progress bar, a plain
progress line without a usable terminal, validation lines piped or not (piped: the shared run of
test_commands_e2e.py); and one row per step in the logs after a resume (RunWriter.truncate_after,
reporting.runs.latest_rows)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import StepRecord
from copus.reporting.runs import latest_rows, load_run
from copus.runtime.state.metrics import RunWriter, supersede_jsonl

PLAN = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=4, num_microbatches=1)


def _record(step: int) -> StepRecord:
    return StepRecord(
        step=step,
        samples=8 * step,
        tokens=1024 * step,
        plan=PLAN,
        step_s=0.1,
        loss=5.0 - step / 10,
        lr=1e-3,
        small_sqnorm=1.0,
        small_batch=4.0,
        num_small=2,
        big_sqnorm=0.5,
        ip_sq_mean=None,
        grad_sqnorm=0.4,
        grad_trace_cov=2.0,
        b_noise=5.0,
        b_noise_rel_err=0.3,
        skipped=False,
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_without_a_terminal_plain_progress_and_val_lines_go_to_stdout(tmp_path, capsys):
    w = RunWriter(tmp_path, tensorboard=False, progress=True, total_steps=4, progress_interval_s=0)
    assert w._bar is None  # stderr is captured: no usable terminal
    for step in (1, 2):
        w.log_step(_record(step))
    w.log_eval(2, 4.25)
    w.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("copus: step 1, 1,024 tokens (25%), loss 4.9000, 10,240 tokens/s, B 8 dp2.tp1.pp1 mb4x1, 0 s")
    assert out[1].startswith("copus: step 2, 2,048 tokens (50%)")
    assert out[2] == "copus: step 2: val_loss 4.2500"


def test_supersede_after_leaves_one_live_row_per_step_and_continues_the_clock(tmp_path):
    w = RunWriter(tmp_path, tensorboard=False, wall_offset_s=0)
    for step in range(1, 6):
        w.log_step(_record(step), wall_s=10.0 * step)
        w.log_eval(step, 4.0, wall_s=10.0 * step)
    w.close()
    (tmp_path / "decisions.jsonl").write_text('{"step": 2}\n{"step": 5}\n{"step": 6, "cut')
    resumed = RunWriter(tmp_path, tensorboard=False)
    assert resumed.supersede_after(3) == 2 + 2 + 1
    raw = _rows(tmp_path / "metrics.jsonl")
    assert [(r["step"], r.get("superseded", False)) for r in raw] == [
        (1, False),
        (2, False),
        (3, False),
        (4, True),
        (5, True),
    ]
    assert raw[3]["loss"] == _record(4).loss  # the lost attempt's record stays
    assert [r["step"] for r in _rows(tmp_path / "decisions.jsonl") if not r.get("superseded")] == [2]
    assert 30.0 <= resumed.wall_s() < 40.0  # continues from step 3's wall_s
    resumed.log_step(_record(4))
    resumed.close()
    run = load_run(tmp_path)  # every reader skips superseded rows
    assert [r["step"] for r in run.steps] == [1, 2, 3, 4]
    assert [e["step"] for e in run.evals] == [1, 2, 3]
    assert supersede_jsonl(tmp_path / "metrics.jsonl", 4) == 0  # marked rows stay marked
    assert supersede_jsonl(tmp_path / "missing.jsonl", 1) == 0


def test_the_report_skips_rows_a_resume_superseded(tmp_path):
    """An old folder: a resume from step 100 appended 101.. after rows 101-134 of the first run."""
    steps = list(range(1, 135)) + list(range(101, 141))
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "tokens": s * 10, "wall_s": float(i), "loss": 1.0 / s}) + "\n"
            for i, s in enumerate(steps)
        )
    )
    (tmp_path / "eval.jsonl").write_text(
        "".join(json.dumps({"step": s, "val_loss": 1.0}) + "\n" for s in (25, 125, 100, 125))
    )
    run = load_run(tmp_path)
    assert [r["step"] for r in run.steps] == list(range(1, 141))
    tokens = [r["tokens"] for r in run.steps]
    assert tokens == sorted(tokens)  # the loss curve never jumps back
    assert [e["step"] for e in run.evals] == [25, 100, 125]
    assert latest_rows([{"step": 3}, {"step": 3}], keep_same_step=True) == [{"step": 3}] * 2


# ---------------------------------------------------------------------- real runs, pty and pipe

RAMP = [
    "--nproc",
    "1",
    "--max-steps",
    "6",
    "--policy",
    "ramp",
    "--seed",
    "1",
    "--set",
    "batch.initial=4",
    "--set",
    "batch.min=4",
    "--set",
    "batch.ramp_to=12",
    "--set",
    "batch.ramp_kind='stepwise'",
    "--set",
    "batch.ramp_samples=8",
    "--set",
    "batch.ramp_steps=2",
    "--set",
    "batch.warmup_steps=1",
    "--set",
    "batch.interval_steps=1",
    "--set",
    "data.max_chars=60000",
    "--set",
    "eval.interval_steps=2",
    "--set",
    "eval.num_samples=4",
    "--set",
    "checkpoint.interval_steps=0",
    "--set",
    "log.tensorboard=false",
    "--set",
    "log.progress_interval_s=0",
]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}


def _under_pty(argv: list[str], cwd: Path, columns: int, timeout: float = 300) -> tuple[int, str]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(argv, cwd=cwd, env=_env(), stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    proc.wait(timeout=30)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def _check_lines(text: str, run_dir: Path) -> list[str]:
    """Every `copus:` line starts its own line (not glued to a bar); one line per decision."""
    lines = [
        re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", part).rsplit("\r", 1)[-1]
        for part in text.replace("\r\n", "\n").split("\n")
    ]
    for raw in text.replace("\r\n", "\n").split("\n"):
        if "copus: " in raw:
            shown = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", raw).rsplit("\r", 1)[-1]
            assert shown.startswith("copus"), repr(raw)
    applied = [d for d in _rows(run_dir / "decisions.jsonl") if d.get("applied")]
    assert applied, "the ramp made no decision"
    for d in applied:
        said = [x for x in lines if x.startswith(f"copus: step {d['step']}: ") and " -> " in x]
        assert len(said) == 1, (d["step"], said)
    assert not any(" → " in x for x in lines)  # the old second decision line
    vals = [x for x in lines if re.fullmatch(r"copus: step \d+: val_loss \d+\.\d{4}", x)]
    assert [int(x.split()[2].rstrip(":")) for x in vals] == [2, 4, 6]
    return lines


@pytest.mark.slow
def test_console_under_a_pty_draws_the_bar_with_lines_above_it(tmp_path):
    run_dir = tmp_path / "run"
    code, text = _under_pty(
        [sys.executable, "-m", "copus", "train", "--run-dir", str(run_dir), *RAMP], tmp_path, columns=100
    )
    assert code == 0, text[-3000:]
    assert "%|" in text and "step" in text  # tqdm drew its bar
    lines = _check_lines(text, run_dir)
    assert not any(x.startswith("copus: step 1, ") for x in lines)  # the bar, no plain lines


@pytest.mark.parametrize("columns,usable", [(0, False), (100, True)])
def test_a_terminal_reporting_0_columns_gets_plain_lines_not_a_bar(monkeypatch, columns, usable):
    from copus.runtime.state import metrics

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    with os.fdopen(slave, "w") as fake_stderr:
        monkeypatch.setattr(sys, "stderr", fake_stderr)
        assert metrics.usable_terminal() is usable
    os.close(master)
