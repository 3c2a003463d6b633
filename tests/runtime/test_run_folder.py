"""One run per folder (runtime/state/run_folder.py): what `copus train --run-dir` refuses, with one
line and exit 2, before any worker starts; and the plain helpers behind it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from copus.runtime.state.run_folder import check_run_dir, read_state, write_state


def test_new_empty_and_same_elastic_run_folders_are_accepted(tmp_path):
    check_run_dir(tmp_path / "new", resume=False)
    (tmp_path / "empty").mkdir()
    check_run_dir(tmp_path / "empty", resume=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    write_state(mine, "running", run_id="job-7")
    check_run_dir(mine, resume=False, run_id="job-7")  # torchrun restarted the command
    with pytest.raises(ValueError, match="holds a running or crashed run"):
        check_run_dir(mine, resume=False, run_id="job-8")


@pytest.mark.parametrize(
    "content,needle",
    [
        (
            {"run.json": '{"state": "finished", "step": 400}', "metrics.jsonl": "{}\n"},
            "holds a finished run (step 400); allowed: --resume to continue it, or a new or empty",
        ),
        ({"run.json": '{"state": "stopped", "step": 51}'}, "holds a stopped run (step 51)"),
        ({"metrics.jsonl": '{"step": 1}\n'}, "holds a copus run; allowed: --resume"),
        ({"notes.txt": "mine"}, "is not empty and holds no copus run"),
    ],
)
def test_a_used_or_foreign_folder_is_refused_without_resume(tmp_path, content, needle):
    for name, text in content.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_run_dir(tmp_path, resume=False)


def test_resume_needs_checkpoints_and_a_file_is_never_a_run_folder(tmp_path):
    with pytest.raises(ValueError, match="has no checkpoints/ folder"):
        check_run_dir(tmp_path, resume=True)
    (tmp_path / "checkpoints").mkdir()
    check_run_dir(tmp_path, resume=True)
    f = tmp_path / "file.txt"
    f.write_text("x")
    for resume in (False, True):
        with pytest.raises(ValueError, match="is an existing file, not a folder"):
            check_run_dir(f, resume=resume)


def test_state_file_is_replaced_atomically_and_keeps_other_keys(tmp_path):
    write_state(tmp_path, "running", run_id=None)
    write_state(tmp_path, "stopped", step=5, checkpoint="step-5")
    assert read_state(tmp_path) == {"state": "stopped", "step": 5, "checkpoint": "step-5", "run_id": None}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
    (tmp_path / "run.json").write_text("{cut")
    assert read_state(tmp_path) == {}


def _train(*argv: str, cwd: Path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    return subprocess.run(
        [sys.executable, "-m", "copus", "train", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_cli_refuses_with_one_line_and_touches_nothing(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("keep me")
    done = tmp_path / "done"
    done.mkdir()
    (done / "run.json").write_text(json.dumps({"state": "finished", "step": 9}))
    (done / "metrics.jsonl").write_text('{"step": 9}\n')
    before = {p.name: p.read_bytes() for p in done.iterdir()}
    for run_dir, needle in ((f, "is an existing file"), (done, "holds a finished run (step 9)")):
        out = _train("--nproc", "2", "--max-steps", "2", "--run-dir", str(run_dir), cwd=tmp_path)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr
        assert lines[0].startswith("copus train: error: --run-dir") and needle in lines[0]
    assert f.read_text() == "keep me"
    assert {p.name: p.read_bytes() for p in done.iterdir()} == before
