"""W&B and MLflow (runtime/state/trackers.py): they get exactly the scalars TensorBoard gets, the
run's config, project / name / tags; a missing package is one line before anything starts.

The copus side is tested with recording stand-ins for the `wandb` and `mlflow` modules (the
packages are optional extras, absent from the test environment); the real packages are tested
offline (WANDB_MODE=offline, an MLflow sqlite: URI) when installed."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from copus.config import config_to_dict, load_config
from copus.runtime.state import trackers
from copus.runtime.state.metrics import RunWriter
from tests.runtime.test_metrics import write_run


class Recorder:
    """Records every call made to it as (name, args, kwargs)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def scalars(self) -> list[tuple[str, float, int]]:
        return [(a[0], a[1], a[2]) for n, a, _ in self.calls if n == "add_scalar"]

    def add_scalar(self, tag, value, step) -> None:
        self.calls.append(("add_scalar", (tag, value, step), {}))

    def close(self) -> None:
        self.calls.append(("close", (), {}))


def fake_wandb(rec: list) -> types.ModuleType:
    mod = types.ModuleType("wandb")

    class Run:
        id = "wb-123"

        def log(self, data, step=None):
            rec.append(("log", data, step))

        def finish(self):
            rec.append(("finish", None, None))

    def init(**kwargs):
        rec.append(("init", kwargs, None))
        return Run()

    mod.init = init
    return mod


def fake_mlflow(rec: list) -> types.ModuleType:
    mod = types.ModuleType("mlflow")
    for name in ("set_tracking_uri", "set_experiment", "log_params", "log_metric", "end_run"):

        def fn(*args, _name=name, **kwargs):
            rec.append((_name, args, kwargs))

        setattr(mod, name, fn)

    def start_run(**kwargs):
        rec.append(("start_run", (), kwargs))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=kwargs.get("run_id", "ml-456")))

    mod.start_run = start_run
    return mod


def _cfg(*overrides):
    return load_config(None, ["batch.policy=gns", *overrides])


def test_trackers_get_exactly_the_tensorboard_scalars(tmp_path, monkeypatch):
    """test_metrics' run (steps, a NaN loss, a decision with its switch cost, an eval) written with
    TensorBoard on and one tracker: the tracker's (tag, value, step) list is TensorBoard's."""
    tb, other = Recorder(), Recorder()
    monkeypatch.setattr("torch.utils.tensorboard.SummaryWriter", lambda log_dir: tb)
    orig = RunWriter.__init__

    def init(self, run_dir, **kw):
        orig(self, run_dir, **{**kw, "tensorboard": True, "trackers": [other]})

    monkeypatch.setattr(RunWriter, "__init__", init)
    write_run(tmp_path).close()
    assert tb.scalars() and tb.scalars() == other.scalars()
    tags = {t for t, _, _ in other.scalars()}
    assert {"train/loss", "train/lr", "train/b_noise", "eval/val_loss", "switch/reconfigure_s"} <= tags
    assert other.calls[-1][0] == "close" and tb.calls[-1][0] == "close"


def test_wandb_and_mlflow_runs_carry_config_names_and_scalars(tmp_path, monkeypatch):
    wrec, mrec = [], []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(wrec))
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(mrec))
    cfg = _cfg(
        "log.wandb=true",
        "log.wandb_project='ablations'",
        "log.wandb_tags=['gns', 'cpu']",
        "log.wandb_mode='offline'",
        "log.mlflow='file:/tmp/mlruns'",
        "log.mlflow_experiment='abs'",
    )
    sinks = trackers.open_trackers(cfg.log, tmp_path / "run-7", config_to_dict(cfg))
    w = RunWriter(tmp_path / "run-7", tensorboard=False, trackers=sinks)
    from tests.runtime.test_metrics import plan, record

    w.log_step(record(1, plan(), 8), wall_s=0.5)
    w.log_eval(1, 2.5, samples=8, tokens=128, wall_s=0.6)
    w.close()
    (init,) = [kw for n, kw, _ in wrec if n == "init"]
    assert init["project"] == "ablations" and init["name"] == "run-7" and init["tags"] == ["gns", "cpu"]
    assert init["mode"] == "offline" and init["config"]["batch"]["policy"] == "gns"
    logged = {k: (v, step) for n, d, step in wrec if n == "log" for k, v in d.items()}
    assert logged["train/loss"] == (2.9, 1) and logged["eval/val_loss"] == (2.5, 1)
    assert wrec[-1][0] == "finish"
    names = [n for n, _, _ in mrec]
    assert names[:4] == ["set_tracking_uri", "set_experiment", "start_run", "log_params"]
    assert mrec[0][1] == ("file:/tmp/mlruns",) and mrec[1][1] == ("abs",)
    assert mrec[2][2] == {"run_name": "run-7"} and mrec[3][1][0]["batch.policy"] == "gns"
    metrics = {a[0]: (a[1], kw["step"]) for n, a, kw in mrec if n == "log_metric"}
    assert metrics["train/loss"] == (2.9, 1) and metrics["eval/val_loss"] == (2.5, 1)
    assert names[-1] == "end_run"


