"""`batch.schedule` in a real 2-process `copus train` (CPU, gloo, the tiny model).

The schedule "0:8,4K:16,8K:32" (tokens, K = 1000: seq_len 128, so B=8 is 1024 tokens a step)
must move the batch to 16 on the first step after 4000 tokens and to 32 after 8000, and a run resumed from a
checkpoint taken mid-schedule must land on the same batches at the same token counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

COMMON = (
    "--nproc",
    "2",
    "--policy",
    "schedule",
    "--set",
    "batch.schedule=0:8,4K:16,8K:32",
    "--set",
    "batch.max=64",
    "--set",
    "data.max_chars=200000",
    "--set",
    "eval.interval_steps=0",
    "--set",
    "log.progress=false",
    "--set",
    "log.tensorboard=false",
)


def _train(*argv: str, cwd: Path):
    return subprocess.run(
        [sys.executable, "-m", "copus", "train", *COMMON, *argv], cwd=cwd, capture_output=True, text=True, timeout=400
    )


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _expected(tokens_before: int) -> int:
    """The schedule's batch for a step that starts after `tokens_before` tokens."""
    return 8 if tokens_before < 4000 else 16 if tokens_before < 8000 else 32


@pytest.mark.slow
def test_schedule_changes_the_batch_at_the_token_count_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    out = _train("--max-steps", "4", "--run-dir", str(run_dir), "--set", "checkpoint.interval_steps=4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    out = _train(
        "--max-steps", "8", "--run-dir", str(run_dir), "--resume", "--set", "checkpoint.interval_steps=4", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    before = 0
    for r in rows:  # each step's batch is the schedule's at its starting tokens
        assert r["global_batch_size"] == _expected(before), (r["step"], before)
        assert r["dp"] == 2
        before = r["tokens"]
    # 4 steps at 8 (4096 tokens), the resumed run starts at 16 and passes 8000 after 2 more
    assert [r["global_batch_size"] for r in rows] == [8, 8, 8, 8, 16, 16, 32, 32]
    text = (run_dir / "decisions.jsonl").read_text()
    assert "schedule 0:8,4K:16,8K:32 at 4096 tokens: B 8 -> 16" in text
    assert "at 8192 tokens: B 16 -> 32" in text
