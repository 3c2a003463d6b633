"""Atomic file writes, the one place copus writes a file that must never be seen half-written.

    write(path.tmp) -> flush -> fsync(path.tmp) -> rename(path.tmp, path) -> fsync(parent folder)

A crash or kill at any point leaves either the old file or the new one, never a mix (POSIX
rename is atomic within a file system; the parent's fsync makes the new entry durable). The
temporary name carries the process id, so ranks racing to write the same cache entry do not
collide. `fsync=False` keeps the rename but skips both fsyncs: for caches that can be rebuilt.
Folders are committed the same way by their writers (checkpoint.py, prepare.py, export.py),
with `fsync_path` on every file and on the parent after the folder's rename.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (a folder: its entries, e.g. after a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(path: Path) -> Path:
    """`.<name>.<pid>.tmp` beside `path`: hidden, per process, never a valid final name."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextmanager
def atomic_writer(path: str | Path, mode: str = "wb", *, fsync: bool = True) -> Iterator[IO[Any]]:
    """Open a temporary file for writing; on a clean exit it replaces `path` atomically, on an
    exception it is removed and `path` is untouched. `mode` is "wb" or "w" (UTF-8)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"mode={mode!r} is invalid; allowed: 'wb', 'w'")
    path = Path(path)
    tmp = tmp_name(path)
    try:
        with open(tmp, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_path(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes, *, fsync: bool = True) -> None:
    """Replace `path` with `data` atomically (module docstring)."""
    with atomic_writer(path, "wb", fsync=fsync) as fh:
        fh.write(data)


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = True) -> None:
    """Replace `path` with the UTF-8 `text` atomically (module docstring)."""
    with atomic_writer(path, "w", fsync=fsync) as fh:
        fh.write(text)


def atomic_write_json(
    path: str | Path, obj: Any, *, indent: int | None = 1, sort_keys: bool = True, fsync: bool = True
) -> None:
    """Replace `path` with `json.dumps(obj)` + newline atomically (NaN/inf allowed, as Python writes)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, allow_nan=True) + "\n", fsync=fsync)
