"""Switch the parallel layout (dp, tp, pp) inside the running processes (design §6).

COPUS (arXiv 2604.26687, §4.3) reconfigures in place instead of restarting the job and reports
2.3–15.7× faster switches than checkpoint-restart. `switch_engine` does it at an optimizer-step
boundary, called by every rank with the same plan (the trainer broadcasts rank 0's decision):

1. stage   — `get_state_dict` of the old model and AdamW (flattened optimizer state, needed
             when PP is involved: cpu-notes e) and `dcp.save` into a staging folder, in
             /dev/shm when every rank sees it and it has room (RAM, no disk), else under `fallback_root`
             (a shared folder, e.g. the run folder, for multi-node jobs);
2. teardown — the old layout's tensors (weights, gradients, AdamW state, buffers) are freed at
             once by shrinking their storages to zero (`release_tensors`), then
             `Engine.close()` drops wrappers, pipeline schedule and hooks; all BEFORE the new
             layout is allocated. (FSDP2 modules sit in reference cycles, so refcounting alone
             frees nothing, and a full `gc.collect()` scans every Python object of the process:
             0.3–1.2 s per switch measured on a loaded 2-core host.) The cached
             DeviceMesh and its process groups stay alive (destroying them breaks later layouts,
             cpu-notes e), so switching back to a layout reuses its mesh;
3. build   — `build(plan)`: the new mesh (cached), meta model, split/TP/FSDP2, materialised
             shards and a fresh optimizer;
4. load    — `dcp.load` into the new engine's state dicts (DCP reshards each saved shard into the
             new placements), then `set_state_dict`: weights, AdamW `exp_avg`, `exp_avg_sq`,
             `step` and param-group hyperparameters.

Memory: at any moment a rank holds at most its live layout's shards plus the staged copy of
its shard (in tmpfs when /dev/shm is used, which counts as host memory but not as RSS); never
both layouts' models and optimizers at once. Peak RSS over the switch is measured per rank
(Linux VmHWM after resetting it via /proc/self/clear_refs; CUDA: max_memory_allocated).

Everything outside the engine (global sample offset, LR schedule, GNS and policy state) lives in
the trainer and is untouched; the process RNG states are saved before and restored after, so the
switch is invisible to anything that draws random numbers. Wall time is measured per phase and
reported as the maximum over ranks (`SwitchReport`), for the controller's switch cost
(`Controller.record_switch_cost`) and decisions.jsonl.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from copus.core.plan.plan import ParallelPlan

SWITCH_METHODS = ("direct", "in-process", "checkpoint")
SHM_ROOT = Path("/dev/shm")
_PHASES = ("stage_s", "teardown_s", "build_s", "load_s", "plan_s", "move_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchReport:
    """One layout switch, identical on every rank (times and memory: maximum over ranks)."""

    method: str  # "direct" | "in-process" (DCP staging) | "checkpoint"
    old_plan: str
    new_plan: str
    wall_s: float  # the whole switch, first rank in to last rank out
    stage_s: float = 0.0  # state dicts + DCP save into the staging folder
    teardown_s: float = 0.0  # free the old layout's tensors, close the old engine
    build_s: float = 0.0  # new mesh (cached), model, wrappers, optimizer
    load_s: float = 0.0  # DCP load (reshard) + set_state_dict
    plan_s: float = 0.0  # direct: describe both layouts (digests + distinct descriptions) + this rank's plan
    move_s: float = 0.0  # direct: materialise new shards, exchange, free old shards
    staged_bytes: int = 0  # size of the staged state, all ranks together
    staging: str = ""  # "shm" (RAM) | "disk"
    rss_before_mb: float = 0.0  # resident memory when the switch started
    rss_peak_mb: float = 0.0  # peak resident memory during the switch (VmHWM)
    device_peak_mb: float = 0.0  # CUDA: peak allocated during the switch; 0 on CPU
    fallback_reason: str = ""  # why the direct path did not apply (then DCP staging ran)
    moved_bytes: int = 0  # direct: bytes sent to another rank, all ranks together
    local_bytes: int = 0  # direct: bytes copied within a rank, all ranks together
    buckets: int = 0  # direct: groups of parameters moved one after another
    collectives: int = 0  # direct: all_to_all_single calls
    cap_bytes: int = 0  # direct: bucket limit (one parameter with its moments)
    state_mb: float = 0.0  # direct: max over ranks of max(old, new) moved state, MiB
    state_peak_mb: float = 0.0  # direct: max over ranks of the moved state held at once

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------ memory


def _status_kb(field: str) -> float:
    """A `VmRSS`/`VmHWM` line of /proc/self/status in kB (0 where /proc is unavailable)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return 0.0
    m = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def rss_mb() -> float:
    """This process's resident set size now, MiB."""
    return _status_kb("VmRSS") / 1024.0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak resident set size since the last `reset_peak_rss` (or process start), MiB."""
    return _status_kb("VmHWM") / 1024.0


# ------------------------------------------------------------------------------------ helpers


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _allreduce(values: list[float], op: dist.ReduceOp, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return [float(x) for x in t.cpu()]


def _broadcast(obj: Any) -> Any:
    box = [obj]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


STAGE_PREFIX = "copus-switch-"


def _host_prefix() -> str:
    """`copus-switch-<host>-`: this host's staging folders (host name made file-name safe)."""
    return f"{STAGE_PREFIX}{re.sub(r'[^A-Za-z0-9.]', '_', socket.gethostname())}-"


