"""Text → token windows → a deterministic global sample stream, split across data-parallel ranks.

The data position of a run is ONE integer, the global sample offset (design §6): step t consumes
the samples at stream positions offset .. offset + global_batch_size − 1 of an infinite stream of
per-epoch permutations, and each dp rank takes a contiguous block of them. Because the stream does
not depend on the batch, micro-batch or dp degree, changing any of them between steps neither skips
nor repeats a sample. Everything here is numpy; torch is not needed.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import numpy as np

from copus.runtime.data.cache import default_cache_dir
from copus.runtime.data.tokenizer import ByteCodec, HfTokenizer, line_chunks, train_bpe_tokenizer
from copus.atomic import atomic_write_text, atomic_writer

EMBEDDED = "embedded"
# Order of the package corpus (see src/copus/data/SOURCES.md).
EMBEDDED_FILES = ("shakespeare_plays.txt.gz", "gutenberg_selection.txt.gz")
DOC_SEPARATOR = "\n\n"


# --------------------------------------------------------------------------------------- text


def _read_one(path: Path | Traversable, limit: int) -> str:
    """Read a .txt or .txt.gz file as UTF-8, at most `limit` characters (0 = all)."""
    try:
        with path.open("rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
            with io.TextIOWrapper(stream, encoding="utf-8") as fh:
                return fh.read(limit) if limit > 0 else fh.read()
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:
        raise ValueError(
            f"data.source={str(path)!r}: cannot be read as UTF-8 text ({type(exc).__name__}: {exc})"
        ) from None


def _text_files(source: str) -> list[Path | Traversable]:
    if source == EMBEDDED:
        root = resources.files("copus") / "data"
        return [root / name for name in EMBEDDED_FILES]
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith((".txt", ".txt.gz")))
        if not files:
            raise ValueError(f"data.source={source!r}: the folder holds no .txt or .txt.gz files")
        return files
    if not path.exists():
        raise ValueError(
            f"data.source={source!r}: no such file or folder; allowed: 'embedded', "
            "a .txt/.txt.gz file or a folder of them"
        )
    if not path.name.endswith((".txt", ".txt.gz")):
        raise ValueError(f"data.source={source!r}: allowed: a .txt or .txt.gz file, a folder of them, or 'embedded'")
    return [path]


def load_text(source: str, max_chars: int = 0) -> str:
    """The training text: `"embedded"` (the package corpus), a .txt/.txt.gz file, or a folder of
    them (read in sorted order). Files are joined with a blank line. `max_chars` > 0 stops reading
    once that many characters are in hand (fast test slices). ValueError names the bad path."""
    if max_chars < 0:
        raise ValueError(f"data.max_chars={max_chars!r}: allowed: an integer >= 0")
    parts: list[str] = []
    num_chars = 0
    for path in _text_files(source):
        if parts:
            parts.append(DOC_SEPARATOR)
            num_chars += len(DOC_SEPARATOR)
            if max_chars and num_chars >= max_chars:
                break
        parts.append(_read_one(path, max_chars - num_chars if max_chars else 0))
        num_chars += len(parts[-1])
        if max_chars and num_chars >= max_chars:
            break
    text = "".join(parts)[:max_chars] if max_chars else "".join(parts)
    if not text.strip():
        raise ValueError(f"data.source={source!r}: the text is empty")
    return text


def check_source(source: str, probe_chars: int = 4096) -> None:
    """Fail fast, before any worker starts: every file of `source` exists and its first
    `probe_chars` characters read as UTF-8 text, and the text is not empty. ValueError names the
    bad path (as `load_text` would, much later, on every rank). A prepared folder: every shard
    is present with its size (checksums are verified by the trainer)."""
    from copus.runtime.data.shards import is_prepared, verify_folder

    if is_prepared(source):
        verify_folder(Path(source).expanduser(), checksums=False)
        return
    if any(_read_one(path, probe_chars).strip() for path in _text_files(source)):
        return
    load_text(source)  # only blank starts: read everything (raises if the text is empty)


def check_data(data_cfg) -> None:
    """Everything about [data] checkable before any worker starts: the source (`check_source`),
    a tokenizer.json path, and a prepared folder's tokenizer against data.tokenizer."""
    from copus.runtime.data.shards import is_prepared, read_meta

    check_source(data_cfg.source)
    if data_cfg.tokenizer not in ("auto", "byte", "bpe"):
        HfTokenizer.from_file(_tokenizer_path(data_cfg.tokenizer))
    if is_prepared(data_cfg.source):
        meta = read_meta(Path(data_cfg.source).expanduser())
        check_tokenizer_agrees(data_cfg.tokenizer, meta["tokenizer"]["sha256"], data_cfg.source)


