"""Where a stalled rank waits: every thread's Python stack on stderr when a training-loop phase
runs far longer than it should (a collective that some rank never joins waits silently until the
process group's timeout, 30 min by default)."""

from __future__ import annotations

import faulthandler
import io
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

STALL_DUMP_S = 900.0  # a step or a layout switch this long is a hang on any scale copus runs at


@contextmanager
def stall_dump(seconds: float = STALL_DUMP_S, file: TextIO | None = None) -> Iterator[None]:
    """Run the block; if it is still running after `seconds`, write every thread's stack to
    `file` (default the process's stderr), again every `seconds` until it ends. Nothing is
    stopped: the dump only shows which collective each rank sits in. A no-op where the stream
    has no file descriptor (e.g. captured output)."""
    out = file if file is not None else sys.__stderr__
    try:
        faulthandler.dump_traceback_later(seconds, repeat=True, file=out)
    except (AttributeError, ValueError, RuntimeError, io.UnsupportedOperation):
        yield
        return
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
