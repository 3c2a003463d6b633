import json
import subprocess
import sys

import pytest

from copus.reporting.runs import first_time_below, load_run, plan_segments


def _fake_run(path, policy, switch_at=None):
    path.mkdir()
    (path / "config.toml").write_text(f'[batch]\npolicy = "{policy}"\n')
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, 21):
            dp, pp = (4, 1) if switch_at is None or step < switch_at else (2, 2)
            row = dict(
                step=step,
                samples=8 * step,
                tokens=1024 * step,
                wall_s=0.5 * step,
                step_s=0.5,
                loss=5.0 - 0.1 * step,
                lr=1e-3,
                global_batch_size=8 if step < 10 else 16,
                micro_batch_size=2,
                dp=dp,
                tp=1,
                pp=pp,
                grad_sqnorm=1.0,
                grad_trace_cov=None,
                b_noise=10.0 + step,
                tokens_per_s=2048.0,
            )
            f.write(json.dumps(row) + "\n")
        f.write('{"step": 21, "trunc')  # a crash mid-write must not break the report
    with open(path / "eval.jsonl", "w") as f:
        for step in (5, 10, 15, 20):
            f.write(
                json.dumps(dict(step=step, tokens=1024 * step, wall_s=0.5 * step, val_loss=5.0 - 0.1 * step)) + "\n"
            )
    (path / "decisions.jsonl").write_text(
        json.dumps(dict(step=10, kind="batch", dp=4, tp=1, pp=1, global_batch_size=16, reason="test")) + "\n"
    )


def test_load_and_segments(tmp_path):
    _fake_run(tmp_path / "a", "goodput", switch_at=12)
    run = load_run(tmp_path / "a")
    assert run.policy == "goodput" and len(run.steps) == 20  # truncated line ignored
    assert [s[2] for s in plan_segments(run)] == ["dp4.tp1.pp1", "dp2.tp1.pp2"]
    assert first_time_below([1, 2, 3], [5, 4, 3], 4.0) == 2


def test_missing_run_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_run(tmp_path / "nope")


def test_report_cli_writes_plots_and_table(tmp_path):
    _fake_run(tmp_path / "a", "goodput", switch_at=12)
    _fake_run(tmp_path / "b", "constant")
    out = tmp_path / "rep"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "copus",
            "report",
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--out",
            str(out),
            "--targets",
            "4.0,3.5",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(
        [
            "loss_vs_time.png",
            "loss_vs_tokens.png",
            "batch_vs_tokens.png",
            "bnoise_vs_tokens.png",
            "plan_timeline.png",
            "tokens_per_s.png",
        ]
    )
    assert all((out / p).stat().st_size > 5000 for p in pngs)
    md = (out / "summary.md").read_text()
    assert "| a | goodput | 20 |" in md and "dp4.tp1.pp1 -> dp2.tp1.pp2" in md
    assert "| 5.0 | 7.5 |" in md  # val loss reaches 4.0 at step 10 (5.0 s), 3.5 at step 15 (7.5 s)
    res = subprocess.run(
        [sys.executable, "-m", "copus", "report", str(tmp_path / "zzz")], capture_output=True, text=True
    )
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr


def test_report_shows_probes_and_calibration(tmp_path):
    from copus.reporting.report import write_report

    _fake_run(tmp_path / "a", "goodput")
    probe = dict(
        step=10,
        tokens=10240,
        base_batch=8,
        b_noise_online=12.0,
        b_noise_fit=30.0,
        measured_c=2.5,
        c_used=2.5,
        chosen_batch=16,
        cost_s=4.2,
        cost_tokens=4096,
        branches=[dict(global_batch_size=b) for b in (8, 16, 32)],
    )
    with open(tmp_path / "a" / "decisions.jsonl", "a") as f:
        f.write(
            json.dumps(dict(step=10, kind="batch", dp=4, tp=1, pp=1, global_batch_size=16, reason="probe", probe=probe))
            + "\n"
        )
    cal = tmp_path / "a" / "calibration"
    cal.mkdir()
    (cal / "calibration.json").write_text(json.dumps({"command": "copus calibrate a"}))
    (cal / "calibration.md").write_text("| step | c |\n|---|---|\n| 50 | 0.77 |\n")
    text = write_report([load_run(tmp_path / "a")], tmp_path / "out", []).read_text()
    assert "## Calibration of a" in text
    assert "| 10 | 10240 | 8 | 8,16,32 | 12 | 30 | 2.5 | 2.5 | 16 | 4.2 | 4096 |" in text
    assert "`copus calibrate a`" in text and "| 50 | 0.77 |" in text


def test_report_without_calibration_has_no_section(tmp_path):
    from copus.reporting.report import write_report

    _fake_run(tmp_path / "a", "goodput")
    assert "Calibration" not in write_report([load_run(tmp_path / "a")], tmp_path / "o", []).read_text()
