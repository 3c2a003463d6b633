"""Experiment trackers: Weights & Biases and MLflow get the scalars TensorBoard gets (rank 0).

    [log]
    wandb = true                 # pip install 'copus[wandb]'; WANDB_MODE=offline works without a network
    wandb_project = "copus"      # wandb_name (default: the run folder's name), wandb_tags = ["a", "b"]
    wandb_mode = ""              # "" = W&B's own (WANDB_MODE, else online), "offline", "online"
    mlflow = "sqlite:///mlflow.db"   # a tracking URI (sqlite:, http(s):, databricks, ...); "" = off
    mlflow_experiment = "copus"

Both are optional extras: the packages are imported only when a key enables them, and
`check_available` refuses a missing one in one line before any worker starts. `Scalars` fans
`add_scalar(tag, value, step)` out to TensorBoard's SummaryWriter and every tracker, so
`RunWriter` (metrics.py) calls one object for all of them: train/<key> for each TB_KEYS column,
eval/val_loss, switch/<kind>_s. The resolved config goes to W&B's run config and MLflow's
params (section.key), so a run is findable by its settings. A resumed copus run continues the
same W&B / MLflow run: its id is kept in the run folder (`tracker_ids.json`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

EXTRAS = {"wandb": "copus[wandb]", "mlflow": "copus[mlflow]"}
IDS_FILE = "tracker_ids.json"


def saved_id(run_dir: Path, tracker: str) -> str | None:
    """The tracker run id an earlier attempt of this copus run saved, if any."""
    try:
        value = json.loads((run_dir / IDS_FILE).read_text()).get(tracker)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def save_id(run_dir: Path, tracker: str, run_id: str) -> None:
    """Remember `run_id` so that a resumed copus run logs into the same tracker run."""
    path = run_dir / IDS_FILE
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        ids = {}
    ids[tracker] = run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ids, indent=1) + "\n")
    tmp.replace(path)


def check_available(log: Any) -> None:
    """One ValueError line when `log` (a LogConfig) enables a tracker whose package is absent."""
    wanted = [name for name, on in (("wandb", log.wandb), ("mlflow", bool(log.mlflow))) if on]
    for name in wanted:
        if importlib.util.find_spec(name) is None:
            value = "true" if name == "wandb" else repr(log.mlflow)
            raise ValueError(
                f"log.{name}={value}: the {name} package is not installed; allowed: "
                f"pip install '{EXTRAS[name]}', or log.{name}={'false' if name == 'wandb' else repr('')}"
            )


def flat_config(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{section: {key: value}} → {"section.key": value} (MLflow params, W&B config keys)."""
    return {f"{s}.{k}": v for s, keys in config.items() for k, v in keys.items()}


class WandbTracker:
    """One W&B run: `wandb.init(project, name, tags, config, dir, mode)`, `log({tag: v}, step)`."""

    def __init__(self, log: Any, run_dir: Path, config: dict[str, dict[str, Any]]) -> None:
        self._wandb = importlib.import_module("wandb")
        kwargs: dict[str, Any] = {
            "project": log.wandb_project,
            "name": log.wandb_name or run_dir.name,
            "tags": list(log.wandb_tags),
            "config": config,
            "dir": str(run_dir),
        }
        if log.wandb_mode:
            kwargs["mode"] = log.wandb_mode
        previous = saved_id(run_dir, "wandb")
        if previous is not None:
            kwargs.update(id=previous, resume="allow")
        self.run = self._wandb.init(**kwargs)
        save_id(run_dir, "wandb", str(self.run.id))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """One MLflow run under `log.mlflow` (tracking URI) / `log.mlflow_experiment`."""

    def __init__(self, log: Any, run_dir: Path, config: dict[str, dict[str, Any]]) -> None:
        self._mlflow = mlflow = importlib.import_module("mlflow")
        mlflow.set_tracking_uri(log.mlflow)
        mlflow.set_experiment(log.mlflow_experiment)
        previous = saved_id(run_dir, "mlflow")
        if previous is not None:
            self.run = mlflow.start_run(run_id=previous)
        else:
            self.run = mlflow.start_run(run_name=log.wandb_name or run_dir.name)
            mlflow.log_params({k: str(v) for k, v in flat_config(config).items()})
        save_id(run_dir, "mlflow", str(self.run.info.run_id))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._mlflow.log_metric(tag, value, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


class Scalars:
    """`add_scalar` / `close` fanned out to TensorBoard (may be None) and the trackers."""

    def __init__(self, sinks: list[Any]) -> None:
        self.sinks = [s for s in sinks if s is not None]

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for s in self.sinks:
            s.add_scalar(tag, value, step)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def open_trackers(log: Any, run_dir: str | Path, config: dict[str, dict[str, Any]]) -> list[Any]:
    """The trackers `log` enables (rank 0 calls this), each started with the run's config."""
    run_dir = Path(run_dir)
    out: list[Any] = []
    if log.wandb:
        out.append(WandbTracker(log, run_dir, config))
    if log.mlflow:
        out.append(MlflowTracker(log, run_dir, config))
    return out


def with_trackers(tb: Any, trackers: list[Any]) -> Any:
    """What RunWriter writes scalars to: TensorBoard alone, or a `Scalars` fan-out."""
    return Scalars([tb, *trackers]) if trackers else tb
