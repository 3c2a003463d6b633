"""Exact activation bytes a forward pass leaves for its backward, measured two ways.

- `saved_bytes` (autograd's view): a `torch.autograd.graph.saved_tensors_hooks` pack hook sees
  every tensor an op saves for backward *outside* checkpointed regions; the sum is over distinct
  storages, parameters / buffers / inputs excluded. Inside a checkpointed region the checkpoint's
  own hooks take over, so this misses what a checkpoint keeps.
- `live_bytes` (the allocator's view): a `TorchDispatchMode` records a weak reference to the
  storage of every tensor an op creates during the forward; after the forward, the storages
  still alive (minus the output's) are exactly what the graph, the checkpoints' saved inputs and
  selective AC's cache hold until backward. Pre-existing storages (parameters, buffers, inputs,
  including views of them) are excluded.

Without checkpointing the two agree (tests/runtime/test_activation_checkpointing.py checks it),
which validates `live_bytes` for the checkpointed modes. Plain (unsharded) tensors only: run it
on a single-process model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["ActivationBytes", "measure_activation_bytes"]


@dataclass(frozen=True, slots=True)
class ActivationBytes:
    """Bytes held between forward and backward (see module docstring)."""

    saved_bytes: int  # via saved_tensors_hooks, outside checkpointed regions
    live_bytes: int  # every storage created by the forward and still alive after it


class _StorageRecorder(TorchDispatchMode):
    """Weak references to the storage of every op output created under this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                # an address seen before belongs to a freed storage or to this one: overwrite
                self.storages[s._cdata] = (StorageWeakRef(s), s.nbytes())
        return out


def _storage_ids(tensors) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


def measure_activation_bytes(
    model: torch.nn.Module, forward: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...] = ()
) -> tuple[torch.Tensor, ActivationBytes]:
    """Run `forward()` (which calls `model`) under both meters; returns (output, bytes). The
    output keeps the graph alive: call backward on it (or drop it) afterwards."""
    existing = _storage_ids([*model.parameters(), *model.buffers(), *inputs])
    packed: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in existing:
            packed[s._cdata] = s.nbytes()
        return t

    recorder = _StorageRecorder()
    with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    skip = existing | _storage_ids([out])
    live = sum(n for key, (ref, n) in recorder.storages.items() if key not in skip and not ref.expired())
    return out, ActivationBytes(saved_bytes=sum(packed.values()), live_bytes=live)
