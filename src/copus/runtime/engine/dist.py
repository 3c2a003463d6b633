"""Process group, device and DeviceMesh helpers shared by the engine, trainer and tests.

Pitfalls encoded here (../shared/cpu-notes.md a, e): FSDP2 on gloo needs a barrier before
`destroy_process_group`; `init_device_mesh` creates new process groups on every call, so keep ONE
mesh per layout (`MeshCache`). A layout switch releases the meshes of the layouts it left
(`MeshCache.release_except`): their sub-groups are destroyed, the mesh forgotten (also by
DTensor's planner cache, which would hand a new equal mesh the old one's destroyed groups:
"Could not resolve the process group registered under the name ..."), so a later switch back
builds fresh groups. On NCCL each
sub-group holds a communicator with its own device buffers, so leaking them grows GPU memory
with every switch.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")


def backend_for(device: torch.device | str, backend: str = "auto") -> str:
    """ "gloo" for CPU, "nccl" for CUDA when `backend` is "auto"; otherwise `backend` itself."""
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


DEFAULT_TIMEOUT_S = 1800.0  # = train.nccl_timeout_s's default (config.py)


def init_distributed(
    device: torch.device | None = None, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S
) -> torch.device:
    """Join the default process group from torchrun's environment (idempotent); return the device.

    `timeout_s` (train.nccl_timeout_s): how long a collective may wait for a peer before the
    group aborts. 30 min by default: one rank may legitimately hold the others at a collective
    while it writes a large checkpoint, and a 7B model's DCP save with its AdamW moments is
    ~84 GB (at ~1 GB/s per node to a network file system, minutes); a crashed peer is noticed
    by the launcher long before. On CUDA the group is bound to this rank's device
    (`device_id`: NCCL communicators are created eagerly for it and no collective guesses the
    device). On CPU sets `torch.set_num_threads(1)` unless OMP_NUM_THREADS says otherwise
    (cpu-notes g).
    """
    if not timeout_s > 0:
        raise ValueError(f"train.nccl_timeout_s={timeout_s}: allowed: a number > 0 (seconds)")
    device = default_device() if device is None else torch.device(device)
    if device.type == "cuda":  # CUDA only: bind this process to its device
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group(
            backend_for(device, backend),
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
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
        """A new cache (a new trainer in this process) also clears DTensor's C++ sharding
        cache once: entries of an earlier trainer's released meshes compare equal to this
        cache's new meshes (test_reconfigure runs two trainers in one process, so does
        bench/time_to_target.py). Clearing it at every switch instead keeps the released
        groups alive (measured: +8 descriptors per 2 switches at 2 ranks), so only here."""
        self.device_type = device_type
        self._meshes: dict[tuple[int, int, int], DeviceMesh] = {}
        _forget_meshes(native=True)

    def get(self, *, dp: int, tp: int, pp: int) -> DeviceMesh:
        key = (pp, dp, tp)
        if pp * dp * tp != dist.get_world_size():
            raise ValueError(f"dp*tp*pp={dp}*{tp}*{pp} must equal the world size {dist.get_world_size()}")
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh(self.device_type, key, mesh_dim_names=MESH_DIMS)
        return self._meshes[key]

    def __len__(self) -> int:
        return len(self._meshes)

    def release_except(self, *, dp: int, tp: int, pp: int) -> int:
        """Destroy the sub-groups of every cached mesh but the (dp, tp, pp) one and forget those
        meshes (collective: every rank calls it at the same point, after the last use of the
        old layout and after closing its engine), then collect garbage. The default group is
        never destroyed. Returns the number of groups destroyed."""
        keep = (pp, dp, tp)
        kept = self._meshes[keep].get_all_groups() if keep in self._meshes else []
        # by name: NCCL's split_group may name a subgroup after its ranks, so two meshes can
        # hold the same group through different Python objects
        spared = {g.group_name for g in [*kept, dist.group.WORLD]}
        destroyed = 0
        for key in [k for k in self._meshes if k != keep]:
            for group in self._meshes.pop(key).get_all_groups():
                if group.group_name not in spared:
                    dist.destroy_process_group(group)
                    spared.add(group.group_name)
                    destroyed += 1
        if destroyed:
            _forget_meshes()
        return destroyed


def _forget_meshes(native: bool = False) -> None:
    """Drop what still refers to released meshes. DTensor caches one redistribute planner per
    (weakref(mesh), tensor meta), and its sharding propagation caches output specs per op
    schema, both holding meshes: a new mesh of a layout used before compares equal to the
    released one (DeviceMesh equality ignores the groups) and would get the cached entries,
    whose groups are destroyed ("Could not resolve the process group
    registered under the name ...", the cpu-notes e pitfall). Then the old engine's FSDP/DTensor
    objects sit in reference cycles that still hold the groups: without a collection their
    sockets (gloo) or communicators (NCCL) live on, +8 descriptors per switch at 2 ranks
    (tests/runtime/test_process_groups.py)."""
    try:  # torch-internal caches (torch 2.13); absent elsewhere: nothing to clear
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

        clear_redistribute_planner_cache()
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        if native:  # the C++ fast path's copy: see MeshCache.__init__
            torch._C._clear_DTensor_sharding_propagator_cache()
    except (ImportError, AttributeError):
        pass
    gc.collect()


def max_over_ranks(value: float, device: torch.device) -> float:
    """The slowest rank's value (e.g. a step's seconds: what the step cost the job), identical on
    every rank; `value` itself without a multi-rank process group."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
