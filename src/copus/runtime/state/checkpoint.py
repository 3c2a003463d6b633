"""Atomic, verifiable checkpoints: DCP for tensors, JSON for everything else.

Layout of one checkpoint, `<root>/step-N/`:

    .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (model + flattened optimizer state)
    trainer_state.json             step, samples, tokens, sampler offset, plan, GNS, policy, LR, RNG
    manifest.json                  {"step": N, "files": {name: {"bytes": n, "sha256": hex}}}

Integrity without reading back: each rank's DCP files are hashed as they are written
(`hashing_writer.HashingWriter`: sha256 fed by the write stream), `.metadata` likewise on
rank 0 and the trainer state from its bytes in memory; rank 0 gathers the checksums (one small
all_gather_object) into the manifest. On load every rank verifies an interleaved share of the
files (`agree_on_latest`); a single process (launcher, export, calibrate) hashes the files on
a few threads (`verify(threads=)`). Before, rank 0 read the whole checkpoint while every other
rank waited in a collective (at 30B+ parameters, long enough for NCCL's watchdog).

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
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from copus.atomic import atomic_write_json, fsync_path
from copus.runtime.state.hashing_writer import SIDECAR_SUFFIX, HashingWriter, read_sidecars

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = "tmp-step-"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or a checkpoint that does not match what is being loaded."""


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# Globals DCP's `.metadata` pickle may name (torch 2.13); anything else is refused.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: classes outside `_METADATA_GLOBALS` (and torch dtypes) raise
    instead of being imported, so a crafted `.metadata` cannot call anything."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_metadata(path: str | Path) -> Metadata:
    """DCP's `<path>/.metadata`, safely; CheckpointError names the file on any problem."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (
        OSError,
        EOFError,
        pickle.UnpicklingError,
        AttributeError,
        TypeError,
        ValueError,
        IndexError,
        KeyError,
    ) as exc:
        raise CheckpointError(f"{file} is not valid DCP metadata ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


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


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Every `step-N` folder under `root`, highest step first (validity not checked)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return sorted(out, reverse=True)


def verify(path: str | Path, share: tuple[int, int] = (0, 1), threads: int | None = None) -> str | None:
    """None if `path` is a complete checkpoint, else a one-line problem naming the bad file.

    `share=(r, n)`: check only the r-th of n interleaved parts of the files' checksums (every
    file's size and presence, and the metadata on r = 0, always), so n ranks verify a
    checkpoint in parallel (`agree_on_latest`). `threads`: the share is hashed on that many
    threads (hashlib releases the GIL); default `verify_threads()` for a whole checkpoint in
    one process (launcher, export, calibrate), 1 for a rank's share."""
    path = Path(path)
    r, n = share
    if threads is None:
        threads = verify_threads() if n == 1 else 1
    manifest = path / MANIFEST
    try:
        entries = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        return f"{manifest} is missing (incomplete checkpoint)"
    except (ValueError, KeyError, TypeError) as exc:
        return f"{manifest} is unreadable ({exc.__class__.__name__})"
    mine = []
    for i, (name, meta) in enumerate(sorted(entries.items())):
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != meta["bytes"]:
            return f"{f} has {size} bytes, manifest says {meta['bytes']} (truncated?)"
        if i % n == r:
            mine.append((f, meta["sha256"]))
    for name in (TRAINER_STATE, ".metadata"):
        if name not in entries:
            return f"{path} has no {name} in its manifest"
    if threads > 1 and len(mine) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(mine))) as pool:
            digests = list(pool.map(lambda fs: _sha256(fs[0]), mine))
    else:
        digests = [_sha256(f) for f, _ in mine]
    for (f, want), got in zip(mine, digests, strict=True):
        if got != want:
            return f"{f} fails its sha256 checksum (corrupt)"
    if r == 0:
        try:
            read_metadata(path)
        except CheckpointError as exc:
            return str(exc)
    return None


