"""Process group, device and DeviceMesh helpers shared by the engine, trainer and tests.

Pitfalls encoded here (../shared/cpu-notes.md a, e): FSDP2 on gloo needs a barrier before
`destroy_process_group`; `init_device_mesh` creates new process groups on every call, so keep ONE
mesh per layout (`MeshCache`) and never destroy the old sub-groups.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")


def backend_for(device: torch.device | str, backend: str = "auto") -> str:
    """"gloo" for CPU, "nccl" for CUDA when `backend` is "auto"; otherwise `backend` itself."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is invalid; allowed: 'auto', 'gloo', 'nccl'")
    if backend != "auto":
        return backend
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device: torch.device | None = None, backend: str = "auto") -> torch.device:
    """Join the default process group from torchrun's environment (idempotent); return the device.

    On CPU sets `torch.set_num_threads(1)` unless OMP_NUM_THREADS says otherwise (cpu-notes g).
    """
    device = default_device() if device is None else torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device, backend))
    return device


def shutdown() -> None:
    """Barrier, then destroy the default group (without the barrier FSDP2+gloo ranks abort)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class MeshCache:
    """One named DeviceMesh ("pp", "dp", "tp") per layout, built once and reused.

    `get(dp=, tp=, pp=)` returns the cached mesh; sub-meshes are `mesh["dp"]` etc.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self._meshes: dict[tuple[int, int, int], DeviceMesh] = {}

    def get(self, *, dp: int, tp: int, pp: int) -> DeviceMesh:
        key = (pp, dp, tp)
        if pp * dp * tp != dist.get_world_size():
            raise ValueError(f"dp*tp*pp={dp}*{tp}*{pp} must equal the world size "
                             f"{dist.get_world_size()}")
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh(self.device_type, key, mesh_dim_names=MESH_DIMS)
        return self._meshes[key]

    def __len__(self) -> int:
        return len(self._meshes)


def max_over_ranks(value: float, device: torch.device) -> float:
    """The slowest rank's value (e.g. a step's seconds: what the step cost the job), identical on
    every rank; `value` itself without a multi-rank process group."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
