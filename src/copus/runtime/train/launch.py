"""Start the trainer on N local workers, or in-process under an outer launcher.

- Under `torchrun` (RANK, WORLD_SIZE and LOCAL_RANK set): run this rank's trainer in-process.
  Multi-node runs work this way (`torchrun --nnodes ... -m copus train ...`).
- Otherwise `copus train --nproc N` starts N workers with torch's elastic launch API
  (`torch.distributed.launcher.api`): c10d rendezvous on localhost at a free port, spawned
  workers, up to `max_restarts` restarts; a restarted worker resumes from the latest good
  checkpoint of the same run (`elastic_run_id`, see `worker` below).
- N = 1 without an outer launcher runs in-process with a one-rank process group.
- OMP_NUM_THREADS: cores ÷ N for the spawned workers unless the user set it (`omp_threads`).

The plan and policy are resolved and validated here, without torch, before anything starts.
Workers report deliberate stops (bad plan, non-finite run, ...) as a result instead of raising,
so the elastic agent does not restart a run that would fail the same way again.

SIGINT / SIGTERM (runtime/train/stop.py): the workers finish the step, checkpoint and return a
"stopped" result; under `--nproc N` the launcher passes the signal on to them once, as the file
`<run_dir>/stop-request` (`stop.SignalForwarder`; torch's agent is told to leave both signals
alone, it would re-send them and SIGKILL the workers after 30 s). A second signal kills the workers and returns
{"aborted": signal} without any restart.
"""

from __future__ import annotations

import os
import signal
import socket
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from copus.config import Config
from copus.runtime.train.setup import (  # noqa: F401 (re-exported: the launcher's planning helpers)
    check_run_length,
    elastic_run_id,
    restart_count,
    under_torchrun,
    validate_before_launch,
    world_size,
)

if TYPE_CHECKING:
    from copus.runtime.train.trainer import Hook, PolicyFactory


def omp_threads(nproc: int, env: Mapping[str, str] | None = None, cores: int | None = None) -> str | None:
    """OMP_NUM_THREADS for `nproc` local workers: None when the user set it (kept), else
    max(1, cores // nproc) with cores = the CPUs this process may run on
    (`os.sched_getaffinity`, i.e. taskset / cgroup cpusets; else `os.cpu_count`). torchrun
    sets it too (to 1); without it N workers each start one OpenMP thread per core and contend
    on the host parts of the step (data, optimizer launch, gloo)."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return None
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not on Linux
            cores = os.cpu_count() or 1
    return str(max(1, cores // max(1, nproc)))


def free_port() -> int:
    """A TCP port free on localhost right now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    cfg: Config, run_dir: str, *, resume: bool = False, max_restarts: int = 3, entry: Callable[..., dict] | None = None
) -> dict[str, Any]:
    """Run `entry(cfg, run_dir, resume)` on every rank; return rank 0's result dict.

    `entry` defaults to `copus.runtime.train.launch.worker`; it must be a module-level function
    (spawned workers import it by name).
    """
    if entry is None:
        entry = worker
    if under_torchrun():
        return entry(cfg, run_dir, resume)
    nproc = cfg.parallel.nproc
    if nproc == 1:
        return _run_single(entry, cfg, run_dir, resume)
    return _run_elastic(entry, cfg, run_dir, resume, nproc, max_restarts)


def _run_single(entry: Callable[..., dict], cfg: Config, run_dir: str, resume: bool) -> dict[str, Any]:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return entry(cfg, run_dir, resume)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_elastic(
    entry: Callable[..., dict], cfg: Config, run_dir: str, resume: bool, nproc: int, max_restarts: int
) -> dict[str, Any]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Restarted workers must not share the agent's TCPStore: its keys carry no per-round prefix,
    # so a restarted rank can read the killed generation's gloo address and fail with
    # "Connection refused" (seen in bench/faults.py; pytorch/pytorch#135712). Opting out gives
    # every round a fresh store hosted by its rank 0.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from copus.runtime.train import stop

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"copus-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": 120},
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr="127.0.0.1",
        signals_to_handle="SIGHUP,SIGQUIT",  # SIGINT/SIGTERM: stop.SignalForwarder
    )
    saved_env = {k: os.environ.get(k) for k in (stop.LAUNCHER_ENV, "TORCHELASTIC_SIGNALS_TO_HANDLE", "OMP_NUM_THREADS")}
    os.environ[stop.LAUNCHER_ENV] = "1"
    threads = omp_threads(nproc)
    if threads is not None:  # the spawned workers inherit it (torch reads it at import)
        os.environ["OMP_NUM_THREADS"] = threads
    try:
        graceful = entry is worker
        with stop.SignalForwarder(run_dir, graceful=graceful) as forwarder:
            try:
                results = elastic_launch(config, entry)(cfg, run_dir, resume)
            except SignalException:
                if not graceful:  # e.g. copus profile: nothing to save
                    raise KeyboardInterrupt from None
                first = forwarder.signum or int(signal.SIGINT)
                return {"aborted": stop.signal_name(forwarder.second or first), "exit_code": stop.exit_code(first)}
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return results[0] if 0 in results else next(iter(results.values()))