def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path, monkeypatch):
    wrec, mrec = [], []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(wrec))
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(mrec))
    cfg = _cfg("log.wandb=true", "log.mlflow='sqlite:///x.db'")
    for _attempt in (1, 2):  # the first run, then its resume
        for s in trackers.open_trackers(cfg.log, tmp_path, config_to_dict(cfg)):
            s.close()
    inits = [kw for n, kw, _ in wrec if n == "init"]
    assert "id" not in inits[0] and (inits[1]["id"], inits[1]["resume"]) == ("wb-123", "allow")
    starts = [kw for n, _, kw in mrec if n == "start_run"]
    assert starts == [{"run_name": tmp_path.name}, {"run_id": "ml-456"}]
    assert [n for n, _, _ in mrec].count("log_params") == 1  # params are set once per run


def test_no_tracker_is_imported_unless_enabled(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it would raise
    monkeypatch.setitem(sys.modules, "mlflow", None)
    assert trackers.open_trackers(_cfg().log, tmp_path, {}) == []
    trackers.check_available(_cfg().log)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("log.wandb=true", "log.wandb=true: the wandb package is not installed; allowed: pip install 'copus[wandb]'"),
        ("log.mlflow='file:./mlruns'", "log.mlflow='file:./mlruns': the mlflow package is not installed"),
    ],
)
def test_missing_package_is_one_line_before_anything_starts(tmp_path, monkeypatch, override, needle):
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="not installed") as err:
        trackers.check_available(_cfg(override).log)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) for m in ("wandb",)), reason="wandb installed: the CLI would start"
)
def test_cli_refuses_wandb_without_the_package(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "copus", "train", "--run-dir", str(tmp_path / "r"), "--set", "log.wandb=true"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "the wandb package is not installed" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_config_keys_are_checked():
    with pytest.raises(ValueError, match="log.wandb_tags='x'"):
        _cfg("log.wandb_tags='x'")
    with pytest.raises(ValueError, match="log.wandb_mode='sometimes'"):
        _cfg("log.wandb_mode='sometimes'")
    assert _cfg("log.wandb_tags=['a']").log.wandb_tags == ("a",)


def test_real_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg("log.wandb=true", "log.wandb_tags=['t']")
    w = RunWriter(tmp_path, tensorboard=False, trackers=trackers.open_trackers(cfg.log, tmp_path, config_to_dict(cfg)))
    from tests.runtime.test_metrics import plan, record

    for s in (1, 2, 3):
        w.log_step(record(s, plan(), 8 * s), wall_s=0.5 * s)
    w.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    first = trackers.saved_id(tmp_path, "wandb")
    w = RunWriter(tmp_path, tensorboard=False, trackers=trackers.open_trackers(cfg.log, tmp_path, config_to_dict(cfg)))
    w.close()
    assert first and trackers.saved_id(tmp_path, "wandb") == first  # resumed: the same run id


def test_real_mlflow_local_store(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # MLflow 3's local store (file: is deprecated)
    cfg = _cfg(f"log.mlflow='{uri}'", "log.mlflow_experiment='copus-test'")
    w = RunWriter(
        tmp_path / "run",
        tensorboard=False,
        trackers=trackers.open_trackers(cfg.log, tmp_path / "run", config_to_dict(cfg)),
    )
    from tests.runtime.test_metrics import plan, record

    for s in (1, 2, 3):
        w.log_step(record(s, plan(), 8 * s), wall_s=0.5 * s)
    w.close()
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("copus-test").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, round(m.value, 6)) for m in history] == [(1, 2.9), (2, 2.8), (3, 2.7)]
    assert run.data.params["batch.policy"] == "gns" and run.info.run_name == "run"
    # a resumed copus run logs into the same MLflow run
    w = RunWriter(
        tmp_path / "run",
        tensorboard=False,
        trackers=trackers.open_trackers(cfg.log, tmp_path / "run", config_to_dict(cfg)),
    )
    w.log_step(record(4, plan(), 32), wall_s=2.0)
    w.close()
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2, 3, 4]
    assert len(client.search_runs([run.info.experiment_id])) == 1
