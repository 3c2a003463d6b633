"""runtime/train/stop.py in one process: the first signal is a request, a duplicate delivery is
ignored, a second signal ends the process at once with 128 + the first signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from copus.runtime.train import stop


def test_first_signal_is_only_a_request_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    req = stop.StopRequest().install()
    try:
        assert req.agreed() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert req.signum == signal.SIGTERM and req.agreed() == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # the same signal again at once: a duplicate
        time.sleep(0.05)
        assert req.signum == signal.SIGTERM
    finally:
        req.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
    assert (stop.exit_code(signal.SIGINT), stop.exit_code(signal.SIGTERM)) == (130, 143)


def test_a_second_signal_exits_at_once_with_the_first_signals_code():
    src = str(Path(__file__).resolve().parents[2] / "src")
    code = textwrap.dedent("""
        import os, signal, time
        from copus.runtime.train.stop import StopRequest, DUPLICATE_WINDOW_S
        StopRequest().install()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(DUPLICATE_WINDOW_S + 0.1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        print("not aborted")
    """)
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**env, "PYTHONPATH": src}, timeout=60
    )
    assert out.returncode == 130 and "not aborted" not in out.stdout
    assert out.stderr.strip().splitlines() == [
        "copus: SIGINT: stopping after the current step and saving a checkpoint (send it again to abort at once)",
        "copus: second signal (SIGINT): aborting now; the last complete checkpoint is kept",
    ]


def test_the_stop_line_names_the_step_checkpoint_and_resume_command():
    line = stop.stop_line(
        {"signal": "SIGTERM", "step": 51, "tokens": 52224, "checkpoint": "runs/a/checkpoints/step-51"}, "runs/a"
    )
    assert line == (
        "stopped by SIGTERM at step 51 (52,224 tokens); checkpoint "
        "runs/a/checkpoints/step-51; resume: copus train --run-dir runs/a --resume"
    )
    failed = stop.stop_line(
        {"signal": "SIGINT", "step": 3, "tokens": 10, "checkpoint": None, "error": "disk full"}, "r"
    )
    assert "checkpoint NOT saved (disk full)" in failed


def test_the_time_based_checkpoint_comes_due_after_interval_s():
    b = stop.Boundary(stop.StopRequest(), interval_s=0.2)
    assert b.poll() == (0, False)
    time.sleep(0.25)
    assert b.poll() == (0, True)
    b.saved(7)
    assert b.poll() == (0, False) and b.checkpoint_name() == "step-7"
    assert stop.Boundary(stop.StopRequest(), interval_s=0).poll() == (0, False)


def test_the_launchers_request_file_reaches_a_watching_worker(tmp_path):
    req = stop.StopRequest().watch(tmp_path)
    assert req.pending() == 0
    with stop.SignalForwarder(tmp_path) as fwd:
        fwd._request(signal.SIGTERM)
        assert req.pending() == signal.SIGTERM
    assert not (tmp_path / stop.STOP_FILE).exists()  # removed when the launch ends
    (tmp_path / stop.STOP_FILE).write_text("2\n")  # stale, from a killed launcher
    with stop.SignalForwarder(tmp_path):
        assert not (tmp_path / stop.STOP_FILE).exists()


def test_the_forwarder_requests_once_then_aborts_and_profile_workers_abort_at_once(tmp_path):
    import pytest
    from torch.distributed.elastic.multiprocessing.api import SignalException

    with stop.SignalForwarder(tmp_path) as fwd:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert (tmp_path / stop.STOP_FILE).read_text() == f"{int(signal.SIGTERM)}\n"
        os.kill(os.getpid(), signal.SIGTERM)  # a duplicate delivery: ignored
        time.sleep(0.05)
        with pytest.raises(SignalException):
            os.kill(os.getpid(), signal.SIGINT)  # a second signal: abort
            time.sleep(1)
        assert (fwd.signum, fwd.second) == (signal.SIGTERM, signal.SIGINT)
    with stop.SignalForwarder(tmp_path, graceful=False) as fwd:
        with pytest.raises(SignalException):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert not (tmp_path / stop.STOP_FILE).exists()
