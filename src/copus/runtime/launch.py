"""Start the trainer on N local workers, or in-process under an outer launcher.

- Under `torchrun` (RANK, WORLD_SIZE and LOCAL_RANK set): run this rank's trainer in-process.
  Multi-node runs work this way (`torchrun --nnodes ... -m copus train ...`).
- Otherwise `copus train --nproc N` starts N workers with torch's elastic launch API
  (`torch.distributed.launcher.api`): c10d rendezvous on localhost at a free port, spawned
  workers, up to `max_restarts` restarts; a restarted worker resumes from the latest good
  checkpoint (TORCHELASTIC_RESTART_COUNT > 0).
- N = 1 without an outer launcher runs in-process with a one-rank process group.

Workers report deliberate stops (bad plan, non-finite run, ...) as a result instead of raising,
so the elastic agent does not restart a run that would fail the same way again.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

from copus.config import Config

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def under_torchrun() -> bool:
    """True when an outer launcher (torchrun, elastic agent, SLURM wrapper) set the rank env."""
    return all(k in os.environ for k in TORCHRUN_VARS)


def world_size(cfg: Config) -> int:
    """The world the trainer will see: the outer launcher's, else parallel.nproc."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else cfg.parallel.nproc


def free_port() -> int:
    """A TCP port free on localhost right now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cfg: Config, run_dir: str, *, resume: bool = False, max_restarts: int = 3,
           entry: Callable[..., dict] | None = None) -> dict[str, Any]:
    """Run `entry(cfg, run_dir, resume)` on every rank; return rank 0's result dict.

    `entry` defaults to `copus.runtime.trainer.worker`; it must be a module-level function
    (spawned workers import it by name).
    """
    if entry is None:
        from copus.runtime.trainer import worker as entry
    if under_torchrun():
        return entry(cfg, run_dir, resume)
    nproc = cfg.parallel.nproc
    if nproc == 1:
        return _run_single(entry, cfg, run_dir, resume)
    return _run_elastic(entry, cfg, run_dir, resume, nproc, max_restarts)


def _run_single(entry: Callable[..., dict], cfg: Config, run_dir: str,
                resume: bool) -> dict[str, Any]:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
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


def _run_elastic(entry: Callable[..., dict], cfg: Config, run_dir: str, resume: bool,
                 nproc: int, max_restarts: int) -> dict[str, Any]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=f"copus-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": 120}, max_restarts=max_restarts,
        monitor_interval=0.2, start_method="spawn", local_addr="127.0.0.1",
    )
    results = elastic_launch(config, entry)(cfg, run_dir, resume)
    return results[0] if 0 in results else next(iter(results.values()))
