"""The stall dump: a phase that outlives its limit leaves every thread's stack in the log."""

from __future__ import annotations

import time

from copus.runtime.train.watchdog import stall_dump


def _stuck_in_a_collective() -> None:
    time.sleep(1.5)


def test_a_stalled_phase_dumps_where_it_waits_and_a_quick_one_dumps_nothing(tmp_path):
    log = tmp_path / "stderr.txt"
    with open(log, "w") as f:
        with stall_dump(2.0, file=f):
            pass
        time.sleep(2.5)  # past the limit, but the quick phase disarmed it
        assert log.read_text() == ""
        with stall_dump(0.2, file=f):
            _stuck_in_a_collective()
    text = log.read_text()
    assert "_stuck_in_a_collective" in text and "test_watchdog.py" in text