# ------------------------------------------------------------------------------------ entry


def worker(
    cfg: Config, run_dir: str, resume: bool, on_batch: Hook | None = None, policy_factory: PolicyFactory | None = None
) -> dict:
    """Entry of one rank (spawned by launch.py or run under torchrun): returns a result dict.

    Deliberate stops (ValueError for a bad setting, TrainingError) come back as
    {"error": message, "kind": "value" | "training"} so the elastic agent does not restart them.
    Under an elastic launcher the worker resumes from the latest checkpoint of the same run
    (`Trainer.same_run`: same TORCHELASTIC_RUN_ID, i.e. torchrun --rdzv-id) whether it was
    restarted after a failure or because a host joined (a membership change, which keeps
    TORCHELASTIC_RESTART_COUNT at 0); a checkpoint of another run starts a fresh run.
    """
    from copus.runtime.engine.dist import init_distributed, shutdown
    from copus.runtime.train import stop
    from copus.runtime.train.trainer import Trainer, TrainingError

    elastic = elastic_run_id() is not None or restart_count() > 0
    if stop.detach_worker():  # a worker of copus's own launcher: it writes stop-request
        stop.request.install().watch(run_dir)
    else:
        stop.request.install()
    device = init_distributed(backend=cfg.parallel.backend, timeout_s=cfg.train.nccl_timeout_s)
    trainer = None
    try:
        trainer = Trainer(
            cfg, run_dir, device, resume=resume, auto_resume=elastic, on_batch=on_batch, policy_factory=policy_factory
        )
        result = trainer.run()
    except ValueError as exc:
        result = {"error": str(exc), "kind": "value"}
    except TrainingError as exc:
        result = {"error": str(exc), "kind": "training"}
    finally:
        if trainer is not None:
            trainer.close()
        stop.request.uninstall()
    shutdown()
    return result


def calibrate_worker(cfg, run_dir: str, resume: bool) -> dict:
    """Entry of one rank for `copus calibrate` (launch.launch): for each checkpoint in the
    request (`<run_dir>/request.json`: checkpoints, multipliers, tokens, repeats, epsilon,
    num_marks), load it and `calibrate_state`; rank 0's return value is the result."""
    import json
    from pathlib import Path

    from copus.runtime.engine.dist import init_distributed, shutdown
    from copus.runtime.train.branching import REQUEST, calibrate_state, load_checkpoint_state
    from copus.runtime.train.trainer import Trainer

    request = json.loads((Path(run_dir) / REQUEST).read_text())
    device = init_distributed(backend=cfg.parallel.backend, timeout_s=cfg.train.nccl_timeout_s)
    trainer = None
    out: dict = {"checkpoints": []}
    try:
        trainer = Trainer(cfg, run_dir, device)
        for path in request["checkpoints"]:
            load_checkpoint_state(trainer, path)
            res = calibrate_state(
                trainer,
                multipliers=request["multipliers"],
                tokens=request["tokens"],
                repeats=request["repeats"],
                epsilon=request.get("epsilon"),
                num_marks=request.get("num_marks", 4),
            )
            res["checkpoint"] = str(path)
            out["checkpoints"].append(res)
            trainer.log(
                f"calibrated {path}: c = {res['c']:.3g}, critical batch "
                f"{res['critical_batch']['value']:.3g} ({res['cost']['seconds']:.1f} s)"
            )
    except ValueError as exc:
        out = {"error": str(exc), "kind": "value"}
    finally:
        if trainer is not None:
            trainer.close()
    shutdown()
    return out
