"""`copus export`: a DCP checkpoint (any dp/tp/pp layout) → a Hugging Face Llama / Qwen2 folder.

Output: `model.safetensors` (or `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`
when larger than `max_shard_bytes`) in `--dtype` (bfloat16, float16 or float32), `config.json`
(LlamaForCausalLM; Qwen2ForCausalLM for q/k/v biases without an o bias), `generation_config.json`,
and a tokenizer: the run's `tokenizer.json` + `tokenizer_config.json` when it has one, else the
byte tokenizer as a byte-level `tokenizer.json` (token id = UTF-8 byte value, as `ByteCodec`),
so serving stacks that need a tokenizer accept the folder.

Streaming: tensor by tensor. The DCP metadata is read once (at 70B on 256 ranks it is large:
reading it per tensor cost hours); the safetensors header is computed from it (names,
global shapes, the output dtype), then each tensor is loaded alone from the checkpoint (DCP
reassembles its FSDP / TP shards and pipeline stage; `no_dist`, one process), converted (names,
RoPE permutation, dtype: `hf_weights`) and appended to the file. Peak memory is one full tensor
in the stored dtype plus its converted copy, never the model (bench/export_memory.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from copus.core.specs.models import ModelShape
from copus.core.specs.resolve import get_model_shape
from copus.runtime.state import checkpoint as ckpt
from copus.runtime.state import hf_weights

MAX_SHARD_BYTES = 5 * 2**30
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """`run_dir/checkpoints/step-N` (verified), the latest good one when `step` is None."""
    root = run_dir / "checkpoints"
    if not run_dir.is_dir():
        raise ValueError(f"RUN_DIR={str(run_dir)!r}: no such folder; allowed: a copus run folder")
    if step is None:
        path = ckpt.find_latest(root, log=lambda _: None) if root.is_dir() else None
        if path is None:
            raise ValueError(
                f"RUN_DIR={str(run_dir)!r}: has no valid checkpoint; allowed: a run folder with checkpoints/step-N"
            )
        return path
    path = root / f"step-{step}"
    steps = [s for s, _ in ckpt.step_dirs(root)] if root.is_dir() else []
    if not path.is_dir():
        raise ValueError(
            f"--step={step}: no checkpoint step-{step} in {root}; allowed: {', '.join(map(str, steps)) or 'none'}"
        )
    problem = ckpt.verify(path)  # hashed on a few threads (checkpoint.verify)
    if problem is not None:
        raise ValueError(f"--step={step}: {problem}")
    return path


def model_tensors(path: Path, meta=None) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """copus name → (global shape, stored dtype) of every model tensor, from the DCP metadata
    (`meta`: already read)."""
    meta = ckpt.read_metadata(path) if meta is None else meta
    out = {
        key[len("model.") :]: (item.size, item.properties.dtype)
        for key, item in meta.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(item, "size")
    }
    if "tok_embeddings.weight" not in out:
        raise ValueError(f"{path}: holds no model tensors (tok_embeddings.weight missing)")
    return out


def load_tensors(path: Path, sizes: dict[str, tuple[torch.Size, torch.dtype]], meta=None) -> dict[str, torch.Tensor]:
    """The named model tensors, full size, on CPU (DCP reads and reassembles only their shards;
    `meta`: the checkpoint's metadata, read once by the caller, else read here)."""
    sd = {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in sizes.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        ckpt.load(path, {"model": sd}, check=False, metadata=meta)
    return sd


def load_full_model_state(path: Path) -> dict[str, torch.Tensor]:
    """All model tensors of a checkpoint, full size, on CPU (the whole model: for tests)."""
    return load_tensors(path, model_tensors(path))


def _permute_rope(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head from consecutive-pair order to half-split order (hf_weights)."""
    return hf_weights.permute_rope(w, head_dim)


def to_hf_state(sd: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """copus names/layouts → transformers names/layouts (contiguous tensors), whole model."""
    return dict(hf_weights.to_hf(name, sd[name], shape) for name in hf_weights.copus_names(shape))


def hf_config(shape: ModelShape, dtype: torch.dtype, eos_id: int | None) -> dict:
    """config.json of a LlamaForCausalLM (Qwen2ForCausalLM: q/k/v biases only) with copus's shape."""
    arch, model_type = hf_weights.hf_architecture(shape)
    rope: dict = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling is not None:
        rope = {"rope_type": "llama3", **dataclasses.asdict(shape.rope_scaling), "rope_theta": shape.rope_theta}
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_dim,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.seq_len,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": None if shape.rope_scaling is None else rope,
        "tie_word_embeddings": shape.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": shape.qkv_bias,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }
    if model_type == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.n_layers)
        del config["attention_bias"], config["mlp_bias"]
    return config


def generation_config(eos_id: int | None, seq_len: int) -> dict:
    """generation_config.json: the end-of-text id when the tokenizer has one (the byte tokenizer
    has none: generation stops at max_length), and the trained context as max_length."""
    out: dict = {"max_length": seq_len}
    if eos_id is not None:
        out["eos_token_id"] = eos_id
    return out


def byte_tokenizer_json() -> str:
    """A byte-level `tokenizer.json` whose ids are the UTF-8 byte values (copus's `ByteCodec`):
    GPT-2's ByteLevel byte→character alphabet, a 256-entry vocabulary, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    chars = _byte_chars()
    assert sorted(chars) == sorted(alphabet)
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _byte_chars() -> list[str]:
    """GPT-2's `bytes_to_unicode`: byte b → a printable character (index b)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def shard_groups(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive names in groups of at most `max_shard_bytes` (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for k, n in sizes.items():
        if groups[-1] and used + n > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(k)
        used += n
    return groups


def write_safetensors_stream(
    path: Path, entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, produce: Callable[[str], torch.Tensor]
) -> None:
    """A safetensors file written tensor by tensor: the header (names, shapes, offsets) first,
    then `produce(name)` for each entry in order; one tensor in memory at a time.
    Format: u64 little-endian header length, JSON header padded to 8 bytes, raw data."""
    item = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        n = math.prod(shape) * item
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for name, shape in entries:
            t = produce(name).to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: produced shape {list(t.shape)}, header says {list(shape)}")
            if t.numel():  # the tensor's own bytes through the buffer protocol: no copy
                fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            del t
        fh.flush()
        os.fsync(fh.fileno())


def _write_weights(
    out: Path,
    path: Path,
    shape: ModelShape,
    sizes: dict[str, tuple[torch.Size, torch.dtype]],
    dtype: torch.dtype,
    max_shard_bytes: int,
    meta=None,
) -> None:
    """Every tensor of `shape`, streamed from checkpoint `path` into one or more safetensors files
    (the DCP metadata `meta` read once for all of them)."""
    meta = ckpt.read_metadata(path) if meta is None else meta
    names = hf_weights.copus_names(shape)
    missing = [n for n in names if n not in sizes]
    if missing:
        raise ValueError(f"{path}: holds no tensor {missing[0]} of model {shape.name!r}")
    hf_of = {n: hf_weights.hf_name(n) for n in names}
    item = torch.empty((), dtype=dtype).element_size()
    nbytes = {n: math.prod(sizes[n][0]) * item for n in names}

    def produce(hf: str) -> torch.Tensor:
        name = by_hf[hf]
        t = load_tensors(path, {name: sizes[name]}, meta)[name]
        return hf_weights.to_hf(name, t, shape)[1]

    by_hf = {v: k for k, v in hf_of.items()}
    groups = shard_groups(nbytes, max_shard_bytes)
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    )
    for fname, group in zip(files, groups):
        write_safetensors_stream(out / fname, [(hf_of[n], tuple(sizes[n][0])) for n in group], dtype, produce)
    if len(groups) > 1:
        weight_map = {hf_of[n]: f for f, g in zip(files, groups) for n in g}
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}, indent=2) + "\n"
        )


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out={str(out)!r}: exists and is not an empty folder; allowed: a new or empty folder")


