"""Atomic checkpoints, DCP for tensors, JSON for everything else: `save` and `load`.

Layout of one checkpoint, `<root>/step-N/`:

    .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (model + flattened optimizer state)
    trainer_state.json             step, samples, tokens, sampler offset, plan, GNS, policy, LR, RNG
    manifest.json                  {"step": N, "files": {name: {"bytes": n, "sha256": hex}}}

Integrity without reading back: each rank's DCP files are hashed as they are written
(`hashing_writer.HashingWriter`: sha256 fed by the write stream), `.metadata` likewise on
rank 0 and the trainer state from its bytes in memory; rank 0 gathers the checksums (one small
all_gather_object) into the manifest. On load every rank verifies its share of the files
(≈ total/world bytes, `agree_on_problem`): on resume (`agree_on_latest`, the launcher's
`--resume auto` checks only the structure and leaves the checksums to its workers) and in
`copus calibrate`'s workers; only `copus export`, a single process, hashes every file, on a few
threads (`verify(threads=)`). The manifest, its verification and the search for the latest good
checkpoint are `checkpoint_integrity.py`'s, re-exported here; the background writer is
`async_checkpoint.AsyncCheckpointer`.

Atomicity (design §6): everything is written to `<root>/tmp-step-N`, every file is fsync'ed,
`manifest.json` (checksums of every other file) is written last, the folder is renamed to `step-N`
and the parent folder is fsync'ed. A crash at any point leaves either a complete `step-N` or a
`tmp-*` folder that is ignored and removed by the next save. "latest" is simply the highest
`step-N` whose manifest and checksums verify; a corrupt or truncated one is reported by file name
and the previous good one is used. DCP reshards on load, so a checkpoint loads under any plan and
world size. Nothing in a checkpoint can run code on load: the trainer state is JSON, DCP's
pickled `.metadata` is read by an unpickler that admits only DCP's own metadata classes, and
non-tensor items (DCP reads them with `torch.load(weights_only=False)`) are read weights-only.

With a process group, every rank calls `save`/`load` (DCP is collective); only rank 0 touches
the folder structure, and multi-node runs need `<root>` on a shared file system (as DCP does).
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from copus.atomic import fsync_path
from copus.runtime.state.checkpoint_integrity import (
    MANIFEST,
    TRAINER_STATE,
    CheckpointError,
    agree_on_latest,
    agree_on_problem,
    checkpoint_files,
    find_latest,
    is_distributed,
    read_metadata,
    step_dirs,
    this_rank,
    verify,
    verify_threads,
    write_manifest,
)
from copus.runtime.state.hashing_writer import SIDECAR_SUFFIX, HashingWriter, read_sidecars

__all__ = [
    "MANIFEST",
    "TRAINER_STATE",
    "CheckpointError",
    "agree_on_latest",
    "agree_on_problem",
    "all_ok",
    "begin_save",
    "finalize",
    "find_latest",
    "load",
    "read_metadata",
    "rng_state",
    "save",
    "set_rng_state",
    "step_dirs",
    "verify",
    "verify_threads",
]

_TMP_PREFIX = "tmp-step-"


def _barrier() -> None:
    if is_distributed():
        dist.barrier()


def begin_save(root: Path, step: int) -> tuple[Path, Path]:
    """Start checkpoint `step` under `root` (collective): rank 0 removes stale `tmp-*` folders
    and creates `<root>/tmp-step-N`, every rank waits for it; returns (tmp, final) paths."""
    tmp, final = root / f"{_TMP_PREFIX}{step}", root / f"step-{step}"
    if this_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(_TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    return tmp, final


def _write_json(path: Path, obj: Any) -> dict:
    """Write `obj` as JSON (fsync'ed); its manifest entry, hashed from the bytes in memory."""
    raw = json.dumps(obj, indent=1, sort_keys=True, allow_nan=True).encode()
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def save(root: str | Path, step: int, dcp_state: dict[str, Any], trainer_state: dict, *, keep: int = 0) -> Path:
    """Write checkpoint `step` atomically (collective); return `<root>/step-N`.

    `dcp_state` maps names to (D)Tensor state dicts, e.g. {"model": ..., "optim": ...};
    `trainer_state` must be JSON-serialisable (rank 0's copy is written). `keep` > 0 deletes all
    but the newest `keep` checkpoints after a successful save.
    """
    root = Path(root)
    tmp, final = begin_save(root, step)
    writer = HashingWriter(str(tmp))
    try:
        dcp.save(dcp_state, storage_writer=writer, no_dist=not is_distributed())
    except CheckpointException as exc:  # a BaseException holding each rank's traceback
        causes = sorted({str(failure) for failure, _ in exc.failures.values()})
        if this_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # free the space a full disk needs back
        raise CheckpointError(
            f"checkpoint {final} not saved ({'; '.join(causes)}); earlier checkpoints are intact"
        ) from None
    # every rank hashed the files it wrote while writing them; rank 0 gathers the checksums
    known = writer.hashes
    if is_distributed():
        parts: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, known)
        known = {k: v for part in parts for k, v in (part or {}).items()}
    problem = ""
    if this_rank() == 0:
        try:
            finalize(root, tmp, final, step, trainer_state, keep, known)
        except (OSError, TypeError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
            shutil.rmtree(tmp, ignore_errors=True)
    if not all_ok(not problem):  # every rank learns rank 0's outcome (no one hangs)
        state = "written but not finished" if final.exists() else "not saved"
        raise CheckpointError(
            f"checkpoint {final} {state} ({problem or 'failed on rank 0'}); earlier checkpoints are intact"
        )
    return final


def finalize(
    root: Path, tmp: Path, final: Path, step: int, trainer_state: dict, keep: int, known: dict[str, dict] | None = None
) -> None:
    """Rank 0, after every rank's DCP files are written and hashed (`known`): trainer state,
    fsync, manifest, rename, fsync of the parent, retention."""
    json.dumps(trainer_state)  # fail before touching the folder if not serialisable
    known = {**read_sidecars(tmp), **(known or {}), TRAINER_STATE: _write_json(tmp / TRAINER_STATE, trainer_state)}
    for side in tmp.glob(f"*{SIDECAR_SUFFIX}"):
        side.unlink()
    for f in checkpoint_files(tmp):
        fsync_path(f)
    write_manifest(tmp, step, known)
    if final.exists():
        _remove(final)
    os.rename(tmp, final)
    fsync_path(root)
    _apply_retention(root, keep)


def all_ok(ok: bool) -> bool:
    """Whether `ok` holds on every rank (one all-reduce of a flag; no-op without a group)."""
    if not is_distributed():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _apply_retention(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    for _, path in step_dirs(root)[keep:]:
        _remove(path)


def _remove(path: Path) -> None:
    """Delete a checkpoint folder without ever leaving a half-deleted `step-N`: rename it to a
    `tmp-step-old-*` name first (atomic; a crash leaves a temp folder the next save clears)."""
    trash = path.with_name(f"{_TMP_PREFIX}old-{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


class _SafeReader(FileSystemReader):
    """FileSystemReader whose metadata goes through `read_metadata` (no arbitrary unpickling),
    or is the `metadata` given (read once by the caller: export loads tensor by tensor)."""

    def __init__(self, path: str, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            metadata = read_metadata(self.path)
        else:  # a shallow copy: DCP sets the load id on it; the tensor entries are shared
            metadata = copy.copy(self._metadata)
            metadata.storage_meta = copy.copy(metadata.storage_meta)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner reading non-tensor items weights-only (plain data, no objects)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            why = [x for x in str(exc).splitlines() if "Unsupported" in x or "global" in x]
            raise CheckpointError(
                f"item {read_item.dest_index.fqn!r} is not plain data, "
                f"refused ({(why or ['weights-only load failed'])[0].strip()})"
            ) from None
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def load(path: str | Path, dcp_state: dict[str, Any], *, check: bool = True, metadata: Metadata | None = None) -> dict:
    """Load tensors into `dcp_state` in place (resharding to its layout); return trainer state.

    `dcp_state` must be the target structure (the current engine's state dicts). With
    `check`, the manifest and checksums are verified first, each rank hashing its share
    (`agree_on_problem`; CheckpointError names the file, on every rank).
    `metadata`: the checkpoint's `read_metadata`, when the caller already holds it (it is then
    not read again).
    """
    path = Path(path)
    problem = agree_on_problem(path) if check else None  # every rank its share, the same answer
    if problem is not None:
        raise CheckpointError(problem)
    try:
        dcp.load(
            dcp_state,
            checkpoint_id=str(path),
            storage_reader=_SafeReader(str(path), metadata),
            planner=_SafeLoadPlanner(),
            no_dist=not is_distributed(),
        )
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except CheckpointException as exc:  # DCP wraps each rank's failure; surface a refusal
        refusal = _refusal(exc)
        if refusal is None:
            raise
        raise CheckpointError(f"{path}: {refusal}") from None
    return json.loads((path / TRAINER_STATE).read_text())


def _refusal(exc: CheckpointException) -> str | None:
    """The first line of a safe-loading refusal inside DCP's wrapped failures, if any."""
    for failure, _ in exc.failures.values():
        text = str(failure)
        if isinstance(failure, CheckpointError) or "not allowed in DCP metadata" in text:
            return text.strip().splitlines()[0]
    return None


def rng_state() -> dict:
    """This process's RNG states (torch CPU, numpy legacy global, python) as JSON data."""
    import random

    import numpy as np

    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def set_rng_state(state: dict) -> None:
    """Inverse of `rng_state`."""
    import random

    import numpy as np

    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
