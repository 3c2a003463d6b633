"""The README's commands end to end through the installed console script (`copus` next to
sys.executable), as a user runs them: one tiny 2-rank training run shared by the module (its
run folder and its piped console output are checked), then `copus calibrate` and `copus report`
on it, `copus prepare`, `copus simulate --preset all` as written, and a
README command with a misspelt flag. Assertions are on the files the commands write.

Other README commands are run end to end elsewhere; tests/test_readme.py lists which test runs
each one, and fails when the README gains a command no test runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RAMP = [
    "--nproc",
    "2",
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
    "checkpoint.interval_steps=4",
    "--set",
    "log.tensorboard=false",
    "--set",
    "log.progress_interval_s=0",
]


def copus_script() -> Path:
    """The console script pip installed with this interpreter (pyproject's [project.scripts])."""
    script = Path(sys.executable).parent / "copus"
    assert script.is_file(), f"{script}: no console script; install with pip install -e ."
    return script


def copus(*argv: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}  # this tree, even if installed elsewhere
    return subprocess.run(
        [str(copus_script()), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`copus train` on 2 ranks, piped: 6 steps of a stepwise ramp 4 -> 8 -> 12, evaluation every
    2 steps, checkpoints at steps 4 and 6, plain progress lines (one run for the module)."""
    root = tmp_path_factory.mktemp("e2e")
    run_dir = root / "run"
    out = copus("train", "--run-dir", str(run_dir), *RAMP, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, out


@pytest.mark.slow
def test_train_writes_the_run_folder(trained):
    run_dir, _ = trained
    lines = _rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in lines] == list(range(1, 7))
    for key in (
        "step",
        "samples",
        "tokens",
        "loss",
        "lr",
        "step_s",
        "global_batch_size",
        "micro_batch_size",
        "dp",
        "tp",
        "pp",
        "b_noise",
        "grad_sqnorm",
        "grad_trace_cov",
        "small_sqnorm",
        "big_sqnorm",
    ):
        assert key in lines[0], key
    assert all(m["loss"] > 0 for m in lines)
    assert [m["global_batch_size"] for m in lines] == [4, 8, 12, 12, 12, 12]
    assert [m["samples"] for m in lines] == [4, 12, 24, 36, 48, 60]  # every sample once
    assert all(m["dp"] == 2 for m in lines)
    assert [e["step"] for e in _rows(run_dir / "eval.jsonl")] == [2, 4, 6]
    assert "[model]" in (run_dir / "config.toml").read_text()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-4", "step-6"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6


@pytest.mark.slow
def test_train_piped_prints_plain_progress_and_one_line_per_decision(trained):
    from tests.runtime.test_console import _check_lines

    run_dir, out = trained
    assert "%|" not in out.stderr  # no bar without a terminal
    lines = _check_lines(out.stdout + out.stderr, run_dir)  # one line per decision, val lines
    assert sum(x.startswith("copus: step ") and " tokens (" in x for x in lines) == 6


@pytest.mark.slow
def test_calibrate_branches_each_checkpoint_and_writes_its_table(trained):
    """The command that crashed with an ImportError once: two checkpoints, k = 1, 2, one repeat."""
    run_dir, _ = trained
    out = copus(
        "calibrate",
        str(run_dir),
        "--steps",
        "4,6",
        "--multipliers",
        "1,2",
        "--tokens",
        "2048",
        "--repeats",
        "1",
        "--epsilon",
        "0.05",
        cwd=run_dir.parent,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    cal = run_dir / "calibration"
    result = json.loads((cal / "calibration.json").read_text())
    assert result["command"].startswith("copus calibrate ")
    rows = result["checkpoints"]
    assert [r["step"] for r in rows] == [4, 6]
    # 2 checkpoints x 2 branches (B = 12, 24) x 24 samples (2,048 tokens rounded up to whole
    # steps of the largest branch) x 128 tokens
    assert result["cost"]["tokens"] == 2 * 2 * 24 * 128
    md = (cal / "calibration.md").read_text()
    assert md.splitlines()[0].startswith("| step | tokens | B | critical batch")
    assert "| 4 | 4,608 | 12 |" in md and "| 6 | 7,680 | 12 |" in md
    assert "| step | B=12 | B=24 |" in md
    assert (cal / "calibration.png").stat().st_size > 5000


@pytest.mark.slow
def test_report_on_a_trained_run_writes_plots_and_table(trained, tmp_path):
    run_dir, _ = trained
    out = copus("report", str(run_dir), "--out", str(tmp_path / "report"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    md = (tmp_path / "report" / "summary.md").read_text()
    assert "| run | ramp | 6 |" in md
    pngs = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert "loss_vs_time.png" in pngs and "plan_timeline.png" in pngs


def test_simulate_preset_all_as_the_readme_writes_it(tmp_path):
    """It writes no file: the table on stdout, one summary row per COPUS cluster with the
    published, simulated and oracle speed-ups."""
    out = copus("simulate", "--preset", "all", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = next(i for i, x in enumerate(lines) if x.startswith("config") and "published" in x)
    rows = [x.split() for x in lines[header + 1 : header + 5]]
    assert [r[0] for r in rows] == ["3b-8xh100", "13b-16xh100", "32b-32xh100", "7b-32xmi210"]
    assert [r[2] for r in rows] == ["+7.9%", "+3.9%", "+8.0%", "+5.0%"]  # COPUS Table 1, averaged
    assert all(len(r) == 6 and all(c.endswith("%") for c in r[2:]) for r in rows)


def test_print_config_prints_toml_that_loads_and_starts_nothing(tmp_path):
    import tomllib

    out = copus("train", "--print-config", "--set", "batch.initial=16", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    config = tomllib.loads(out.stdout)
    assert config["batch"]["initial"] == 16 and config["model"]["name"] == "tiny"
    assert config["batch"]["policy"] == "goodput" and config["gns"]["calibration"] == "auto"
    assert list(tmp_path.iterdir()) == []  # no run folder, no workers


def test_prepare_writes_verified_token_shards(tmp_path):
    text = "".join(f"Document {i}: " + "the quick brown fox. " * 200 + "\n\n" for i in range(40))
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": f"note {i} " * 50}) + "\n" for i in range(30)))
    out = copus("prepare", "a.txt", "b.jsonl", "--out", "prepared", "--no-progress", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "train with --set data.source=prepared" in out.stdout
    folder = tmp_path / "prepared"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["tokenizer"]["spec"] == "byte" and meta["dtype"] == "uint16"
    assert meta["splits"]["train"]["num_docs"] + meta["splits"]["val"]["num_docs"] >= 2
    shards = json.loads((folder / "index.json").read_text())["shards"]
    assert {s["split"] for s in shards} == {"train", "val"}
    for s in shards:  # uint16 tokens: 2 bytes each
        assert (folder / s["file"]).stat().st_size == s["bytes"] == 2 * s["num_tokens"] > 0


def test_a_readme_command_with_a_wrong_flag_is_one_line_and_exit_2(tmp_path):
    out = copus(
        "plan", "--model", "llama-3.2-3b", "--gpu", "8", "--hardwre", "h100-nvlink-pairs", cwd=tmp_path, timeout=60
    )
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("copus plan: error:") and "--hardwre" in lines[0], out.stderr
