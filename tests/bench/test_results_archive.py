"""Committed bench results stay reproducible without committed run folders: the time-to-target
runs live in one archive, and the command recorded in the result JSON, run on the extracted
archive, writes the committed table again (bench/results/time_to_target_runs.tar.gz)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def _files_only(members: list[tarfile.TarInfo]) -> list[tarfile.TarInfo]:
    assert all(m.isfile() or m.isdir() for m in members), "links or devices in the archive"
    assert all(m.name.startswith("bench/results/") and ".." not in m.name for m in members)
    return members


@pytest.mark.parametrize("result", ["time_to_target_long", "time_to_target_auto"])
def test_the_recorded_command_on_the_archive_rewrites_the_committed_table(tmp_path, result):
    with tarfile.open(RESULTS / "time_to_target_runs.tar.gz") as tar:
        tar.extractall(tmp_path, members=_files_only(tar.getmembers()), filter="data")
    argv = shlex.split(json.loads((RESULTS / f"{result}.json").read_text())["command"])
    assert argv[:2] == ["python", "bench/time_to_target.py"] and "--from" in argv
    out = tmp_path / f"{result}.json"
    argv = [str(ROOT / a) if a.startswith("bench/results/time_to_target_long_profile") else a for a in argv[2:]]
    argv[argv.index("--out") + 1] = str(out)
    if "--plot" in argv:
        del argv[argv.index("--plot") : argv.index("--plot") + 2]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "time_to_target.py"), *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert out.with_suffix(".md").read_text() == (RESULTS / f"{result}.md").read_text()
    fresh, committed = json.loads(out.read_text()), json.loads((RESULTS / f"{result}.json").read_text())
    assert fresh["replay_time_to_target_s"] == committed["replay_time_to_target_s"]


def test_no_run_folders_are_committed():
    listed = subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")  # an sdist or a copied tree: nothing to check
    names = listed.stdout.split()
    assert not [n for n in names if n.endswith(("metrics.jsonl", "eval.jsonl", "decisions.jsonl"))]
