"""The prepared-folder format: token shards, their index and metadata; reading windows from them.

Layout of a folder written by `copus prepare` (runtime/data/prepare.py), after Megatron-LM's indexed
datasets (`.bin` + `.idx`) and nanoGPT's `uint16` token files:

    meta.json              format, tokenizer {spec, sha256, vocab_size, eos_id, file}, dtype,
                           splits {train, val: {num_tokens, num_docs}}, sources, settings
    index.json             shards [{file, split, num_tokens, bytes, sha256}], docs {split: file}
    tokenizer.json         the tokenizer (absent for the byte tokenizer)
    train-00000.bin ...    raw little-endian token ids (uint16 when vocab <= 65536, else uint32)
    val-00000.bin ...      held-out documents, same encoding
    train-docs.bin ...     little-endian int64 start offset of each document in the split's token stream

A split is the concatenation of its shards, in order. Window i of a split (sequence length L) is
tokens[i·L : i·L + L + 1], as `data.TokenDataset`; a window may cross a shard boundary. Windows
are read with positional reads (`os.pread`), not a memory map, so the process's resident memory
does not grow with the data touched (mapped file pages would count in RSS); the page cache does
the rest. The folder is complete iff `meta.json` exists: prepare writes into a temporary sibling
folder and renames it at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "copus-prepared-v1"
META = "meta.json"
INDEX = "index.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")


def is_prepared(path: str | Path) -> bool:
    """True when `path` is a folder holding a prepared-data meta.json."""
    meta = Path(path) / META
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


VERIFIED = "verified.json"   # {file: [bytes, mtime_ns, sha256]} of shards whose sha256 matched


def verify_folder(path: str | Path, *, checksums: bool = True) -> None:
    """Every shard listed in index.json exists with its byte size (always) and sha256 (when
    `checksums`). ValueError names the first bad file.

    A shard's sha256 is computed once: when it matches, its (size, mtime_ns, sha256) goes to
    `verified.json` in the folder, and later starts re-hash only a shard whose size or mtime
    changed since (any rewrite, e.g. a flipped byte or a re-prepare, changes the mtime), instead
    of reading every byte of the dataset on every rank at every start. Not detected that way:
    damage that keeps the mtime (media bit rot, a copy with `cp -p`); delete `verified.json` to
    hash everything again. A read-only folder is hashed at every start, as before."""
    root = Path(path)
    index = json.loads((root / INDEX).read_text())
    stamp = _read_stamp(root) if checksums else {}
    fresh: dict[str, list] = {}
    for entry in index["shards"] + list(index.get("docs", {}).values()):
        f = root / entry["file"]
        if not f.is_file():
            raise ValueError(f"data.source={str(root)!r}: shard {entry['file']} is missing; "
                             "prepare the folder again (copus prepare)")
        st = f.stat()
        if st.st_size != entry["bytes"]:
            raise ValueError(f"data.source={str(root)!r}: shard {entry['file']} has {st.st_size} "
                             f"bytes, the index says {entry['bytes']} (truncated or replaced); "
                             "prepare the folder again")
        if not checksums:
            continue
        seen = [st.st_size, st.st_mtime_ns, entry["sha256"]]
        if stamp.get(entry["file"]) != seen:
            if file_sha256(f) != entry["sha256"]:
                raise ValueError(f"data.source={str(root)!r}: shard {entry['file']} fails its "
                                 "sha256 checksum (corrupted); prepare the folder again")
        fresh[entry["file"]] = seen
    if checksums and fresh != stamp:
        _write_stamp(root, fresh)


def _read_stamp(root: Path) -> dict:
    try:
        data = json.loads((root / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_stamp(root: Path, stamp: dict) -> None:
    """Atomic (tmp + rename; concurrent ranks write the same content); skipped when the folder
    is read-only."""
    tmp = root / f".{VERIFIED}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(stamp, sort_keys=True))
        os.replace(tmp, root / VERIFIED)
    except OSError:
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class _Shard:
    path: Path
    start: int        # first token's offset in the split stream
    num_tokens: int


class ShardedTokens:
    """One split's token stream over its shard files; `read(start, n)` → int64 [n]."""

    def __init__(self, root: Path, shards: list[dict], dtype: np.dtype) -> None:
        self.dtype = np.dtype(dtype)
        self.shards: list[_Shard] = []
        pos = 0
        for s in shards:
            self.shards.append(_Shard(root / s["file"], pos, int(s["num_tokens"])))
            pos += int(s["num_tokens"])
        self.num_tokens = pos
        self._starts = np.asarray([s.start for s in self.shards], dtype=np.int64)
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return self.num_tokens

    def _fd(self, k: int) -> int:
        if k not in self._fds:
            self._fds[k] = os.open(self.shards[k].path, os.O_RDONLY)
        return self._fds[k]

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the stream (may span shards)."""
        if start < 0 or start + n > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + n}) outside [0, {self.num_tokens})")
        parts, pos, end = [], start, start + n
        k = int(np.searchsorted(self._starts, pos, side="right")) - 1
        while pos < end:
            shard = self.shards[k]
            take = min(end, shard.start + shard.num_tokens) - pos
            off = (pos - shard.start) * self.dtype.itemsize
            raw = os.pread(self._fd(k), take * self.dtype.itemsize, off)
            parts.append(np.frombuffer(raw, dtype=self.dtype))
            pos += take
            k += 1
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out.astype(np.int64)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __getstate__(self) -> dict:  # file descriptors are not inherited by pickling
        return {"dtype": self.dtype, "shards": self.shards, "num_tokens": self.num_tokens,
                "_starts": self._starts, "_fds": {}}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class WindowDataset:
    """Non-overlapping windows over a ShardedTokens stream; the same contract as
    `data.TokenDataset` (len = (n − 1) // L; batch(ids) → int64 [len(ids), L + 1])."""

    def __init__(self, tokens: ShardedTokens, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r}: allowed: an integer >= 1")
        self.tokens, self.seq_len = tokens, int(seq_len)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        return self.tokens.read(i * self.seq_len, self.seq_len + 1)

    def batch(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"sample ids must lie in [0, {len(self)}), got "
                             f"[{ids.min()}, {ids.max()}]")
        out = np.empty((ids.size, self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(ids.tolist()):
            out[row] = self.tokens.read(i * self.seq_len, self.seq_len + 1)
        return out


def open_split(path: str | Path, split: str, seq_len: int) -> WindowDataset:
    """Windows of `split` ('train' | 'val') of a prepared folder (no token is loaded)."""
    root = Path(path)
    meta = read_meta(root)
    index = json.loads((root / INDEX).read_text())
    shards = [s for s in index["shards"] if s["split"] == split]
    return WindowDataset(ShardedTokens(root, shards, np.dtype(meta["dtype"])), seq_len)


def doc_starts(path: str | Path, split: str) -> np.ndarray:
    """Start offsets of the documents of `split` (int64 array read from the docs file)."""
    root = Path(path)
    index = json.loads((root / INDEX).read_text())
    return np.fromfile(root / index["docs"][split]["file"], dtype="<i8")