def verify_threads() -> int:
    """Hashing threads for a single-process verification: the cores this process may use (≤ 8)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def find_latest(root: str | Path, log: Callable[[str], None] = print, threads: int | None = None) -> Path | None:
    """The highest valid `step-N` under `root`; each invalid newer one is logged and skipped.
    One process: the checksums are hashed on `threads` threads (default `verify_threads`)."""
    bad: list[str] = []
    for _, path in step_dirs(root):
        problem = verify(path, threads=threads)
        if problem is None:
            for msg in bad:
                log(f"checkpoint: {msg}; using {path.name}")
            return path
        bad.append(problem)
    for msg in bad:
        log(f"checkpoint: {msg}; no older good checkpoint")
    return None


def agree_on_latest(root: str | Path, log: Callable[[str], None] = print) -> Path | None:
    """`find_latest`, verified by every rank in parallel (each hashes 1/world of the files,
    `verify(share=)`; the first problem any rank finds rejects the checkpoint), so every rank
    loads the same step and none waits while one rank reads the whole checkpoint. Rank 0's
    listing of `root` is the one used; rank 0 logs."""
    if not _distributed():
        return find_latest(root, log)
    rank, world = _rank(), dist.get_world_size()
    say = log if rank == 0 else _quiet
    names = [[str(p) for _, p in step_dirs(root)] if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    bad: list[str] = []
    for name in names[0]:
        problems: list[str | None] = [None] * world
        dist.all_gather_object(problems, verify(name, share=(rank, world)))
        problem = next((p for p in problems if p), None)
        if problem is None:
            for msg in bad:
                say(f"checkpoint: {msg}; using {Path(name).name}")
            return Path(name)
        bad.append(problem)
    for msg in bad:
        say(f"checkpoint: {msg}; no older good checkpoint")
    return None


def _quiet(_: str) -> None:
    return None


def _write_manifest(folder: Path, step: int, known: dict[str, dict] | None = None) -> None:
    """manifest.json: every file's size and sha256; the entries of `known` (hashed by the rank
    that wrote the file) are taken as they are when the size still matches."""
    known = known or {}
    files = {}
    for p in _files(folder):
        name, size = str(p.relative_to(folder)), p.stat().st_size
        entry = known.get(name)
        files[name] = entry if entry is not None and entry["bytes"] == size else {"bytes": size, "sha256": _sha256(p)}
    atomic_write_json(folder / MANIFEST, {"step": step, "files": files})


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
    tmp, final = root / f"{_TMP_PREFIX}{step}", root / f"step-{step}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(_TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    writer = HashingWriter(str(tmp))
    try:
        dcp.save(dcp_state, storage_writer=writer, no_dist=not _distributed())
    except CheckpointException as exc:  # a BaseException holding each rank's traceback
        causes = sorted({str(failure) for failure, _ in exc.failures.values()})
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # free the space a full disk needs back
        raise CheckpointError(
            f"checkpoint {final} not saved ({'; '.join(causes)}); earlier checkpoints are intact"
        ) from None
    # every rank hashed the files it wrote while writing them; rank 0 gathers the checksums
    known = writer.hashes
    if _distributed():
        parts: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, known)
        known = {k: v for part in parts for k, v in (part or {}).items()}
    problem = ""
    if _rank() == 0:
        try:
            _finalize(root, tmp, final, step, trainer_state, keep, known)
        except (OSError, TypeError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
            shutil.rmtree(tmp, ignore_errors=True)
    if not _all_ok(not problem):  # every rank learns rank 0's outcome (no one hangs)
        state = "written but not finished" if final.exists() else "not saved"
        raise CheckpointError(
            f"checkpoint {final} {state} ({problem or 'failed on rank 0'}); earlier checkpoints are intact"
        )
    return final


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

    def __init__(self, nice: int = 0, kind: str = "thread") -> None:
        """`nice`: the writing thread's scheduling priority offset (Linux; > 0 makes the write
        yield to the step on a host whose cores also train — measured on CPU: the steps were
        not faster, the write 3× longer, so 0 by default). `kind`: "thread" (DCP's
        default: the write shares the interpreter, and its lock, with training) or "process"
        (DCP's checkpoint daemon process per rank: no shared interpreter lock; the staged state
        travels to it through shared memory)."""
        if kind not in ("thread", "process"):
            raise ValueError(f"kind={kind!r}: allowed: 'thread', 'process'")
        self.nice, self.kind = nice, kind
        self._group: Any = None
        self._pending: tuple[Any, Path, list[str]] | None = None

    def _process_group(self) -> Any:
        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo")  # collective: the first save
        return self._group

    def save(
        self, root: str | Path, step: int, dcp_state: dict[str, Any], trainer_state: dict, *, keep: int = 0
    ) -> Path:
        """Start checkpoint `step` (collective); return the path it will have once finished."""
        import threading

        self.wait()
        root = Path(root)
        tmp, final = root / f"{_TMP_PREFIX}{step}", root / f"step-{step}"
        state = json.loads(json.dumps(trainer_state))  # a snapshot, JSON-checked now
        if _rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(_TMP_PREFIX + "*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        writer = HashingWriter(str(tmp))
        writer.background_nice = self.nice
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if self.kind == "process" else AsyncCheckpointerType.THREAD
        future = dcp.async_save(
            dcp_state,
            storage_writer=writer,
            process_group=self._process_group(),
            async_checkpointer_type=kind,
            no_dist=not _distributed(),
        )
        problem: list[str] = []
        rank = _rank()

        def finish() -> None:
            try:
                future.result()
                if rank == 0:
                    _finalize(root, tmp, final, step, state, keep, writer.gathered)
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
        if not _all_ok(not problem):
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
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None


def _finalize(
    root: Path, tmp: Path, final: Path, step: int, trainer_state: dict, keep: int, known: dict[str, dict] | None = None
) -> None:
    """Rank 0, after every rank's DCP files are written and hashed (`known`): trainer state,
    fsync, manifest, rename, fsync of the parent, retention."""
    json.dumps(trainer_state)  # fail before touching the folder if not serialisable
    known = {**read_sidecars(tmp), **(known or {}), TRAINER_STATE: _write_json(tmp / TRAINER_STATE, trainer_state)}
    for side in tmp.glob(f"*{SIDECAR_SUFFIX}"):
        side.unlink()
    for f in _files(tmp):
        fsync_path(f)
    _write_manifest(tmp, step, known)
    if final.exists():
        _remove(final)
    os.rename(tmp, final)
    fsync_path(root)
    _apply_retention(root, keep)


def _all_ok(ok: bool) -> bool:
    """Whether `ok` holds on every rank (one all-reduce of a flag; no-op without a group)."""
    if not _distributed():
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


def load(path: str | Path, dcp_state: dict[str, Any], *, check: bool = True, metadata: Metadata | None = None) -> dict:
    """Load tensors into `dcp_state` in place (resharding to its layout); return trainer state.

    `dcp_state` must be the target structure (the current engine's state dicts). With
    `check`, the manifest and checksums are verified first (CheckpointError names the file).
    `metadata`: the checkpoint's `read_metadata`, when the caller already holds it (it is then
    not read again).
    """
    path = Path(path)
    if check and _rank() == 0:
        problem = verify(path)
        if problem is not None:
            raise CheckpointError(problem)
    try:
        dcp.load(
            dcp_state,
            checkpoint_id=str(path),
            storage_reader=_SafeReader(str(path), metadata),
            planner=_SafeLoadPlanner(),
            no_dist=not _distributed(),
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