# --------------------------------------------------------------------------------- tokenizers
# One tokenizer wrapper and one BPE trainer for the whole package: runtime/data/tokenizer.py.


def bpe_cache_key(text: str, vocab_size: int) -> str:
    """sha256 of (format version, tokenizers version, vocab size, text): same input → same file."""
    import tokenizers

    h = hashlib.sha256(f"copus-bpe-v2|{tokenizers.__version__}|{vocab_size}|".encode())
    h.update(text.encode("utf-8"))
    return h.hexdigest()[:24]


def train_bpe(text: str, vocab_size: int, cache_dir: str | Path | None = None) -> HfTokenizer:
    """Train (or load from cache) a byte-level BPE of `vocab_size` tokens on `text`, offline, with
    the package's one trainer (`tokenizer.train_bpe_tokenizer`: `<|endoftext|>` is id 0).

    Deterministic for a given text and vocab size; cached as `<cache_dir>/bpe-<hash>.json`, written
    atomically (temp file + rename), so concurrent ranks can race safely."""
    if vocab_size < 260:
        raise ValueError(f"data.bpe_vocab_size={vocab_size!r}: allowed: an integer >= 260 (256 bytes + merges)")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / f"bpe-{bpe_cache_key(text, vocab_size)}.json"
    if path.is_file():
        try:
            tok = HfTokenizer.from_file(path)
            tok.name = path.stem  # the stem names its cached encodings
            return tok
        except ValueError:  # a corrupt cache entry is rebuilt, not fatal
            pass
    tok = train_bpe_tokenizer(line_chunks(text, 1 << 16), vocab_size)
    cache.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, tok.to_json(), fsync=False)
    tok.name = path.stem
    return tok


def encode_cached(tokenizer: ByteCodec | HfTokenizer, text: str, cache_dir: str | Path | None = None) -> np.ndarray:
    """tokenizer.encode(text); a BPE encoding of a large text (seconds) is cached beside the
    tokenizer as `<tokenizer name>-tokens-<text hash>.npy`. Bytes are never cached (≈ 0.2 s for
    the whole embedded corpus)."""
    name = getattr(tokenizer, "name", "")
    if tokenizer.kind == "byte" or not name:
        return tokenizer.encode(text)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]
    path = cache / f"{name}-tokens-{digest}.npy"
    if path.is_file():
        try:
            tokens = np.load(path, allow_pickle=False)
            if tokens.dtype == np.int32 and tokens.ndim == 1:
                return tokens
        except (OSError, ValueError):
            pass
    tokens = tokenizer.encode(text)
    cache.mkdir(parents=True, exist_ok=True)
    with atomic_writer(path, "wb", fsync=False) as fh:
        np.save(fh, tokens, allow_pickle=False)
    return tokens


def build_tokenizer(
    kind: str, text: str = "", vocab_size: int = 4096, cache_dir: str | Path | None = None
) -> ByteCodec | HfTokenizer:
    """`"byte"`/`"auto"` → ByteCodec; `"bpe"` → train_bpe(text, vocab_size, cache_dir); a path
    → that tokenizer.json (cached encodings keyed by its identity)."""
    if kind in ("byte", "auto"):
        return ByteCodec()
    if kind == "bpe":
        return train_bpe(text, vocab_size, cache_dir)
    return HfTokenizer.from_file(_tokenizer_path(kind))


