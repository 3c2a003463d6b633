"""A DCP storage writer that hashes every byte as it writes it: checkpoint checksums without
reading the files back.

`HashingWriter(path)` is torch's `FileSystemWriter` (one file per rank, fsync'ed) whose file
system wraps each output stream: `write(b)` feeds sha256 and counts bytes on the way to the
file. DCP writes each file front to back (`_write_item` appends, `torch.save` streams through a
non-seekable wrapper), so the digest is the file's sha256; a stream that is ever `seek`ed is
marked and its file hashed from disk instead (`hashes` leaves it out). `.metadata` is written
as `.metadata.tmp` then renamed: its digest is filed under `.metadata`.

After the write each rank files its own digests as `__<rank>.hashes.json` in the checkpoint
folder (written and fsync'ed inside `write_data`, so before DCP's coordinator gathers the write
results); the coordinator reads them all in `finish`, once every rank's data is on disk. This
lets an asynchronous save (`async_checkpoint.AsyncCheckpointer`) be finished by rank 0 alone, without
a collective outside DCP's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

SIDECAR_SUFFIX = ".hashes.json"


class _HashingStream:
    """A write-only file stream that hashes what passes through it."""

    def __init__(self, raw) -> None:
        self.raw, self.h, self.bytes, self.seeked = raw, hashlib.sha256(), 0, False

    def write(self, b) -> int:
        n = self.raw.write(b)
        view = memoryview(b).cast("B")
        self.h.update(view[:n] if n is not None and n < len(view) else view)
        self.bytes += len(view) if n is None else n
        return n

    def seek(self, *args: Any) -> int:
        self.seeked = True
        return self.raw.seek(*args)

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self.raw, name)


class HashingFileSystem(FileSystem):
    """DCP's local file system; streams opened for writing report {name: (bytes, sha256)}."""

    def __init__(self) -> None:
        super().__init__()
        self.hashes: dict[str, dict] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # pickled into DCP's checkpoint process: no lock
        return {"hashes": dict(self.hashes)}

    def __setstate__(self, state: dict) -> None:
        self.hashes, self._lock = state["hashes"], threading.Lock()

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hs = _HashingStream(stream)
            yield hs
            if not hs.seeked:
                name = Path(path).name.removesuffix(".tmp")
                with self._lock:
                    self.hashes[name] = {"bytes": hs.bytes, "sha256": hs.h.hexdigest()}


class HashingWriter(FileSystemWriter):
    """FileSystemWriter (single file per rank, fsync) hashing while writing (module docstring).
    `hashes`: this rank's files; `gathered`: every rank's, on the coordinator after `finish`."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.fs = HashingFileSystem()
        self.gathered: dict[str, dict] = {}

    @property
    def hashes(self) -> dict[str, dict]:
        return dict(self.fs.hashes)

    background_nice = 0  # > 0: the thread that writes lowers its scheduling priority

    def write_data(self, plan, planner):
        if self.background_nice > 0 and threading.current_thread() is not threading.main_thread():
            try:  # Linux: a thread is a task with its own nice value
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.background_nice)
            except (AttributeError, OSError):
                pass
        fut = super().write_data(plan, planner)  # written when it returns (a done future)
        mine = {k: v for k, v in self.fs.hashes.items() if k.endswith(".distcp")}
        _write_sidecar(Path(self.path) / f"__{self.rank or 0}{SIDECAR_SUFFIX}", mine)
        return fut

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        meta = {k: v for k, v in self.fs.hashes.items() if k == ".metadata"}
        _write_sidecar(Path(self.path) / f"_metadata{SIDECAR_SUFFIX}", meta)
        self.gathered = {**read_sidecars(Path(self.path)), **meta}


def _write_sidecar(path: Path, hashes: dict) -> None:
    with open(path, "w") as f:
        json.dump(hashes, f)
        f.flush()
        os.fsync(f.fileno())


def read_sidecars(folder: Path) -> dict[str, dict]:
    """Every rank's {file: {bytes, sha256}} filed in `folder` (a writer process may be another
    process: an asynchronous save's); an unreadable one is skipped (its files are then hashed
    from disk by the manifest)."""
    out: dict[str, dict] = {}
    for side in sorted(folder.glob(f"*{SIDECAR_SUFFIX}")):
        try:
            out.update(json.loads(side.read_text()))
        except (OSError, ValueError):
            continue
    return out