def trained_seq_len(run_dir: Path) -> int | None:
    """model.seq_len of the run folder's config.toml (None: unset or unreadable → the model's own)."""
    import tomllib

    try:
        value = tomllib.loads((run_dir / "config.toml").read_text())["model"]["seq_len"]
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def parse_dtype(text: str) -> torch.dtype:
    """`--dtype` → torch dtype; ValueError (one line) naming the allowed ones."""
    if text not in DTYPES:
        raise ValueError(f"--dtype={text!r} is invalid; allowed: {', '.join(DTYPES)}")
    return DTYPES[text]


def _write_tokenizer(out: Path, run_dir: Path, seq_len: int) -> int | None:
    """The run's tokenizer (or the byte-level one) + tokenizer_config.json; return the eos id."""
    tok_file = run_dir / "tokenizer.json"
    tok_cfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len}
    eos_id = None
    if tok_file.is_file():
        from tokenizers import Tokenizer

        from copus.runtime.data.tokenizer import HfTokenizer

        eos_id = HfTokenizer.from_file(tok_file).eos_id
        shutil.copyfile(tok_file, out / "tokenizer.json")
        if eos_id is not None:
            tok_cfg["eos_token"] = Tokenizer.from_file(str(tok_file)).id_to_token(eos_id)
    else:
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return eos_id


def _fsync_all(files: Iterable[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def export(
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    dtype: str | torch.dtype = "float32",
) -> Path:
    """Write the Hugging Face folder `out` from `run_dir`'s checkpoint in `dtype`, tensor by
    tensor; return the checkpoint used. Written into `.<out>.partial` and renamed, so `out` is
    complete or absent."""
    out_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser()
    _check_out(out)
    path = find_checkpoint(run_dir, step)
    state = json.loads((path / ckpt.TRAINER_STATE).read_text())
    meta = ckpt.read_metadata(path)  # once: every tensor's load reuses it
    sizes = model_tensors(path, meta)
    shape = dataclasses.replace(
        get_model_shape(state["model"], trained_seq_len(run_dir)), vocab_size=int(sizes["tok_embeddings.weight"][0][0])
    )
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        eos_id = _write_tokenizer(partial, run_dir, shape.seq_len)
        _write_weights(partial, path, shape, sizes, out_dtype, max_shard_bytes, meta)
        config = hf_config(shape, out_dtype, eos_id)
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (partial / "generation_config.json").write_text(
            json.dumps(generation_config(eos_id, shape.seq_len), indent=2) + "\n"
        )
        _fsync_all(partial.iterdir())
        if out.is_dir():
            out.rmdir()
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return path
