"""Free an engine's tensors at close by reference counting, without waiting for the garbage
collector.

FSDP2 builds reference cycles (a module's hooks hold its `FSDPState`, whose parameter group
holds the module and every `FSDPParam`; each `FSDPParam` holds the sharded parameter, its padded
storage, the unsharded parameter and the all-gather buffers), and the optimizer's state is keyed
by those parameters. Dropping the engine therefore freed nothing until the next `gc.collect()`
(measured: 1.57 of 1.58 GB of a rebuild's old model). `drop_tensors` removes every reference these
objects hold to tensors: the cycles stay (a few KB of Python objects, collected later) but the
tensors' reference counts reach zero now, so their memory returns at once. A tensor the caller
still holds (a state dict, a `full_tensor()` copy or view) stays valid: nothing is resized.
"""

from __future__ import annotations

import torch
from torch import nn


def _is_tensors(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)


def _scrub(obj: object) -> None:
    """Set every attribute of `obj` that holds a tensor (or a list/tuple of them) to None."""
    attrs = getattr(obj, "__dict__", None)
    if attrs is None:
        return
    for key, value in list(attrs.items()):
        if _is_tensors(value):
            attrs[key] = None


def _fsdp_groups(model: nn.Module) -> list:
    """FSDP2's parameter groups of every `fully_shard` unit in `model`."""
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None:
                groups.append(group)
    return groups


@torch.no_grad()
def drop_tensors(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
    """Remove the references that `model` (with its FSDP2 records) and `optimizer` hold to
    parameters, gradients, buffers, optimizer state and communication buffers."""
    if optimizer is not None:
        optimizer.state.clear()
        for group in optimizer.param_groups:
            group["params"] = []
        optimizer.param_groups.clear()
    if model is None:
        return
    for p in model.parameters():
        p.grad = None
    for group in _fsdp_groups(model):
        for record in group.fsdp_params:
            _scrub(record)
        _scrub(group)
        _scrub(getattr(group, "comm_ctx", None))
    for module in model.modules():
        for name in list(module._parameters):
            module._parameters[name] = None
        for name in list(module._buffers):
            module._buffers[name] = None