def _stage_prefix() -> str:
    """`copus-switch-<host>-<pid>-`: whose staging folder it is, so a later switch can tell a
    folder left by a killed process from one in use."""
    return f"{_host_prefix()}{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_stages(root: Path) -> list[Path]:
    """Delete staging folders under `root` that this host's dead processes left behind (a worker
    killed mid-switch cannot clean up; in /dev/shm the leftover would hold RAM until reboot).
    Folders of other hosts (a shared fallback root) and of live processes are kept."""
    pattern = re.compile(re.escape(_host_prefix()) + r"(\d+)-")
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for path in entries:
        found = pattern.match(path.name)
        if found and path.is_dir() and not _pid_alive(int(found.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _try_mkdtemp(root: Path | None, need_bytes: int) -> str:
    """Rank 0: a fresh folder under `root` (after removing stale ones there); "" when `root` is
    None, not writable, or has less than `need_bytes` free (a container's /dev/shm is often
    only 64 MiB)."""
    if root is None:
        return ""
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_stages(root)
        if shutil.disk_usage(root).free < need_bytes:
            return ""
        return tempfile.mkdtemp(prefix=_stage_prefix(), dir=root)
    except OSError:
        return ""


def state_bytes(*state_dicts: dict) -> int:
    """Bytes of this rank's tensors (DTensor: local shard) in flat state dicts."""
    total = 0
    for sd in state_dicts:
        for v in sd.values():
            if isinstance(v, DTensor):
                v = v.to_local()
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def make_stage_dir(
    fallback_root: str | Path | None, device: torch.device, prefer_shm: bool = True, local_bytes: int = 0
) -> tuple[Path, str]:
    """A staging folder that EVERY rank sees, with room for every rank's `local_bytes`
    (+10 % + 16 MiB): (path, "shm" | "disk"). Collective.

    Tried in order: /dev/shm (RAM; on one host), `fallback_root` (must be shared by all nodes,
    like a checkpoint folder), the system temp folder. Rank 0 creates it, broadcasts the path,
    and every rank checks that it sees it (one all-reduce); ValueError when none works.
    """
    total = _allreduce([float(local_bytes)], dist.ReduceOp.SUM, device)[0]
    need = int(total * 1.1) + (16 << 20)
    roots = ([(SHM_ROOT, "shm")] if prefer_shm and SHM_ROOT.is_dir() else []) + [
        (Path(fallback_root), "disk") if fallback_root is not None else (None, "disk"),
        (Path(tempfile.gettempdir()), "disk"),
    ]
    for root, kind in roots:
        path = _broadcast(_try_mkdtemp(root, need) if _rank() == 0 else None)
        seen = bool(path) and os.path.isdir(path)
        if _allreduce([1.0 if seen else 0.0], dist.ReduceOp.MIN, device)[0] == 1.0:
            return Path(path), kind
        if _rank() == 0 and path:
            shutil.rmtree(path, ignore_errors=True)
    raise ValueError(
        f"fallback_root={fallback_root!r}: no staging folder with {need} bytes "
        "free is visible to every rank; allowed: a folder on a file system shared "
        "by all nodes"
    )


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def release_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
    """Free the memory of `model`'s parameters, gradients and buffers and of `optimizer`'s state
    now, by resizing their storages to 0 (shared storages once).

    For a model that is being discarded: its tensors become empty, whatever still refers to them.
    Returns (bytes freed, storages that cannot be resized: e.g. ever shared with numpy).
    """
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    freed, stuck, seen = 0, 0, set()
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        if not storage.resizable():
            stuck += 1
            continue
        freed += storage.nbytes()
        storage.resize_(0)
    return freed, stuck


def _capture_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _restore_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _Meter:
    """Per-phase wall clock and memory of one rank, reduced to the slowest rank at the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rss_before = rss_mb()
        self.shared_peak = reset_peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.t0 = self.last = time.perf_counter()
        self.phases: dict[str, float] = dict.fromkeys(_PHASES, 0.0)
        self.rss_seen = self.rss_before

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] += now - self.last
        self.last = now
        self.rss_seen = max(self.rss_seen, rss_mb())

    def report(
        self,
        method: str,
        old: ParallelPlan,
        new: ParallelPlan,
        staged_bytes: int,
        staging: str,
        *,
        sums: dict[str, float] | None = None,
        maxes: dict[str, float] | None = None,
        **extra: Any,
    ) -> SwitchReport:
        """Reduce this rank's figures: times and memory (and `maxes`) by MAX, bytes (and
        `sums`) by SUM over ranks; `extra` fields are taken as they are (same on every rank)."""
        sums, maxes = dict(sums or {}), dict(maxes or {})
        wall = time.perf_counter() - self.t0
        peak = max(self.rss_seen, peak_rss_mb() if self.shared_peak else 0.0)
        dev_peak = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else 0.0
        mx = _allreduce(
            [wall, *self.phases.values(), self.rss_before, peak, dev_peak, *maxes.values()],
            dist.ReduceOp.MAX,
            self.device,
        )
        sm = _allreduce([float(staged_bytes), *sums.values()], dist.ReduceOp.SUM, self.device)
        n = len(_PHASES)
        fields = dict(zip(_PHASES, mx[1 : 1 + n], strict=True))
        fields.update(zip(maxes, mx[4 + n :], strict=True))
        fields.update({k: int(v) for k, v in zip(sums, sm[1:], strict=True)})
        return SwitchReport(
            method=method,
            old_plan=old.describe(),
            new_plan=new.describe(),
            wall_s=mx[0],
            staged_bytes=int(sm[0]),
            staging=staging,
            rss_before_mb=mx[1 + n],
            rss_peak_mb=mx[2 + n],
            device_peak_mb=mx[3 + n],
            **fields,
            **extra,
        )


# ------------------------------------------------------------------------------------ switches

ENGINE_PATHS = ("auto", "direct", "dcp")


def switch_engine(
    engine,
    plan: ParallelPlan,
    build: Callable[..., Any],
    *,
    fallback_root: str | Path | None = None,
    prefer_shm: bool = True,
    path: str = "auto",
    cap_bytes: int | None = None,
) -> tuple[Any, SwitchReport]:
    """Move `engine`'s model and optimizer state into a new engine for `plan`, in place.

    Collective: every rank calls it at the same optimizer-step boundary with the same `plan`.
    `build(plan, allocate=True)` returns the new `Engine` (mesh from the shared `MeshCache`);
    `engine` is closed and must not be used afterwards. Returns (new engine, report).

    `path`: "direct" (`redistribute`: shards move between the layouts in memory, method
    "direct"), "dcp" (staging through DCP files, method "in-process"), or "auto": direct, and
    DCP staging when the direct path cannot apply (the reason, identical on every rank, is in
    `report.fallback_reason`). A DCP staging folder is removed on success and kept on failure
    (it then holds the only copy of the state).
    """
    if path not in ENGINE_PATHS:
        raise ValueError(f"path={path!r} is invalid; allowed: {', '.join(ENGINE_PATHS)}")
    old_plan, device = engine.plan, engine.device
    if plan.layout == old_plan.layout:
        raise ValueError(
            f"switch_engine: layout {plan.layout} is unchanged; allowed: a new "
            "(dp, tp, pp) (same layout: Engine.set_plan)"
        )
    meter = _Meter(device)
    rng = _capture_rng(device)
    reason = ""
    if path != "dcp":
        new = build(plan, allocate=False)
        meter.lap("build_s")
        from copus.runtime.state.redistribute import redistribute

        stats = redistribute(engine, new, cap_bytes=cap_bytes)
        if not isinstance(stats, str):
            meter.phases["plan_s"] += stats.describe_s
            meter.phases["move_s"] += stats.move_s
            meter.phases["build_s"] += stats.finish_s
            meter.last = time.perf_counter()
            meter.rss_seen = max(meter.rss_seen, rss_mb())
            _teardown(engine, device)
            meter.lap("teardown_s")
            _restore_rng(rng, device)
            mib = 2.0**20
            return new, meter.report(
                "direct",
                old_plan,
                plan,
                0,
                "",
                sums={"moved_bytes": stats.bytes_sent, "local_bytes": stats.bytes_local},
                maxes={
                    "state_mb": max(stats.old_bytes, stats.new_bytes) / mib,
                    "state_peak_mb": stats.tracked_peak_bytes / mib,
                },
                buckets=stats.buckets,
                collectives=stats.collectives,
                cap_bytes=stats.cap_bytes,
            )
        if path == "direct":
            raise ValueError(f"path='direct' cannot apply: {stats}; allowed: path='auto' or 'dcp'")
        reason = stats
        new.close()
        del new
        meter.lap("plan_s")
    new, staged, staging = _switch_through_dcp(engine, plan, build, meter, fallback_root, prefer_shm)
    _restore_rng(rng, device)
    return new, meter.report("in-process", old_plan, plan, staged, staging, fallback_reason=reason)


def _teardown(engine, device: torch.device) -> None:
    """Free the old layout's tensors now and close its engine (module docstring, 2)."""
    _, stuck = release_tensors(engine.model, engine.optimizer)
    engine.close()
    if stuck:
        gc.collect()  # some storages could not be shrunk: free them the slow way
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _switch_through_dcp(
    engine,
    plan: ParallelPlan,
    build: Callable[..., Any],
    meter: _Meter,
    fallback_root: str | Path | None,
    prefer_shm: bool,
) -> tuple[Any, int, str]:
    """Stage → teardown → build → load through a DCP folder; (new engine, bytes, staging)."""
    device = engine.device
    model_sd, optim_sd = engine.state_dicts()
    stage, staging = make_stage_dir(fallback_root, device, prefer_shm, state_bytes(model_sd, optim_sd))
    dcp.save(
        {"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(stage, sync_files=False)
    )  # scratch: no fsync
    staged = _folder_bytes(stage) if _rank() == 0 else 0  # rank 0 sees every rank's files
    del model_sd, optim_sd
    meter.lap("stage_s")
    _teardown(engine, device)
    del engine
    meter.lap("teardown_s")
    new = build(plan, init=False)  # the staged state fills every parameter
    meter.lap("build_s")
    model_sd, optim_sd = new.state_dicts()
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(stage), no_dist=True)  # every rank plans its own reads
    new.load_state(state["model"], state["optim"])
    del state, model_sd, optim_sd
    meter.lap("load_s")
    dist.barrier()
    if _rank() == 0:
        shutil.rmtree(stage, ignore_errors=True)
    return new, staged, staging


def timed_switch(
    method: str, old: ParallelPlan, new: ParallelPlan, device: torch.device, fn: Callable[[], Any]
) -> SwitchReport:
    """Run another switch implementation (`fn`, collective) and report its wall time and memory
    the same way, e.g. the trainer's `reconfigure_through_checkpoint` (method "checkpoint")."""
    if method not in SWITCH_METHODS:
        raise ValueError(f"method={method!r} is invalid; allowed: {', '.join(SWITCH_METHODS)}")
    meter = _Meter(device)
    fn()
    return meter.report(method, old, new, 0, "disk")
