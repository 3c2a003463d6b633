"""kill -9 during `copus train`: the short version of bench/faults.py, plus its bookkeeping.

The accounting functions are tested on hand-made metrics (a correct restart, a restart that lost
or repeated samples, a loss that changed on the redo); then two real trials run: a worker killed
mid-step and one killed mid-checkpoint-save, each of which must survive with no sample lost or
repeated, bit-identical redone losses and no corrupt checkpoint.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "faults.py"


def _load():
    spec = importlib.util.spec_from_file_location("copus_bench_faults", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


faults = _load()


def _row(step: int, samples: int, B: int = 8, loss: float | None = None, dp: int = 2) -> dict:
    return {
        "step": step,
        "samples": samples,
        "global_batch_size": B,
        "dp": dp,
        "tp": 1,
        "pp": 1,
        "micro_batch_size": B // dp,
        "num_microbatches": 1,
        "loss": 5.0 - step / 10 if loss is None else loss,
    }


def test_accounting_of_a_correct_restart():
    """Steps 1-5, killed, resumed from the step-3 checkpoint: 4 and 5 redone, then 6."""
    first = [_row(s, 8 * s) for s in range(1, 6)]
    second = [_row(s, 8 * s) for s in range(4, 7)]
    rows = first + second
    assert [len(a) for a in faults.attempts(rows)] == [5, 3]
    traj = faults.trajectory(rows)
    assert sorted(traj) == [1, 2, 3, 4, 5, 6]
    assert faults.sample_accounting(traj) == (0, 0)
    assert faults.loss_continuity(rows) == (2, 0, 0.0)


def test_accounting_catches_lost_and_repeated_samples_and_changed_losses():
    first = [_row(s, 8 * s) for s in range(1, 6)]
    skipped = [_row(4, 8 * 4 + 8), _row(5, 8 * 5 + 8)]  # resumed 8 samples too far
    assert faults.sample_accounting(faults.trajectory(first[:3] + skipped)) == (8, 0)
    again = [_row(4, 8 * 4 - 8), _row(5, 8 * 5 - 8)]  # resumed 8 samples too early
    assert faults.sample_accounting(faults.trajectory(first[:3] + again)) == (0, 8)
    changed = [_row(4, 32, loss=1.0), _row(5, 40)]
    compared, mismatches, worst = faults.loss_continuity(first + changed)
    assert (compared, mismatches) == (2, 1) and worst == pytest.approx(3.6)
    other_plan = [_row(4, 32, dp=1, loss=1.0)]  # another plan: not compared
    assert faults.loss_continuity(first + other_plan)[:2] == (0, 0)


@pytest.mark.slow
def test_kill_9_mid_step_and_mid_checkpoint_loses_nothing(tmp_path):
    report = faults.run_trials(2, 8, seed=0, root=tmp_path, echo=False)
    s, trials = report["summary"], report["trials"]
    assert [t["phase"] for t in trials] == ["step", "checkpoint"]
    for t in trials:
        detail = (tmp_path / f"trial-{t['trial']:02d}.log").read_text()[-3000:]
        assert t["killed"], t
        assert t["survived"], (t, detail)
        assert t["resume_ok"], t
        assert t["samples_lost"] == 0 and t["samples_repeated"] == 0, t
        assert t["checkpoint_offsets_ok"], t
        assert t["loss_mismatches"] == 0, t
        assert t["corrupt_checkpoints"] == 0, t
    assert s["survived"] == 2


@pytest.mark.slow
def test_kill_9_inside_an_in_process_switch_loses_nothing_and_leaks_no_staging(tmp_path):
    """The layout map switches pp2 -> dp2 at a known step by the direct path (shards move in
    memory); the kill lands as soon as the trainer logged the switch's start, and is confirmed
    inside it (the result line never came); the restarted run resumes from the last checkpoint,
    switches again and completes with nothing lost or repeated."""
    report = faults.run_trials(1, 9, seed=0, root=tmp_path, echo=False, phases=("reconfigure",), switch_delay_s=0.0)
    t = report["trials"][0]
    detail = (tmp_path / "trial-00.log").read_text()[-3000:]
    assert t["phase"] == "reconfigure" and t["killed"] and t["confirmed"], (t, detail)
    assert t["switch_path"] == "direct", t
    assert t["survived"] and t["resume_ok"], (t, detail)
    assert t["samples_lost"] == 0 and t["samples_repeated"] == 0, t
    assert t["checkpoint_offsets_ok"] and t["loss_mismatches"] == 0, t
    assert t["corrupt_checkpoints"] == 0, t
    assert t["leaked_staging"] == [], t  # the restarted trainer removed it
    assert "(2, 1, 1, " in "".join(t["plans"]) and "(1, 1, 2, " in "".join(t["plans"])
