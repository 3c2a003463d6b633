"""A copy of one rank's model parameters and AdamW state off the device, for branches
(`branching.stage` / `restore`: the probe and `copus calibrate`).

Where the copy lives, by the engine's device:
- CUDA: pinned host memory (one `pin_memory=True` tensor per local tensor, asynchronous copies
  both ways, one synchronisation). Device memory during a probe stays the training step's.
- CPU (the device *is* host memory): a file in the run folder (written with `write`, read back
  in place with `readinto` into the live tensors): nothing is added to the process's resident
  memory (the page cache is the kernel's).

The copy is 4 + 8 = 12 bytes per local parameter under AdamW with fp32 masters (+ 4 at bf16
state, none in copus). Before anything is copied, `check_room` compares it with the host memory
available to this rank (CUDA: MemAvailable / ranks on this host) or the free disk space of the
folder (CPU) and raises `StageError` (a ValueError: one line naming the plan and the bytes
missing; `copus calibrate` exits 2) when it does not fit; nothing has changed at that point.
Restore copies into the existing tensors: no second copy exists at any time (the former
state-dict clone kept two on the device: +24 bytes per local parameter).
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["StageError", "TensorStage", "host_available_bytes", "stage_bytes"]


class StageError(ValueError):
    """The staged state does not fit where it would be staged (one line; exit 2)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _engine_tensors(engine) -> list[torch.Tensor]:
    """Parameters' local data, then each parameter's AdamW state tensors (sorted keys)."""
    params = list(engine.model.parameters())
    out = [_local(p).detach() for p in params]
    for p in params:
        state = engine.optimizer.state.get(p, {})
        out += [_local(state[k]).detach() for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return out


def stage_bytes(engine) -> int:
    """Bytes of this rank's staged copy."""
    return sum(t.numel() * t.element_size() for t in _engine_tensors(engine))


def host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo divided by the ranks on this host (LOCAL_WORLD_SIZE)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    total = int(line.split()[1]) * 1024
                    break
            else:
                return 1 << 62
    except OSError:
        return 1 << 62
    return total // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def check_room(need: int, available: int, plan_text: str, where: str) -> None:
    """StageError naming the plan and the bytes missing when `need` > `available`."""
    if need > available:
        raise StageError(
            f"branch staging for plan {plan_text}: needs {need:,} bytes of {where} "
            f"per rank, {available:,} available ({need - available:,} missing); "
            "allowed: a plan or world with a smaller shard per rank, or more "
            f"{where}"
        )


def _bytes_view(t: torch.Tensor):
    """A writable byte view (numpy) of contiguous tensor `t`."""
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass(slots=True)
class _Meta:
    shape: torch.Size
    dtype: torch.dtype


class TensorStage:
    """This rank's parameters and AdamW state, staged off the device (module docstring)."""

    def __init__(self, engine, folder: str | Path | None, plan_text: str) -> None:
        tensors = _engine_tensors(engine)
        self.meta = [_Meta(t.shape, t.dtype) for t in tensors]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.groups = [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups
        ]
        self.extras = [
            {
                k: copy.deepcopy(v)
                for k, v in engine.optimizer.state.get(p, {}).items()
                if not isinstance(v, torch.Tensor)
            }
            for p in engine.model.parameters()
        ]
        self.keys = [
            sorted(k for k, v in engine.optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor))
            for p in engine.model.parameters()
        ]
        self.device = engine.device
        self.host: list[torch.Tensor] | None = None
        self.path: Path | None = None
        if self.device.type == "cuda":
            check_room(self.nbytes, host_available_bytes(), plan_text, "pinned host memory")
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            torch.cuda.synchronize(self.device)
            return
        root = Path(folder) if folder is not None else Path(tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        check_room(self.nbytes, shutil.disk_usage(root).free, plan_text, f"disk in {root}")
        fd, name = tempfile.mkstemp(prefix=".branch-stage-", dir=root)
        self.path = Path(name)
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        with os.fdopen(fd, "wb") as fh:
            for t in tensors:
                fh.write(_bytes_view(t.contiguous()).data)

    def restore(self, engine) -> None:
        """Copy the staged values into `engine`'s tensors (same layout: same shapes and order)."""
        params = list(engine.model.parameters())
        opt = engine.optimizer
        for p, extras, keys in zip(params, self.extras, self.keys):
            state = opt.state.setdefault(p, {})
            for k in [k for k in state if k not in keys and k not in extras]:
                del state[k]  # created after staging (a first step inside a branch)
            if any(k not in state for k in keys):
                raise ValueError(
                    "restore: AdamW state staged for a parameter is gone; allowed: "
                    "the engine that was staged (same layout, state kept)"
                )
            state.update(copy.deepcopy(extras))
        for g, saved in zip(opt.param_groups, self.groups):
            g.update(copy.deepcopy(saved))
        targets = _engine_tensors(engine)
        if [(t.shape, t.dtype) for t in targets] != [(m.shape, m.dtype) for m in self.meta]:
            raise ValueError(
                "restore: the engine's tensors differ from the staged ones; allowed: the same layout as at staging"
            )
        with torch.no_grad():
            if self.host is not None:
                for t, h in zip(targets, self.host):
                    t.copy_(h, non_blocking=True)
                torch.cuda.synchronize(self.device)
                return
            with open(self.path, "rb") as fh:
                for t in targets:
                    if t.is_contiguous():
                        fh.readinto(_bytes_view(t))
                    else:
                        tmp = torch.empty(t.shape, dtype=t.dtype)
                        fh.readinto(_bytes_view(tmp))
                        t.copy_(tmp)

    def close(self) -> None:
        """Free the staged copy now (pinned memory, or the staging file)."""
        self.host = None
        if self.path is not None:
            self._finalizer()
            self.path = None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
