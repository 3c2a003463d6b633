"""Input files of `copus prepare` → a deterministic stream of documents.

Formats: `.txt` / `.txt.gz` (UTF-8; cut into documents of about `TXT_DOC_CHARS` characters at
blank lines, the blank line itself dropped: the tokenizer's separator takes its place, so the
byte tokenizer reproduces the text exactly), `.jsonl` / `.jsonl.gz` (one JSON object per line,
the document is its `text_field` string; blank lines skipped), `.parquet` (the `text_field`
column, one document per row; needs the optional `pyarrow`). A folder stands for its files of
these kinds, in sorted order. Every problem is a ValueError naming the file (and line or row).
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet")
ALLOWED = "allowed: .txt, .txt.gz, .jsonl, .jsonl.gz or .parquet files, or folders of them"
TXT_DOC_CHARS = 1 << 16


def expand_inputs(inputs: list[str]) -> list[Path]:
    """The input files, checked before anything is written: each exists, is readable, has an
    allowed suffix and is not empty; folders expand to their allowed files (sorted)."""
    if not inputs:
        raise ValueError(f"INPUT: none given; {ALLOWED}")
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(SUFFIXES))
            if not found:
                raise ValueError(f"INPUT={raw!r}: the folder holds no input files; {ALLOWED}")
            files.extend(found)
        elif not path.exists():
            raise ValueError(f"INPUT={raw!r}: no such file or folder; {ALLOWED}")
        elif not path.name.endswith(SUFFIXES):
            raise ValueError(f"INPUT={raw!r}: unknown file type; {ALLOWED}")
        else:
            files.append(path)
    for path in files:
        try:
            with open(path, "rb") as fh:
                fh.read(1)
        except OSError as exc:
            raise ValueError(f"INPUT={str(path)!r}: cannot be read ({exc.strerror or exc})") from None
        if path.stat().st_size == 0:
            raise ValueError(f"INPUT={str(path)!r}: the file is empty; {ALLOWED}")
        if path.name.endswith(".parquet"):
            _pyarrow(path)
    return files


def _pyarrow(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"INPUT={str(path)!r}: reading .parquet needs pyarrow (pip install 'copus[parquet]')"
        ) from None
    return pq


def _text_stream(path: Path) -> io.TextIOWrapper:
    raw = open(path, "rb")  # noqa: SIM115 - closed by the wrapper
    stream = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
    return io.TextIOWrapper(stream, encoding="utf-8", newline="")


def _txt_documents(path: Path) -> Iterator[str]:
    """Blocks of ≥ TXT_DOC_CHARS characters cut at a blank line ("\n\n", dropped)."""
    buf = ""
    with _text_stream(path) as fh:
        while block := fh.read(TXT_DOC_CHARS):
            buf += block
            while len(buf) >= TXT_DOC_CHARS:
                cut = buf.find("\n\n", TXT_DOC_CHARS)
                if cut < 0:
                    break
                yield buf[:cut]
                buf = buf[cut + 2 :]
    if buf:
        yield buf


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with _text_stream(path) as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or text_field not in obj:
                keys = ", ".join(list(obj)[:8]) if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(
                    f"{path}:{lineno}: no {text_field!r} field (found: {keys}); "
                    "allowed: --text-field naming a string field"
                )
            text = obj[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, allowed: a string")
            yield text


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    pq = _pyarrow(path)
    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise ValueError(
            f"{path}: no column {text_field!r} (found: "
            f"{', '.join(pf.schema_arrow.names[:8])}); allowed: --text-field "
            "naming a string column"
        )
    row = 0
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}: row {row}: column {text_field!r} is {type(text).__name__}, allowed: a string"
                )
            yield text


def documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one input file, in file order. ValueError names the file."""
    name = path.name
    try:
        if name.endswith((".txt", ".txt.gz")):
            yield from _txt_documents(path)
        elif name.endswith((".jsonl", ".jsonl.gz")):
            yield from _jsonl_documents(path, text_field)
        else:
            yield from _parquet_documents(path, text_field)
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:
        raise ValueError(f"INPUT={str(path)!r}: cannot be read as UTF-8 ({type(exc).__name__}: {exc})") from None
