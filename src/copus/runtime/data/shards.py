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
are gathered from a read-only memory map of each shard, a step's rows in one vectorised gather
per shard (no Python loop or system call per row; a row not yet resident costs a page fault
instead of a `pread`). Mapped file pages count in RSS until dropped (clean, reclaimable page
cache, but counted), so once the rows gathered since the last release could have mapped
`RELEASE_BYTES` (256 MiB; a row's bytes + 64 KiB of fault-around + a page counted) the maps are
told `MADV_DONTNEED`: resident memory grows by at most that much with the data touched.
bench/data_integrity.py measures both. The folder is complete
iff `meta.json` exists: prepare writes into a temporary sibling folder and renames it at the end.

Integrity (`verify_folder`): every rank checks every shard's presence and size (a stat), and
hashes only its share of the shards (`hash_shares`: shards dealt by size to the least-loaded
rank, so a rank hashes ≤ dataset/world + one shard); one agreement among the ranks turns any
rank's finding into the same one-line error everywhere. A shard already verified since its last
change is not hashed again (`verified.json`, in the folder or, read-only, in the cache).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Callable
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


VERIFIED = "verified.json"  # {file: [bytes, mtime_ns, sha256]} of shards whose sha256 matched

Agree = Callable[[str], str]  # this rank's problem ("" if none) → the first of every rank's


def hash_shares(sizes: list[int], world: int) -> list[int]:
    """The rank that hashes each file: largest first to the least-loaded rank (ties: lowest rank,
    then file order), the same on every rank. Longest-processing-time dealing: the busiest rank
    hashes at most total/world + the largest file (Graham 1969, "Bounds on multiprocessing
    timing anomalies")."""
    if world < 1:
        raise ValueError(f"world={world!r}: allowed: an integer >= 1")
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def verify_folder(
    path: str | Path, *, checksums: bool = True, share: tuple[int, int] = (0, 1), agree: Agree | None = None
) -> None:
    """Every shard listed in index.json exists with its byte size (always) and sha256 (when
    `checksums`). ValueError names the first bad file.

    `share=(rank, world)`: this rank hashes only the shards `hash_shares` deals it; `agree`
    (collective: every rank's problem → the first one) makes every rank raise the same error.
    A shard's sha256 is computed once: when every share matched, rank 0 records each shard's
    (size, mtime_ns, sha256) in `verified.json` (in the folder; in the cache folder when the
    prepared folder is read-only), and later starts re-hash only a shard whose size or mtime
    changed since (any rewrite, e.g. a flipped byte or a re-prepare, changes the mtime).
    Not detected that way: damage that keeps the mtime (media bit rot, a copy with `cp -p`);
    delete `verified.json` to hash everything again."""
    root = Path(path)
    rank, world = share
    index = json.loads((root / INDEX).read_text())
    entries = index["shards"] + list(index.get("docs", {}).values())
    stamp = _read_stamp(root) if checksums else {}
    fresh: dict[str, list] = {}
    problem = ""
    owner = hash_shares([int(e["bytes"]) for e in entries], world)
    for entry, who in zip(entries, owner, strict=True):
        problem = _check(root, entry, checksums and who == rank, stamp, fresh)
        if problem:
            break
    problem = agree(problem) if agree is not None else problem
    if problem:
        raise ValueError(problem)
    if checksums and rank == 0 and fresh != stamp:
        _write_stamp(root, fresh)


def _check(root: Path, entry: dict, hash_it: bool, stamp: dict, fresh: dict) -> str:
    """One shard's problem ("" when fine); records its (size, mtime, sha256) in `fresh`."""
    f = root / entry["file"]
    where = f"data.source={str(root)!r}: shard {entry['file']}"
    if not f.is_file():
        return f"{where} is missing; prepare the folder again (copus prepare)"
    st = f.stat()
    if st.st_size != entry["bytes"]:
        return (
            f"{where} has {st.st_size} bytes, the index says {entry['bytes']} (truncated or "
            "replaced); prepare the folder again"
        )
    seen = [st.st_size, st.st_mtime_ns, entry["sha256"]]
    if hash_it and stamp.get(entry["file"]) != seen and file_sha256(f) != entry["sha256"]:
        return f"{where} fails its sha256 checksum (corrupted); prepare the folder again"
    fresh[entry["file"]] = seen
    return ""


def stamp_path(root: Path) -> Path:
    """Where `verified.json` lives: in the folder, or — when the folder is not writable — in
    the cache ($COPUS_CACHE_DIR, else ~/.cache/copus) under a name derived from the folder."""
    if os.access(root, os.W_OK):
        return root / VERIFIED
    from copus.runtime.data.cache import default_cache_dir

    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:24]
    return default_cache_dir() / "verified" / f"{key}.json"


