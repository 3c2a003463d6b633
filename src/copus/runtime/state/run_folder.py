"""One run per folder: what `copus train --run-dir DIR` accepts, and the folder's state file.

    <run_dir>/run.json   {"state": "running" | "stopped" | "finished", "step": N,
                          "run_id": elastic run id or null, "checkpoint": "step-N" | null}

Rules (checked by `check_run_dir` before any worker starts; a refusal is one line, exit 2):

- a path that exists and is not a folder is refused;
- without --resume the folder must be new or empty, or hold the run of the same elastic run id
  (a torchrun restart or membership change re-runs the command in its own folder). A folder
  holding another copus run (finished, stopped or crashed) is refused: appending a second run
  would mix two runs' metrics; a non-empty folder that is not a copus run is refused too;
- with --resume the folder must hold checkpoints/ (the trainer then picks the latest good one).

Pure (no torch): `copus train` calls it before importing the runtime.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from copus.atomic import atomic_write_json

STATE_FILE = "run.json"
RUN_FILES = (STATE_FILE, "config.toml", "metrics.jsonl", "checkpoints")
ALLOWED = "a new or empty folder, or --resume to continue the run in it"


def read_state(run_dir: str | Path) -> dict[str, Any]:
    """run.json as a dict ({} if missing or unreadable)."""
    try:
        data = json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_state(run_dir: str | Path, state: str, **info: Any) -> None:
    """Replace run.json atomically (write, fsync, rename), keeping keys not given."""
    run_dir = Path(run_dir)
    data = {**read_state(run_dir), **info, "state": state}
    atomic_write_json(run_dir / STATE_FILE, data)


def describe(run_dir: Path) -> str:
    """What the folder holds, for a refusal: 'a finished run (step 400)' etc."""
    state = read_state(run_dir)
    if not state:
        return "a copus run"
    step = f" (step {state['step']})" if isinstance(state.get("step"), int) else ""
    name = {"running": "a running or crashed run"}.get(state.get("state"), f"a {state.get('state')} run")
    return f"{name}{step}"


def check_run_dir(run_dir: str | Path, *, resume: bool, run_id: str | None = None) -> None:
    """ValueError (one line: the bad value and what is allowed) unless `run_dir` may be used."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--run-dir {path}: is an existing file, not a folder; allowed: {ALLOWED}")
    if resume:
        if not (path / "checkpoints").is_dir():
            raise ValueError(f"--resume: {path} has no checkpoints/ folder")
        return
    if not path.exists() or not any(path.iterdir()):
        return
    if any((path / name).exists() for name in RUN_FILES):
        saved_id = read_state(path).get("run_id")
        if run_id is not None and saved_id == run_id:
            return  # the same elastic run, restarted
        raise ValueError(
            f"--run-dir {path}: holds {describe(path)}; allowed: --resume to continue it, or a new or empty folder"
        )
    raise ValueError(f"--run-dir {path}: is not empty and holds no copus run; allowed: {ALLOWED}")


def resume_command(run_dir: str | Path, *, torchrun: bool = False) -> str:
    """The command that continues a stopped run (config.toml is read back from the folder)."""
    if torchrun:
        return f"the same torchrun command with: -m copus train --run-dir {run_dir} --resume"
    return f"copus train --run-dir {run_dir} --resume"
