"""Plans that ran out of device memory in this run: recorded once, never chosen again.

    <run_dir>/infeasible.jsonl   one line per out-of-memory event: the plan, the step, the rank,
                                 the elastic generation (TORCHELASTIC_RESTART_COUNT), the message
    <run_dir>/oom-stop           the generation that must stop now (read by `OomWatch`)

An out-of-memory error on one rank leaves its peers blocked in a collective (FSDP2's
reduce-scatter, the statistics all-reduce) that never completes; on NCCL a blocked peer runs no
Python code until the collective's timeout (train.nccl_timeout_s). So the failing rank appends
the record, writes `oom-stop`, prints one line and exits; every rank runs a daemon thread
(`OomWatch`) that polls `oom-stop` every `POLL_S` and ends its process when the marker names its
own generation: all ranks stop within about a second (the run folder is shared, as for
checkpoints and `stop-request`). The elastic agent then restarts the workers (or reports the
failure), and a resumed run never picks the plan again (`covers`, `fallback_plan`, and the
goodput controller's `forbid`).

Which plans one event rules out (`covers`): the same (dp, tp, pp), a micro-batch at least as
large, and at least min(num_microbatches, 2) micro-batches (from 2 on, FSDP2 keeps an
unsharded fp32 gradient across the accumulation, so 1 micro-batch can fit where 2 do not).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from copus.core.plan.plan import ParallelPlan

RECORD_FILE = "infeasible.jsonl"
STOP_FILE = "oom-stop"
EXIT_CODE = 3  # the process's exit status after an out-of-memory stop
POLL_S = 0.25

_FIELDS = ("dp", "tp", "pp", "micro_batch_size", "num_microbatches")


def generation(env: dict[str, str] | None = None) -> int:
    """The elastic launcher's restart count (0 outside one): one value per worker generation."""
    return int((os.environ if env is None else env).get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def record(run_dir: str | Path, plan: ParallelPlan, *, step: int, rank: int, message: str) -> dict[str, Any]:
    """Append the event (one short line: O_APPEND keeps concurrent writers' lines whole) and
    write the stop marker for this generation. Returns the row."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    row = {
        "plan": {f: getattr(plan, f) for f in _FIELDS},
        "step": step,
        "rank": rank,
        "generation": generation(),
        "error": message.splitlines()[0][:300] if message else "",
    }
    with open(run_dir / RECORD_FILE, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    tmp = run_dir / f".{STOP_FILE}.{os.getpid()}.tmp"
    tmp.write_text(f"{row['generation']}\n", encoding="utf-8")
    os.replace(tmp, run_dir / STOP_FILE)
    return row


def load(run_dir: str | Path) -> list[ParallelPlan]:
    """The plans recorded as out of memory in this run folder (unreadable lines skipped)."""
    plans = []
    try:
        lines = (Path(run_dir) / RECORD_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            plans.append(ParallelPlan(**{f: int(json.loads(line)["plan"][f]) for f in _FIELDS}))
        except (ValueError, KeyError, TypeError):
            continue
    return plans


def covers(bad: ParallelPlan, plan: ParallelPlan) -> bool:
    """Whether the out-of-memory event of `bad` rules out `plan` (module docstring)."""
    return (
        plan.layout == bad.layout
        and plan.micro_batch_size >= bad.micro_batch_size
        and plan.num_microbatches >= min(bad.num_microbatches, 2)
    )


def is_infeasible(plan: ParallelPlan, bad: Iterable[ParallelPlan]) -> bool:
    return any(covers(b, plan) for b in bad)


def fallback_plan(plan: ParallelPlan, bad: list[ParallelPlan]) -> ParallelPlan | None:
    """`plan` itself if no event covers it, else the same layout and global batch with the
    largest smaller micro-batch (more micro-batches) that none covers; None if there is none."""
    if not is_infeasible(plan, bad):
        return plan
    local = plan.micro_batch_size * plan.num_microbatches
    for mbs in range(plan.micro_batch_size - 1, 0, -1):
        if local % mbs:
            continue
        cand = ParallelPlan(dp=plan.dp, tp=plan.tp, pp=plan.pp, micro_batch_size=mbs, num_microbatches=local // mbs)
        if not is_infeasible(cand, bad):
            return cand
    return None


class OomWatch:
    """Daemon thread: ends this process (exit status `EXIT_CODE`) once `<run_dir>/oom-stop`
    names this generation. Started by every rank of a multi-rank run."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        self.path = Path(run_dir) / STOP_FILE
        self.rank, self.generation = rank, generation()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="copus-oom-watch", daemon=True)

    def start(self) -> OomWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def due(self) -> bool:
        """Whether the marker names this generation."""
        try:
            return int(self.path.read_text().strip() or -1) == self.generation
        except (OSError, ValueError):
            return False

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.due():
                sys.stderr.write(
                    f"copus: rank {self.rank}: stopping, another rank ran out of "
                    f"device memory (see {self.path.parent / RECORD_FILE})\n"
                )
                sys.stderr.flush()
                os._exit(EXIT_CODE)
