"""`copus prepare`: documents → tokens → shards, written atomically (format: runtime/data/shards.py).

Pipeline: `sources.documents` (main process, in input order) → batches of documents → tokenized
by `workers` processes (`tokenizers`, one thread each) or in-process → each document followed by
the tokenizer's separator → train or val by its index → shard files. Results are consumed in
submission order, so the output is byte-identical for any number of workers.

Validation holds whole documents: document u is held out iff ⌊(u+1)·F⌋ > ⌊u·F⌋ (F = val
fraction: an even spread of ⌊n·F⌋ documents); when that picks none (fewer than 1/F documents)
the last document is held out instead, so a small corpus still validates.

Atomicity: everything is written into `.<out>.partial` beside `out`, every file fsync'ed,
`meta.json` last, then the folder is renamed to `out` and the parent fsync'ed. A folder named
`out` is therefore always complete; an interrupted prepare leaves only the `.partial` folder,
which the next run removes before starting clean.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from copus.runtime.data import shards as fmt
from copus.runtime.data.sources import documents, expand_inputs
from copus.runtime.data.tokenizer import (
    ByteCodec,
    HfTokenizer,
    load_tokenizer,
    parse_spec,
    token_dtype,
    train_bpe_tokenizer,
)

SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard
BATCH_CHARS = 1 << 21  # characters per tokenization task


# ------------------------------------------------------------------------------ tokenize workers

_WORKER_TOK: HfTokenizer | ByteCodec | None = None


def _init_worker(tok_json: str | None) -> None:
    global _WORKER_TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if tok_json is None:
        _WORKER_TOK = ByteCodec()
    else:
        from tokenizers import Tokenizer

        _WORKER_TOK = HfTokenizer.from_hf(Tokenizer.from_str(tok_json))


def _encode(texts: list[str], tok=None) -> tuple[np.ndarray, np.ndarray]:
    """Documents → (their tokens, each followed by the separator, concatenated; lengths)."""
    tok = tok or _WORKER_TOK
    sep = tok.separator()
    encoded = [np.concatenate([ids, sep]) for ids in tok.encode_batch(texts)]
    lengths = np.asarray([len(e) for e in encoded], dtype=np.int64)
    return np.concatenate(encoded), lengths


# ------------------------------------------------------------------------------------- writing


class SplitWriter:
    """One split's shard files (`<split>-NNNNN.bin`) and document starts, hashed as written."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.root, self.split, self.dtype, self.shard_tokens = root, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.num_tokens = self.num_docs = 0
        self._fh = None
        self._hash = hashlib.sha256()
        self._in_shard = 0
        self._docs_path = root / f"{split}-docs.bin"
        self._docs = open(self._docs_path, "wb")  # noqa: SIM115 - closed in close()
        self._docs_hash = hashlib.sha256()

    def _open_shard(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._fh = open(self.root / name, "wb")  # noqa: SIM115 - closed in _close_shard()
        self._hash, self._in_shard = hashlib.sha256(), 0
        self.shards.append({"file": name, "split": self.split, "num_tokens": 0, "bytes": 0, "sha256": ""})

    def _close_shard(self) -> None:
        if self._fh is None:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        entry = self.shards[-1]
        entry.update(
            num_tokens=self._in_shard, bytes=self._in_shard * self.dtype.itemsize, sha256=self._hash.hexdigest()
        )

    def write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents (their concatenated tokens and token counts)."""
        starts = self.num_tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        raw = starts.astype("<i8").tobytes()
        self._docs.write(raw)
        self._docs_hash.update(raw)
        self.num_docs += len(lengths)
        data = tokens.astype(self.dtype.newbyteorder("<"), copy=False)
        while data.size:
            if self._fh is None or self._in_shard >= self.shard_tokens:
                self._close_shard()
                self._open_shard()
            take = min(data.size, self.shard_tokens - self._in_shard)
            chunk = data[:take].tobytes()
            self._fh.write(chunk)
            self._hash.update(chunk)
            self._in_shard += take
            self.num_tokens += take
            data = data[take:]

    def close(self) -> dict:
        """fsync everything; the index entries of this split's files."""
        self._close_shard()
        self._docs.flush()
        os.fsync(self._docs.fileno())
        self._docs.close()
        size = self._docs_path.stat().st_size
        return {"file": self._docs_path.name, "bytes": size, "sha256": self._docs_hash.hexdigest()}


# ------------------------------------------------------------------------------------ pipeline


def _batches(files: list[Path], text_field: str) -> Iterator[tuple[list[str], int]]:
    """(documents, input bytes consumed so far) in input order, ~BATCH_CHARS characters each."""
    done_bytes, batch, chars = 0, [], 0
    for path in files:
        for doc in documents(path, text_field):
            batch.append(doc)
            chars += len(doc)
            if chars >= BATCH_CHARS:
                yield batch, done_bytes
                batch, chars = [], 0
        done_bytes += path.stat().st_size
    if batch:
        yield batch, done_bytes


def _is_val(u: np.ndarray, fraction: float) -> np.ndarray:
    """Document u is held out iff floor((u+1)·F) > floor(u·F)."""
    return np.floor((u + 1) * fraction) > np.floor(u * fraction)


def _tokenized(files, text_field, tok, workers: int) -> Iterator[tuple[np.ndarray, np.ndarray, int, int]]:
    """(tokens, lengths, input bytes done, characters) per batch, in input order."""
    if workers <= 1:
        for texts, nbytes in _batches(files, text_field):
            yield (*_encode(texts, tok), nbytes, sum(map(len, texts)))
        return
    import multiprocessing as mp

    tok_json = None if isinstance(tok, ByteCodec) else tok.to_json()
    with mp.get_context("spawn").Pool(workers, _init_worker, (tok_json,)) as pool:
        pending: deque = deque()
        for texts, nbytes in _batches(files, text_field):
            pending.append((pool.apply_async(_encode, (texts,)), nbytes, sum(map(len, texts))))
            while len(pending) > 2 * workers:
                res, b, c = pending.popleft()
                yield (*res.get(), b, c)
        while pending:
            res, b, c = pending.popleft()
            yield (*res.get(), b, c)


def _settings(files: list[Path], spec: str, text_field: str, val_fraction: float, shard_tokens: int) -> dict:
    return {
        "sources": [{"path": str(p.resolve()), "bytes": p.stat().st_size, "sha256": fmt.file_sha256(p)} for p in files],
        "tokenizer_spec": spec,
        "text_field": text_field,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
    }


def check_out(out: Path) -> None:
    """`out` may be missing, empty, or a prepared folder (checked against the inputs later);
    anything else is refused before anything is written."""
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"--out={str(out)!r}: is a file; allowed: a new or empty folder, or a folder copus prepare wrote"
        )
    if out.is_dir() and any(out.iterdir()) and not fmt.is_prepared(out):
        raise ValueError(
            f"--out={str(out)!r}: the folder holds other files; allowed: a new or "
            "empty folder, or a folder copus prepare wrote"
        )


