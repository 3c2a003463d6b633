"""Tokenizer specs (`byte`, `bpe:N`, `PATH/tokenizer.json`), their identity hash, and the
model's vocabulary that follows them.

A tokenizer is identified by the sha256 of its canonical `tokenizer.json` text (Hugging Face
`tokenizers`' `to_str()`, which is what copus writes, so the file's sha256 equals it), or by the
word `byte` for the byte tokenizer (token = UTF-8 byte value, vocab 256). A prepared folder
(runtime/data/shards.py) records that identity; the trainer refuses a folder or checkpoint whose
tokenizer differs from the run's, and a tokenizer whose vocabulary exceeds the model's embedding
(`check_vocab`). Byte-level CPU shapes (vocab 256: `tiny`, `small`) instead grow their
vocabulary to the tokenizer's, rounded up to a multiple of 64 (`fit_vocab`), so a BPE tokenizer
trains on a CPU-sized model.

Documents are separated by the tokenizer's end-of-text token when it has one (`eos_id`), else by
the encoding of a blank line (`separator`), as the plain-text reader joins files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BYTE = "byte"
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
SPEC_ALLOWED = (
    "allowed: 'byte', 'bpe:N' (N >= 260), a path to a tokenizer.json file or a Hugging Face folder holding one"
)
VOCAB_MULTIPLE = 64
BYTE_VOCAB = 256


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """What `--tokenizer` / `data.tokenizer` asked for: kind 'byte', 'bpe' (train N tokens) or
    'file' (a tokenizer.json at `path`)."""

    kind: str
    vocab_size: int = 0
    path: str = ""


def parse_spec(text: str, key: str = "--tokenizer") -> TokenizerSpec:
    """'byte' | 'bpe:N' | PATH (an existing tokenizer.json); ValueError names the bad value."""
    text = text.strip()
    if text == BYTE:
        return TokenizerSpec(BYTE)
    if text.startswith("bpe:"):
        raw = text[4:]
        if not raw.isdigit() or int(raw) < 260:
            raise ValueError(f"{key}={text!r}: {SPEC_ALLOWED}")
        return TokenizerSpec("bpe", int(raw))
    path = tokenizer_file(text)
    if not path.is_file():
        raise ValueError(f"{key}={text!r}: no such tokenizer file; {SPEC_ALLOWED}")
    return TokenizerSpec("file", path=str(path))


def tokenizer_file(text: str) -> Path:
    """A tokenizer.json path as given, or `<folder>/tokenizer.json` for a Hugging Face folder."""
    path = Path(text).expanduser()
    return path / "tokenizer.json" if path.is_dir() else path


def config_eos(path: Path, tok) -> int | None:
    """The id of `eos_token` in the tokenizer_config.json beside `path` (a Hugging Face folder),
    else None."""
    try:
        eos = json.loads((path.parent / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):  # {"content": "</s>", ...} (AddedToken form)
        eos = eos.get("content")
    tid = tok.token_to_id(eos) if isinstance(eos, str) else None
    return None if tid is None else int(tid)


class HfTokenizer:
    """A `tokenizers.Tokenizer` with the identity and separator copus needs."""

    kind = "file"

    def __init__(self, tok, sha256: str, source: str = "") -> None:
        self._tok = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.sha256 = sha256
        self.source = source
        self.eos_id = find_eos(tok)
        self.name = f"tok-{sha256[:16]}"

    @classmethod
    def from_file(cls, path: str | Path) -> HfTokenizer:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_str(Path(path).read_text(encoding="utf-8"))
        except Exception as exc:  # noqa: BLE001 - any parse failure is a user mistake
            first = (str(exc).splitlines() or [""])[0][:120]
            raise ValueError(
                f"tokenizer {str(path)!r}: not a readable tokenizer.json file ({type(exc).__name__}: {first})"
            ) from None
        out = cls.from_hf(tok, str(path))
        eos = config_eos(Path(path), tok)  # a Hugging Face folder names its end-of-text token
        if eos is not None:
            out.eos_id = eos
        return out

    @classmethod
    def from_hf(cls, tok, source: str = "") -> HfTokenizer:
        """Wrap a `tokenizers.Tokenizer`; its identity is sha256(tok.to_str())."""
        return cls(tok, identity(tok), source)

    def to_json(self) -> str:
        return self._tok.to_str()

    @property
    def hf(self):
        return self._tok

    def encode(self, text: str, chunk_chars: int = 1 << 16) -> np.ndarray:
        """int32 ids of `text`, encoded in line-aligned chunks (batched, multi-threaded in Rust);
        for byte-level BPE (no prefix space) the chunks give the same ids as the whole text."""
        out = self.encode_batch(line_chunks(text, chunk_chars))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def separator(self) -> np.ndarray:
        """Tokens placed after every document: [eos_id], else the encoding of a blank line."""
        if self.eos_id is not None:
            return np.asarray([self.eos_id], dtype=np.int32)
        return self.encode("\n\n")


class ByteCodec:
    """UTF-8 bytes as tokens (vocab 256); documents are separated by a blank line (10, 10)."""

    kind = BYTE
    vocab_size = BYTE_VOCAB
    sha256 = BYTE
    eos_id = None
    name = BYTE

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return np.asarray(ids, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")

    def separator(self) -> np.ndarray:
        return np.asarray([10, 10], dtype=np.int32)


def line_chunks(text: str, chunk_chars: int) -> list[str]:
    """`text` cut into pieces of about `chunk_chars` characters, each ending at a newline where
    one exists (so a byte-level BPE encodes the pieces exactly as it encodes the whole)."""
    chunks, start = [], 0
    while start < len(text):
        end = min(start + chunk_chars, len(text))
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        chunks.append(text[start:end])
        start = end
    return chunks


def identity(tok) -> str:
    """sha256 of the canonical tokenizer.json text of a `tokenizers.Tokenizer`."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def find_eos(tok) -> int | None:
    """The id of the first of EOS_NAMES the tokenizer knows, else None."""
    for name in EOS_NAMES:
        tid = tok.token_to_id(name)
        if tid is not None:
            return int(tid)
    return None


