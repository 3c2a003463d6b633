"""`copus profile` end to end on 2 gloo ranks (two layouts, one timed step each)."""

import csv
import json
import subprocess
import sys


def test_profile_writes_json_and_csv(tmp_path):
    out = tmp_path / "prof"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "copus",
            "profile",
            "--nproc",
            "2",
            "--global-batch",
            "4",
            "--micro-batch-sizes",
            "2",
            "--layouts",
            "2x1x1,1x1x2",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((out / "profile.json").read_text())
    assert {(r["dp"], r["tp"], r["pp"]) for r in rows} == {(2, 1, 1), (1, 1, 2)}
    for r in rows:
        assert r["global_batch_size"] == 4 and r["step_s"] > 0
        assert abs(r["samples_per_s"] - 4 / r["step_s"]) < 1e-6 * r["samples_per_s"]
        assert r["peak_memory_bytes"] > 1e6  # resident set of a worker: at least a megabyte
    assert rows[0]["samples_per_s"] >= rows[1]["samples_per_s"]  # fastest first
    with open(out / "profile.csv") as f:
        assert len(list(csv.DictReader(f))) == 2
    # the goodput run given a profile plans with it: a profile in which pp2 is 10x faster
    # than dp2 starts the run on pp2 (the model alone starts on dp2), and no profiled layout
    # is probed
    for r in rows:
        r["step_s"] *= 0.1 if r["pp"] == 2 else 10.0
    (tmp_path / "fast_pp2.json").write_text(json.dumps(rows))
    run = tmp_path / "run"
    res = subprocess.run(
        [
            *(sys.executable, "-m", "copus", "train", "--nproc", "2", "--max-tokens", "12000"),
            *("--run-dir", str(run), "--set", "batch.initial=4", "--set", "batch.min=4"),
            *("--set", "eval.interval_steps=0", "--set", f"controller.profile='{tmp_path / 'fast_pp2.json'}'"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    first = json.loads((run / "summary.json").read_text())["plan_timeline"][0]
    assert (first["step"], first["dp"], first["pp"]) == (1, 1, 2), first
    decisions = [json.loads(line) for line in (run / "decisions.jsonl").read_text().splitlines()]
    assert [r for r in decisions if r.get("event") == "considered"], decisions
    probes = [r for r in decisions if r.get("purpose") == "probe"]
    assert not [r for r in probes if (r["dp"], r["tp"], r["pp"]) in {(2, 1, 1), (1, 1, 2)}], probes


def test_profile_bad_arguments_exit_2(tmp_path):
    for argv in (["--global-batch", "0"], ["--layouts", "4x4"], ["--nproc", "2", "--layouts", "3x1x1"]):
        res = subprocess.run(
            [sys.executable, "-m", "copus", "profile", *argv, "--out", str(tmp_path / "x")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 2, (argv, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_profile_out_inside_a_file_fails_before_profiling(tmp_path):
    """An --out whose parent is a file used to crash with a traceback after all plans ran."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "copus",
            "profile",
            "--nproc",
            "2",
            "--global-batch",
            "4",
            "--micro-batch-sizes",
            "2",
            "--layouts",
            "2x1x1",
            "--out",
            str(blocker / "prof"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert "--out=" in res.stderr and "a file" in res.stderr and "Traceback" not in res.stderr
    assert "profiling" not in res.stdout  # nothing ran
    assert blocker.read_text() == "not a folder"