def _tokenizer_path(kind: str) -> Path:
    from copus.runtime.data.tokenizer import tokenizer_file

    path = tokenizer_file(kind)  # a Hugging Face folder: its tokenizer.json
    if not path.is_file():
        raise ValueError(
            f"data.tokenizer={kind!r}: no such tokenizer file; allowed: 'auto', "
            "'byte', 'bpe', a path to a tokenizer.json file or a Hugging Face folder"
        )
    return path


# ------------------------------------------------------------------------------------ samples


@dataclass(frozen=True, slots=True)
class TokenDataset:
    """Non-overlapping windows: sample i = tokens[i·L : i·L + L + 1] with L = seq_len (inputs are
    the first L tokens, targets the last L). len = (n − 1) // L, so the last window is complete."""

    tokens: np.ndarray
    seq_len: int

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len!r}: allowed: an integer >= 1")
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {self.tokens.shape}")

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        start = i * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def batch(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Samples `ids` stacked: int array [len(ids), seq_len + 1] (one gather, no Python loop)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"sample ids must lie in [0, {len(self)}), got [{ids.min()}, {ids.max()}]")
        idx = ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return self.tokens[idx]


def split_train_val(
    tokens: np.ndarray, val_fraction: float, seq_len: int, min_val_windows: int = 0
) -> tuple[TokenDataset, TokenDataset]:
    """Train = the first (1 − val_fraction) of the tokens, val = the last val_fraction, contiguous,
    so no validation token appears in any training window. val_fraction = 0 → empty val set.

    With val_fraction > 0 the split is grown to hold `min_val_windows` windows (the evaluation's
    eval.num_samples), as long as that keeps at most half of the tokens for validation."""
    n = len(tokens)
    n_val = int(np.ceil(n * val_fraction)) if val_fraction > 0 else 0
    if val_fraction > 0:
        wanted = max(min_val_windows, 1) * seq_len + 1
        n_val = max(n_val, min(wanted, n // 2))
        n_val = max(n_val, seq_len + 1)
    train, val = TokenDataset(tokens[: n - n_val], seq_len), TokenDataset(tokens[n - n_val :], seq_len)
    if len(train) < 1:
        raise ValueError(
            f"the text has {n} tokens: too few for one training sample of "
            f"seq_len={seq_len} after the validation split ({n_val} tokens)"
        )
    return train, val


class GlobalSampler:
    """An infinite stream of sample ids: epoch e is a permutation of range(num_samples) drawn by
    numpy's Generator seeded with (seed, e). The only state a run keeps is the stream position
    (the global sample offset); `ids(offset, count)` reads positions offset .. offset+count−1."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples!r}: allowed: an integer >= 1")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            rng = np.random.default_rng([self.seed, epoch])
            self._cache[epoch] = rng.permutation(self.num_samples)
        return self._cache[epoch]

    def epoch(self, offset: int) -> int:
        return offset // self.num_samples

    def ids(self, offset: int, count: int) -> np.ndarray:
        from copus.runtime.data.sampler import epoch_walk

        return epoch_walk(
            offset, count, self.num_samples, lambda epoch, start, stop: self.permutation(epoch)[start:stop]
        )


def local_slice(global_ids: np.ndarray, dp_rank: int, dp: int) -> np.ndarray:
    """This dp rank's contiguous block of a step's global ids: [r·B/dp, (r+1)·B/dp)."""
    n = len(global_ids)
    if dp < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank}, dp={dp}: allowed: 0 <= dp_rank < dp")
    if n % dp:
        raise ValueError(f"global_batch_size={n} is not a multiple of dp={dp}")
    per = n // dp
    return global_ids[dp_rank * per : (dp_rank + 1) * per]


def build_datasets(
    data_cfg,
    seq_len: int,
    vocab_size: int,
    cache_dir: str | Path | None = None,
    *,
    min_val_windows: int = 0,
    verify: bool = True,
    share: tuple[int, int] = (0, 1),
    agree=None,
):
    """config.DataConfig → (train, val, tokenizer). ValueError if the tokenizer's vocabulary does
    not fit the model's (`vocab_size`; a byte-level model of 256 follows any tokenizer, see
    runtime/tokenizer.fit_vocab). BPE is trained on the training part of the text only. A
    prepared folder (copus prepare) is streamed from its shards (`open_prepared`; `share` and
    `agree` split its checksums across the ranks: `shards.verify_folder`)."""
    from copus.runtime.data.shards import is_prepared

    if is_prepared(data_cfg.source):
        return open_prepared(data_cfg, seq_len, vocab_size, verify=verify, share=share, agree=agree)
    text = load_text(data_cfg.source, data_cfg.max_chars)
    if data_cfg.tokenizer == "bpe":
        cut = len(text) - int(len(text) * data_cfg.val_fraction)
        tokenizer = build_tokenizer("bpe", text[:cut], data_cfg.bpe_vocab_size, cache_dir)
    else:
        tokenizer = build_tokenizer(data_cfg.tokenizer)
    if tokenizer.vocab_size > vocab_size and vocab_size != 256:
        key = "data.bpe_vocab_size" if data_cfg.tokenizer == "bpe" else "data.tokenizer"
        val = data_cfg.bpe_vocab_size if data_cfg.tokenizer == "bpe" else data_cfg.tokenizer
        raise ValueError(
            f"{key}={val!r}: the tokenizer has {tokenizer.vocab_size} tokens; "
            f"allowed: at most the model's vocab_size={vocab_size}"
        )
    tokens = encode_cached(tokenizer, text, cache_dir)
    train, val = split_train_val(tokens, data_cfg.val_fraction, seq_len, min_val_windows)
    return train, val, tokenizer


def open_prepared(
    data_cfg, seq_len: int, vocab_size: int, *, verify: bool = True, share: tuple[int, int] = (0, 1), agree=None
):
    """A prepared folder → (train windows, val windows, its tokenizer), after checking the shard
    sizes (and sha256 when `verify`), that data.tokenizer agrees with the folder's tokenizer and
    that the tokenizer fits the model (one line naming both hashes / sizes)."""
    from copus.runtime.data import shards
    from copus.runtime.data.tokenizer import check_vocab

    root = Path(data_cfg.source).expanduser()
    meta = shards.read_meta(root)
    shards.verify_folder(root, checksums=verify, share=share, agree=agree)
    info = meta["tokenizer"]
    tok = HfTokenizer.from_file(root / info["file"]) if info.get("file") else ByteCodec()
    check_tokenizer_agrees(data_cfg.tokenizer, info["sha256"], str(root))
    if vocab_size != 256:
        check_vocab(info["vocab_size"], vocab_size, "this run's", what=f"the tokenizer of {root}")
    if data_cfg.max_chars:
        raise ValueError(
            f"data.max_chars={data_cfg.max_chars!r}: allowed: 0 with a prepared "
            f"folder ({root}); prepare a smaller input instead"
        )
    train = shards.open_split(root, "train", seq_len)
    val = shards.open_split(root, "val", seq_len)
    if len(train) < 1:
        raise ValueError(
            f"data.source={str(root)!r}: {len(train.tokens)} training tokens: too "
            f"few for one sample of seq_len={seq_len}"
        )
    return train, val, tok


def check_tokenizer_agrees(setting: str, folder_sha: str, where: str) -> None:
    """data.tokenizer ('auto', 'byte', or a tokenizer.json path) against a folder's tokenizer."""
    if setting == "auto":
        return
    if setting == "bpe":
        raise ValueError(
            f"data.tokenizer='bpe': a prepared folder ({where}) brings its own "
            "tokenizer; allowed: 'auto', or the tokenizer it was prepared with"
        )
    mine = "byte" if setting == "byte" else HfTokenizer.from_file(_tokenizer_path(setting)).sha256
    if mine != folder_sha:
        raise ValueError(
            f"data.tokenizer={setting!r} (sha256 {mine[:16]}) differs from the "
            f"tokenizer {where} was prepared with (sha256 {folder_sha[:16]}); "
            "allowed: 'auto' or that tokenizer"
        )