def train_bpe_tokenizer(texts, vocab_size: int) -> HfTokenizer:
    """A byte-level BPE of `vocab_size` tokens (incl. `<|endoftext|>` = id 0) trained on the
    iterable `texts`; deterministic for the same texts (`tokenizers`' BpeTrainer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HfTokenizer.from_hf(Tokenizer.from_str(tok.to_str()))


def load_tokenizer(spec: TokenizerSpec) -> ByteCodec | HfTokenizer:
    """The byte codec or a tokenizer.json (a `bpe` spec must be trained: train_bpe_tokenizer)."""
    if spec.kind == BYTE:
        return ByteCodec()
    if spec.kind == "file":
        return HfTokenizer.from_file(spec.path)
    raise ValueError(f"tokenizer spec {spec!r} needs training text (copus prepare)")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def fit_vocab(shape, vocab_size: int, *, what: str = "the tokenizer"):
    """The model shape for a tokenizer of `vocab_size` tokens.

    A byte-level shape (vocab 256, the CPU shapes) follows the tokenizer: its vocabulary becomes
    `vocab_size` rounded up to a multiple of 64 (the extra rows are never a target). A published
    shape keeps its vocabulary, and a tokenizer larger than it is refused (`check_vocab`)."""
    if vocab_size <= shape.vocab_size and (shape.vocab_size != BYTE_VOCAB or vocab_size == BYTE_VOCAB):
        return shape
    if shape.vocab_size == BYTE_VOCAB:
        padded = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        return dataclasses.replace(shape, vocab_size=padded)
    check_vocab(vocab_size, shape.vocab_size, shape.name, what=what)
    return shape


def check_vocab(tok_vocab: int, model_vocab: int, model_name: str, *, what: str = "the tokenizer") -> None:
    """ValueError (one line, both sizes) when the tokenizer's ids do not fit the embedding."""
    if tok_vocab > model_vocab:
        raise ValueError(
            f"{what} has {tok_vocab} tokens but model {model_name!r} embeds "
            f"{model_vocab}; allowed: a tokenizer of at most {model_vocab} tokens"
        )
