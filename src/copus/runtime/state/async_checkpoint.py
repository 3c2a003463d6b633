"""Checkpoints written in the background (`AsyncCheckpointer`), staged into reused host memory
(`ReusedStaging`): training goes on while DCP writes, and the checkpoint is finished and
committed by `checkpoint.finalize` exactly as a synchronous `checkpoint.save` would.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from copus.runtime.state.checkpoint import all_ok, begin_save, finalize
from copus.runtime.state.checkpoint_integrity import CheckpointError, is_distributed, this_rank
from copus.runtime.state.hashing_writer import HashingWriter


class ReusedStaging:
    """DCP's staging (`BlockingAsyncStager`) into host tensors kept from one save to the next:
    allocated and page-faulted once (pinned on CUDA, so the device-to-host copy runs at full
    PCIe speed), then only copied into — torchtitan's `cache_staged_state_dict`. They are
    reallocated when the state's structure changes (a layout switch changes local shapes and
    meshes). Costs 12·N/W bytes of host memory between saves."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        class _Stager(BlockingAsyncStager):
            def stage(inner, state_dict: dict) -> dict:  # noqa: N805 - the stager instance
                return self._stage(state_dict)

        self.stager = _Stager(cache_staged_state_dict=True)
        self._key: tuple | None = None
        self._cache: dict | None = None
        self.allocations = 0

    def _stage(self, state_dict: dict) -> dict:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        key = _structure(state_dict)
        if key != self._key or self._cache is None:
            self._cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._key = key
            self.allocations += 1
        return _copy_state_dict(state_dict, self._cache, type_check=False)

    def close(self) -> None:
        self._cache, self._key = None, None


def _structure(obj: Any) -> tuple:
    """What must match for staged host tensors to be reused: every tensor's place in the
    state, global and local shape, dtype and (for a DTensor) placements and mesh."""
    from torch.distributed.tensor import DTensor

    out: list = []

    def walk(path: str, x: Any) -> None:
        if isinstance(x, DTensor):
            local = x._local_tensor
            out.append((path, tuple(x.shape), tuple(local.shape), x.dtype, x.placements, id(x.device_mesh)))
        elif isinstance(x, torch.Tensor):
            out.append((path, tuple(x.shape), tuple(x.stride()), x.dtype))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{path}/{k}", v)
        elif isinstance(x, (list, tuple)):
            out.append((path, len(x)))
            for i, v in enumerate(x):
                walk(f"{path}/{i}", v)

    walk("", obj)
    return tuple(out)


class AsyncCheckpointer:
    """Checkpoints written in the background, as torchtitan's async mode: `save` stages the
    tensors to host memory (DCP `async_save`: a copy, so training may change them at once) and
    returns; a thread writes them through `HashingWriter` over a gloo group of its own (the
    training collectives keep the default group), and rank 0 finishes the checkpoint as soon as
    DCP's coordinator has gathered every rank's write — trainer state, fsync, manifest from the
    checksums computed while writing, rename — with no collective outside DCP's. Atomicity is
    `save`'s: until the rename the checkpoint is a `tmp-step-N` folder that resume ignores, so
    a crash or kill mid-write leaves the last good checkpoint as it was.

    `wait()` (collective: every rank at the same point) joins the pending save and agrees on
    its outcome (CheckpointError on every rank if any failed); the next `save` and `close` call
    it first, so at most one save is in flight and none is left unfinished."""

    def __init__(self, nice: int = 0, kind: str = "thread", reuse_staging: bool = True) -> None:
        """`nice`: the writing thread's scheduling priority offset (Linux; > 0 makes the write
        yield to the step on a host whose cores also train — measured on CPU: the steps were
        not faster, the write 3× longer, so 0 by default). `kind`: "thread" (DCP's
        default: the write shares the interpreter, and its lock, with training) or "process"
        (DCP's checkpoint daemon process per rank: no shared interpreter lock; the staged state
        travels to it through shared memory). `reuse_staging`: stage into the host tensors of
        the previous save (`ReusedStaging`) instead of new ones each time."""
        if kind not in ("thread", "process"):
            raise ValueError(f"kind={kind!r}: allowed: 'thread', 'process'")
        self.nice, self.kind = nice, kind
        self.staging = ReusedStaging() if reuse_staging else None
        self._group: Any = None
        self._pending: tuple[Any, Path, list[str]] | None = None

    def _process_group(self) -> Any:
        if self._group is None and is_distributed():
            self._group = dist.new_group(backend="gloo")  # collective: the first save
        return self._group

    def save(
        self, root: str | Path, step: int, dcp_state: dict[str, Any], trainer_state: dict, *, keep: int = 0
    ) -> Path:
        """Start checkpoint `step` (collective); return the path it will have once finished."""
        import threading

        self.wait()
        root = Path(root)
        state = json.loads(json.dumps(trainer_state))  # a snapshot, JSON-checked now
        tmp, final = begin_save(root, step)
        writer = HashingWriter(str(tmp))
        writer.background_nice = self.nice
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if self.kind == "process" else AsyncCheckpointerType.THREAD
        future = dcp.async_save(
            dcp_state,
            storage_writer=writer,
            process_group=self._process_group(),
            async_checkpointer_type=kind,
            async_stager=None if self.staging is None else self.staging.stager,
            no_dist=not is_distributed(),
        )
        problem: list[str] = []
        rank = this_rank()

        def finish() -> None:
            try:
                future.result()
                if rank == 0:
                    finalize(root, tmp, final, step, state, keep, writer.gathered)
            except CheckpointException as exc:
                problem.append("; ".join(sorted({str(f) for f, _ in exc.failures.values()})))
            except Exception as exc:  # noqa: BLE001 - reported by wait() on every rank
                problem.append(f"{type(exc).__name__}: {exc}")
            if problem and rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)

        thread = threading.Thread(target=finish, name=f"copus-checkpoint-{step}", daemon=True)
        thread.start()
        self._pending = (thread, final, problem)
        return final

    def wait(self) -> Path | None:
        """Join the pending save (collective); its path, None when none was pending."""
        if self._pending is None:
            return None
        thread, final, problem = self._pending
        self._pending = None
        thread.join()
        if not all_ok(not problem):
            state = "written but not finished" if final.exists() else "not saved"
            why = problem[0] if problem else "failed on another rank"
            raise CheckpointError(f"checkpoint {final} {state} ({why}); earlier checkpoints are intact")
        return final

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def close(self) -> None:
        """Finish the pending save, then release the checkpoint group (collective)."""
        try:
            self.wait()
        finally:
            if self.staging is not None:
                self.staging.close()
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