def _read_stamp(root: Path) -> dict:
    for path in dict.fromkeys((root / VERIFIED, stamp_path(root))):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            return data
    return {}


def _write_stamp(root: Path, stamp: dict) -> None:
    """Atomic (tmp + rename); where `stamp_path` says. A failure only costs a re-hash later."""
    target = stamp_path(root)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(stamp, sort_keys=True))
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class _Shard:
    path: Path
    start: int  # first token's offset in the split stream
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
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
        self._mapped = 0  # bytes possibly made resident since the last `release`

    def __len__(self) -> int:
        return self.num_tokens

    def _view(self, k: int) -> np.ndarray:
        """Shard k's tokens: a read-only memory map (opened once)."""
        if k not in self._maps:
            with open(self.shards[k].path, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            if _RANDOM is not None:  # windows are read at random: no read-ahead
                mm.madvise(_RANDOM)
            self._maps[k] = (mm, np.frombuffer(mm, dtype=self.dtype, count=self.shards[k].num_tokens))
        return self._maps[k][1]

    def release(self) -> None:
        """Drop the mapped pages from this process (they stay in the page cache): resident
        memory does not grow with the data read. One madvise per open shard."""
        self._mapped = 0
        for mm, _ in self._maps.values():
            if _DONTNEED is not None:
                mm.madvise(_DONTNEED)

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the stream (may span shards)."""
        if start < 0 or start + n > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + n}) outside [0, {self.num_tokens})")
        parts, pos, end = [], start, start + n
        k = int(np.searchsorted(self._starts, pos, side="right")) - 1
        while pos < end:
            shard = self.shards[k]
            take = min(end, shard.start + shard.num_tokens) - pos
            if take > 0:
                off = pos - shard.start
                parts.append(self._view(k)[off : off + take])
            pos += take
            k += 1
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out.astype(np.int64)

    def windows(self, starts: np.ndarray, n: int) -> np.ndarray:
        """Rows tokens[s : s + n] for each s in `starts` (int64 [len, n]): one vectorised gather
        per shard for the rows inside it, `read` for the few that cross a shard boundary."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        out = np.empty((starts.size, n), dtype=np.int64)
        if not starts.size:
            return out
        if starts.min() < 0 or starts.max() + n > self.num_tokens:
            raise IndexError(f"windows of {n} tokens must lie in [0, {self.num_tokens})")
        k = np.searchsorted(self._starts, starts, side="right") - 1
        ends = self._starts[k] + np.asarray([self.shards[i].num_tokens for i in k.tolist()])
        inside = starts + n <= ends
        offsets = np.arange(n, dtype=np.int64)
        for shard in np.unique(k[inside]).tolist():
            rows = np.flatnonzero(inside & (k == shard))
            local = starts[rows] - self.shards[shard].start
            out[rows] = self._view(shard)[local[:, None] + offsets]
        for row in np.flatnonzero(~inside).tolist():
            out[row] = self.read(int(starts[row]), n)
        self._mapped += starts.size * (n * self.dtype.itemsize + _FAULT_AROUND + _PAGE)
        if self._mapped >= RELEASE_BYTES:
            self.release()
        return out

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        while maps:
            _, (mm, view) = maps.popitem()
            del view
            try:
                mm.close()
            except BufferError:  # a caller still holds a view: the map goes with it
                pass

    def __getstate__(self) -> dict:  # maps are not inherited by pickling
        return {
            "dtype": self.dtype,
            "shards": self.shards,
            "num_tokens": self.num_tokens,
            "_starts": self._starts,
            "_maps": {},
            "_mapped": 0,
        }

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
RELEASE_BYTES = 256 << 20  # resident mapped pages allowed before they are dropped
_RANDOM = getattr(mmap, "MADV_RANDOM", None)
_PAGE = mmap.PAGESIZE
_FAULT_AROUND = 64 << 10  # what Linux maps around a read fault (fault_around_bytes)


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
            raise IndexError(f"sample ids must lie in [0, {len(self)}), got [{ids.min()}, {ids.max()}]")
        return self.tokens.windows(ids * self.seq_len, self.seq_len + 1)


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