class _Progress:
    """A bar over input bytes with bytes/s and tokens/s (tqdm), on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc="prepare",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.t0, self.tokens, self.done = time.perf_counter(), 0, 0

    def update(self, nbytes: int, ntokens: int) -> None:
        self.tokens += ntokens
        if nbytes > self.done:
            self.bar.update(nbytes - self.done)
            self.done = nbytes
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / dt / 1e6:.2f} M tok/s", refresh=False)

    def close(self) -> None:
        self.bar.close()


def prepare(
    inputs: list[str],
    out: str | Path,
    *,
    tokenizer: str = "byte",
    text_field: str = "text",
    val_fraction: float = 0.01,
    workers: int = 1,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool = True,
    log=print,
) -> dict:
    """Write the prepared folder `out`; returns its meta.json content. Idempotent: an existing
    prepared `out` of the same inputs and settings is left as it is."""
    if not 0.0 <= val_fraction <= 0.5 or not math.isfinite(val_fraction):
        raise ValueError(f"--val-fraction={val_fraction!r}: allowed: a number in [0, 0.5]")
    if workers < 1:
        raise ValueError(f"--workers={workers!r}: allowed: an integer >= 1")
    if not text_field:
        raise ValueError("--text-field='': allowed: a non-empty field name")
    spec = parse_spec(tokenizer)
    out = Path(out).expanduser()
    check_out(out)
    files = expand_inputs(inputs)
    settings = _settings(files, tokenizer, text_field, val_fraction, shard_tokens)
    if fmt.is_prepared(out):
        meta = fmt.read_meta(out)
        if meta.get("settings") == settings:
            log(
                f"copus prepare: {out} is up to date ({meta['splits']['train']['num_tokens']} "
                "training tokens); nothing to do"
            )
            return meta
        raise ValueError(
            f"--out={str(out)!r}: holds a prepared folder of other inputs or "
            "settings; allowed: a new or empty folder (or remove it)"
        )
    partial = out.parent / f".{out.name}.partial"
    if partial.exists():
        log(f"copus prepare: removing {partial} left by an interrupted prepare; starting clean")
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        meta = _write(files, partial, spec, settings, text_field, val_fraction, workers, shard_tokens, progress)
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.replace(partial, out)
        fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def _build_tokenizer(spec, files, text_field, val_fraction):
    if spec.kind != "bpe":
        return load_tokenizer(spec)

    def train_docs() -> Iterator[str]:
        u = 0
        for path in files:
            for doc in documents(path, text_field):
                if not (val_fraction and _is_val(np.asarray([u]), val_fraction)[0]):
                    yield doc
                u += 1

    return train_bpe_tokenizer(train_docs(), spec.vocab_size)


def _write(
    files,
    root: Path,
    spec,
    settings: dict,
    text_field: str,
    val_fraction: float,
    workers: int,
    shard_tokens: int,
    progress: bool,
) -> dict:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = _build_tokenizer(spec, files, text_field, val_fraction)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: SplitWriter(root, s, dtype, shard_tokens) for s in fmt.SPLITS}
    bar = _Progress(sum(p.stat().st_size for p in files), progress)
    held: tuple[np.ndarray, np.ndarray] | None = None  # the last document, written at the end
    u = 0
    num_chars = 0
    for tokens, lengths, nbytes, nchars in _tokenized(files, text_field, tok, workers):
        num_chars += nchars
        bar.update(nbytes, int(tokens.size))
        if held is not None:
            writers["train"].write(*held)
        ends = np.cumsum(lengths)
        val = (
            _is_val(np.arange(u, u + len(lengths)), val_fraction)
            if val_fraction
            else np.zeros(len(lengths), dtype=bool)
        )
        last = len(lengths) - 1  # hold back the batch's last train document
        pieces = np.split(tokens, ends[:-1])
        for split, mask in (("val", val), ("train", ~val)):
            mask = mask.copy()
            if split == "train":
                mask[last] = False
            if mask.any():
                idx = np.flatnonzero(mask)
                writers[split].write(np.concatenate([pieces[i] for i in idx]), lengths[idx])
        held = None if val[last] else (pieces[last], lengths[last:])
        u += len(lengths)
    bar.close()
    if num_chars == 0:
        raise ValueError("INPUT: the inputs hold no text (every document is empty)")
    if held is not None:
        split = "val" if val_fraction and writers["val"].num_docs == 0 else "train"
        writers[split].write(*held)
    if writers["train"].num_tokens == 0:
        raise ValueError(
            f"INPUT: only {u} document(s): none left for training after the "
            f"validation split (--val-fraction={val_fraction}); allowed: more "
            "documents or --val-fraction=0"
        )
    docs = {s: w.close() for s, w in writers.items()}
    shard_list = writers["train"].shards + writers["val"].shards
    tok_file = None
    if isinstance(tok, HfTokenizer):
        tok_file = fmt.TOKENIZER_FILE
        _write_synced(root / tok_file, tok.to_json().encode())
    tok_sha = tok.sha256
    _write_synced(root / fmt.INDEX, json.dumps({"shards": shard_list, "docs": docs}, indent=1).encode())
    meta = {
        "format": fmt.FORMAT,
        "tokenizer": {
            "spec": spec.kind if spec.kind != "file" else "file",
            "sha256": tok_sha,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "file": tok_file,
        },
        "dtype": dtype.name,
        "splits": {s: {"num_tokens": w.num_tokens, "num_docs": w.num_docs} for s, w in writers.items()},
        "num_chars": num_chars,
        "settings": settings,
    }
    _write_synced(root / fmt.META, json.dumps(meta, indent=1).encode())
    return meta


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
