"""Checkpoint integrity: what makes a `step-N` folder trustworthy, and finding the newest one that is.

The layout's names (`MANIFEST`, `TRAINER_STATE`, `step_dirs`), the manifest itself
(`write_manifest`: every file's size and sha256, written last by a save) and its check (`verify`),
done by one process (`find_latest`: `copus export`, the launcher's structure-only look) or split
across the ranks (`agree_on_problem`, `agree_on_latest`: each rank hashes ≈ total/world bytes and
one all_gather_object gives every rank the same answer). Before, rank 0 read the whole
checkpoint while every other rank waited in a collective (at 30B+ parameters, long enough for
NCCL's watchdog).

DCP's pickled `.metadata` is read by an unpickler that admits only DCP's own metadata classes
(`read_metadata`), so verifying a checkpoint cannot run code. Writing and loading the tensors
are `checkpoint.py`'s; nothing here imports it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from copus.atomic import atomic_write_json
from copus.runtime.data.shards import hash_shares

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
_STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """No usable checkpoint, or a checkpoint that does not match what is being loaded."""


def this_rank() -> int:
    """This process's rank in the default group; 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def is_distributed() -> bool:
    """Whether a process group is initialized (then saving, loading and agreeing are collective)."""
    return dist.is_available() and dist.is_initialized()


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


def checkpoint_files(folder: Path) -> list[Path]:
    """Every file under `folder` but the manifest, sorted: what the manifest lists."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path, step: int, known: dict[str, dict] | None = None) -> None:
    """manifest.json: every file's size and sha256; the entries of `known` (hashed by the rank
    that wrote the file) are taken as they are when the size still matches."""
    known = known or {}
    files = {}
    for p in checkpoint_files(folder):
        name, size = str(p.relative_to(folder)), p.stat().st_size
        entry = known.get(name)
        files[name] = entry if entry is not None and entry["bytes"] == size else {"bytes": size, "sha256": _sha256(p)}
    atomic_write_json(folder / MANIFEST, {"step": step, "files": files})


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Every `step-N` folder under `root`, highest step first (validity not checked)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return sorted(out, reverse=True)


def verify(
    path: str | Path, share: tuple[int, int] = (0, 1), threads: int | None = None, *, checksums: bool = True
) -> str | None:
    """None if `path` is a complete checkpoint, else a one-line problem naming the bad file.

    `share=(r, n)`: hash only the files `hash_shares` deals rank r of n (largest first to the
    least-loaded rank: at most total/n + the largest file), so n ranks verify a checkpoint in
    parallel (`agree_on_problem`); every file's presence and size are checked by every rank,
    the DCP metadata is unpickled by the rank that hashes it. `threads`: the share is hashed on
    that many threads (hashlib releases the GIL); default `verify_threads()` for a whole
    checkpoint in one process (export), 1 for a rank's share. `checksums=False`: the
    structure only (manifest, every file present with its size), no byte hashed: what a
    launcher checks before handing the checksums to its workers."""
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
    listed = sorted(entries.items())
    for name, meta in listed:
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != meta["bytes"]:
            return f"{f} has {size} bytes, manifest says {meta['bytes']} (truncated?)"
    for name in (TRAINER_STATE, ".metadata"):
        if name not in entries:
            return f"{path} has no {name} in its manifest"
    if not checksums:
        return None
    owner = hash_shares([int(meta["bytes"]) for _, meta in listed], n)
    mine = [(path / name, meta["sha256"]) for (name, meta), o in zip(listed, owner, strict=True) if o == r]
    if threads > 1 and len(mine) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(mine))) as pool:
            digests = list(pool.map(lambda fs: _sha256(fs[0]), mine))
    else:
        digests = [_sha256(f) for f, _ in mine]
    for (f, want), got in zip(mine, digests, strict=True):
        if got != want:
            return f"{f} fails its sha256 checksum (corrupt)"
    if any(f.name == ".metadata" for f, _ in mine):
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


def find_latest(
    root: str | Path,
    log: Callable[[str], None] = print,
    threads: int | None = None,
    *,
    checksums: bool = True,
    problems: list[str] | None = None,
) -> Path | None:
    """The highest valid `step-N` under `root`; each invalid newer one is logged and skipped.
    One process: the checksums are hashed on `threads` threads (default `verify_threads`);
    `checksums=False` checks the structure only (`verify`). Each rejected checkpoint's problem
    is appended to `problems` when given."""
    paths = [p for _, p in step_dirs(root)]
    return _first_good(paths, lambda p: verify(p, threads=threads, checksums=checksums), log, problems)


def _first_good(
    paths: list[Path], problem_of: Callable[[Path], str | None], say: Callable[[str], None], problems: list[str] | None
) -> Path | None:
    """The first of `paths` (newest first) whose `problem_of` is None; the rejected newer ones are
    logged with `say`, and every problem is appended to `problems` (when given) if none is good."""
    bad: list[str] = []
    for path in paths:
        problem = problem_of(path)
        if problem is None:
            for msg in bad:
                say(f"checkpoint: {msg}; using {path.name}")
            return path
        bad.append(problem)
    for msg in bad:
        say(f"checkpoint: {msg}; no older good checkpoint")
    if problems is not None:
        problems.extend(bad)
    return None


def agree_on_problem(path: str | Path) -> str | None:
    """`verify(path)` split across the ranks (collective): each rank hashes its share
    (≈ total/world bytes, `verify(share=)`) and one all_gather_object of the one-line results
    gives every rank the same answer (the first problem any rank found, or None). Without a
    process group: the whole checkpoint in this process."""
    if not is_distributed():
        return verify(path)
    world = dist.get_world_size()
    found: list[str | None] = [None] * world
    dist.all_gather_object(found, verify(path, share=(this_rank(), world)))
    return next((p for p in found if p), None)


def agree_on_latest(
    root: str | Path, log: Callable[[str], None] = print, problems: list[str] | None = None
) -> Path | None:
    """`find_latest`, verified by every rank in parallel (`agree_on_problem`: each hashes
    ≈ 1/world of the bytes; the first problem any rank finds rejects the checkpoint), so every
    rank loads the same step and none waits while one rank reads the whole checkpoint. Rank 0's
    listing of `root` is the one used; rank 0 logs. When none is valid, each checkpoint's
    problem is appended to `problems` (on every rank) when given."""
    if not is_distributed():
        return find_latest(root, log, problems=problems)
    say = log if this_rank() == 0 else _quiet
    names = [[str(p) for _, p in step_dirs(root)] if this_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return _first_good([Path(n) for n in names[0]], agree_on_problem, say, problems)


def _quiet(_: str) -> None:
    return None
