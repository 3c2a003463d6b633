"""Graceful stop on SIGINT / SIGTERM (Ctrl-C, cluster preemption).

Worker side (`StopRequest`, installed by `launch.worker` on every rank):

1. The first SIGINT or SIGTERM only sets a flag. At every step boundary the ranks agree on it
   (`StopRequest.agreed`: one all-reduce MAX of the signal number, so a signal that reached any
   rank stops all of them at the same step).
2. The run then saves a checkpoint at that step (atomic, `checkpoint.save`), marks the run folder
   "stopped" (`run_folder`) and returns {"stopped": {...}}; `copus train` prints one line with
   the step and the resume command and exits 128 + signal (130 for SIGINT, 143 for SIGTERM).
3. A second signal ends the process at once (`os._exit(128 + signal)`). A save in progress is
   cut short in its `tmp-step-N` folder; the previous `step-N` is untouched (write, fsync,
   rename), so `--resume` continues from it.

A repeat of the same signal within `DUPLICATE_WINDOW_S` of the first is one signal delivered
twice (a terminal's Ctrl-C reaches every process of the foreground group, and a launcher forwards
it again), not a second request.

Launcher side (`SignalForwarder`, used by `launch._run_elastic`): torch's elastic agent would turn
the signal into a SignalException, send it to the workers again and SIGKILL them 30 s later. The
agent is told to leave SIGINT/SIGTERM alone (`signals_to_handle`); the forwarder passes the first
signal on as a file, `<run_dir>/stop-request` (holding the signal number), which every worker
checks at each step boundary (`StopRequest.watch`; one stat per step). A file, not a signal, so a
worker still importing torch, or restarted by the agent, cannot be killed by it before it
installed its handler, and sees it when it gets there. The workers left the terminal's process
group (`detach_worker`), so a Ctrl-C reaches them only this way. A second signal SIGKILLs them
and raises SignalException so the agent shuts down without restarting anyone.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

from copus.atomic import atomic_write_text

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_FILE = "stop-request"
DUPLICATE_WINDOW_S = 0.25
LAUNCHER_ENV = "COPUS_LOCAL_LAUNCHER"  # set by copus's own launcher for its workers
_PR_SET_PDEATHSIG = 1


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + signal number."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _write_stderr(text: str) -> None:
    """Async-signal-safe enough: one os.write, no buffered I/O inside a handler."""
    try:
        os.write(2, text.encode())
    except OSError:
        pass


class StopRequest:
    """This rank's pending stop: the first signal's number (0: none). Install on the main
    thread; `uninstall` restores the previous handlers."""

    def __init__(self) -> None:
        self.signum = 0
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}
        self._file: str | None = None

    def install(self) -> StopRequest:
        self.signum, self._file = 0, None
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def watch(self, run_dir: str | os.PathLike) -> StopRequest:
        """Also take a stop request from `<run_dir>/stop-request` (written by the launcher)."""
        self._file = os.path.join(run_dir, STOP_FILE)
        return self

    def pending(self) -> int:
        """This rank's request: the signal it received, else the launcher's file's, else 0."""
        if not self.signum and self._file is not None and os.path.exists(self._file):
            try:
                with open(self._file, encoding="utf-8") as fh:
                    self.signum = int(fh.read().strip() or signal.SIGTERM)
            except (OSError, ValueError):
                self.signum = int(signal.SIGTERM)
        return self.signum

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            if os.environ.get("RANK", "0") == "0":
                _write_stderr(
                    f"copus: {signal_name(signum)}: stopping after the current step "
                    "and saving a checkpoint (send it again to abort at once)\n"
                )
            return
        if signum == self.signum and now - self._first_at < DUPLICATE_WINDOW_S:
            return  # the same Ctrl-C delivered twice (terminal + launcher)
        _write_stderr(
            f"copus: second signal ({signal_name(signum)}): aborting now; the last complete checkpoint is kept\n"
        )
        os._exit(exit_code(self.signum))

    def agreed(self, device: Any = None) -> int:
        """The signal number any rank received (0: none); collective under a process group."""
        import torch
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.pending()
        flag = torch.tensor([self.pending()], dtype=torch.int64, device=device if device is not None else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def detach_worker() -> bool:
    """In a worker of copus's own launcher: leave the terminal's process group (Ctrl-C then
    reaches it only through the launcher, once) and die with the launcher (PR_SET_PDEATHSIG,
    Linux), so a SIGKILLed launcher leaves no orphans. Returns whether this is such a worker."""
    if os.environ.get(LAUNCHER_ENV) != "1":
        return False
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    return True


class SignalForwarder:
    """Launcher-side handler of SIGINT/SIGTERM while local workers run (see the module doc).
    Removes a stale `stop-request` on entry and the file on exit."""

    def __init__(self, run_dir: str | os.PathLike, graceful: bool = True) -> None:
        """`graceful`: the workers watch `stop-request` (the trainer); otherwise (e.g. `copus
        profile`'s workers) the first signal already aborts them."""
        self.graceful = graceful
        self.signum = self.second = 0
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}
        self.path = os.path.join(run_dir, STOP_FILE)

    def __enter__(self) -> SignalForwarder:
        self._remove()
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self._remove()

    def _remove(self) -> None:
        try:
            os.remove(self.path)
        except OSError:
            pass

    def _request(self, signum: int) -> None:
        """Write the stop request atomically (tmp + rename) for the workers to find."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        atomic_write_text(self.path, f"{int(signum)}\n", fsync=False)

    def _handle(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if not self.signum and self.graceful:
            self.signum, self._first_at = signum, now
            _write_stderr(
                f"copus: {signal_name(signum)}: stopping after the current step and "
                "saving a checkpoint (send it again to abort at once)\n"
            )
            self._request(signum)
            return
        if signum == self.signum and now - self._first_at < DUPLICATE_WINDOW_S:
            return  # one signal delivered twice (e.g. `timeout` signals child and group)
        if self.signum:
            self.second = signum
            _write_stderr(
                f"copus: second signal ({signal_name(signum)}): aborting the workers; "
                "the last complete checkpoint is kept\n"
            )
        else:
            self.signum = signum
            _write_stderr(f"copus: {signal_name(signum)}: stopping the workers\n")
        self._send(signal.SIGKILL)
        from torch.distributed.elastic.multiprocessing.api import SignalException

        raise SignalException(f"second signal {signal_name(signum)}", sigval=signal.Signals(self.signum))

    @staticmethod
    def _send(signum: int) -> None:
        for child in multiprocessing.active_children():
            try:
                os.kill(child.pid, signum)
            except (ProcessLookupError, TypeError):
                pass


# The request of this process (one trainer per process); `launch.worker` installs it.
request = StopRequest()


class Boundary:
    """What the ranks agree on at each step boundary, in one all-reduce MAX: a pending stop
    signal, and whether `checkpoint.interval_s` has passed since the last save on any rank."""

    def __init__(self, stop: StopRequest, interval_s: float) -> None:
        self.stop, self.interval_s = stop, float(interval_s)
        self.last_save_t = time.monotonic()
        self.saved_step: int | None = None

    def saved(self, step: int) -> None:
        """A checkpoint of `step` is on disk (any kind of save)."""
        self.last_save_t, self.saved_step = time.monotonic(), step

    def checkpoint_name(self) -> str | None:
        return None if self.saved_step is None else f"step-{self.saved_step}"

    def local(self) -> tuple[int, bool]:
        """This rank's view, no collective: (pending signal or 0, time-based checkpoint due).
        The trainer folds it into its end-of-step all-reduce (`Trainer.step_end`)."""
        due = self.interval_s > 0 and time.monotonic() - self.last_save_t >= self.interval_s
        return self.stop.pending(), due

    def poll(self, device: Any = None) -> tuple[int, bool]:
        """(signal number or 0, time-based checkpoint due); identical on every rank."""
        import torch
        import torch.distributed as dist

        signum, due = self.local()
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return signum, due
        flags = torch.tensor([signum, int(due)], dtype=torch.int64, device=device if device is not None else "cpu")
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signum, due = flags.tolist()
        return int(signum), bool(due)


def graceful_stop(trainer: Any, signum: int) -> dict:
    """Checkpoint the step the ranks stopped at (unless it is already saved), write the summary,
    mark the folder "stopped"; return the result with its "stopped" record (rank 0 prints it)."""
    from copus.runtime.state.checkpoint import CheckpointError

    p, boundary = trainer.progress, trainer.boundary
    error = None
    path = trainer.ckpt_dir / f"step-{p.step}"
    if boundary.saved_step != p.step:
        try:
            path = trainer.save_checkpoint()
        except CheckpointError as err:
            error, path = str(err), None
    result = trainer.finish()
    info = {
        "signal": signal_name(signum),
        "exit_code": exit_code(signum),
        "step": p.step,
        "tokens": p.tokens,
        "checkpoint": None if path is None else str(path),
        "error": error,
    }
    trainer.writer.set_state("stopped", step=p.step, checkpoint=None if path is None else path.name)
    return {**result, "stopped": info}


def stop_line(stopped: dict, run_dir: str, *, torchrun: bool = False) -> str:
    """The one line `copus train` prints for a stopped run."""
    from copus.runtime.state.run_folder import resume_command

    where = f"stopped by {stopped['signal']} at step {stopped['step']} ({stopped['tokens']:,} tokens)"
    if stopped.get("checkpoint") is None:
        return (
            f"{where}; checkpoint NOT saved ({stopped.get('error')}); resume from the "
            f"previous one: {resume_command(run_dir, torchrun=torchrun)}"
        )
    return f"{where}; checkpoint {stopped['checkpoint']}; resume: {resume_command(run_dir, torchrun=torchrun)}"
