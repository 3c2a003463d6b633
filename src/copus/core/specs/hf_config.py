"""A model shape from a Hugging Face style `config.json` (Llama, Qwen2, Mistral fields).

Fields read (transformers' `LlamaConfig` / `Qwen2Config` / `MistralConfig` names):

    num_hidden_layers    → n_layers          required, integer ≥ 1
    hidden_size          → dim               required, integer ≥ 1, a multiple of the heads
    num_attention_heads  → n_heads           required, integer ≥ 1
    num_key_value_heads  → n_kv_heads        optional (default: num_attention_heads), divides heads
    intermediate_size    → ffn_dim           required, integer ≥ 1
    vocab_size           → vocab_size        required, integer ≥ 1
    tie_word_embeddings  → tie_embeddings    optional boolean (default false, as LlamaConfig)
    rope_theta           → rope_theta        optional number > 0 (default 10000)
    rms_norm_eps         → norm_eps          optional number > 0 (default 1e-5)

Configs copus cannot price are refused (one line): a mixture of experts (any of
`num_local_experts`, `num_experts`, `n_routed_experts`, `moe_intermediate_size` > 0: the
dense-block FLOP and memory counts do not hold) and a `model_type` outside `DENSE_MODEL_TYPES`.

The sequence length is not a model field: `seq_len` (the `--seq-len` flag) or 2048 (COPUS
§6.1). Pure: json + the dataclass; every bad file is one ValueError line naming the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from copus.core.specs.models import ModelShape

DEFAULT_SEQ_LEN = 2048
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
_REQUIRED = (("num_hidden_layers", "n_layers"), ("hidden_size", "dim"),
             ("num_attention_heads", "n_heads"), ("intermediate_size", "ffn_dim"),
             ("vocab_size", "vocab_size"))


def is_config_path(name: str) -> bool:
    """Whether a `--model` value names a config.json file rather than a named shape."""
    return name.endswith(".json")


def _int_field(data: dict, key: str, where: str) -> int:
    if key not in data:
        raise ValueError(f"{where}: field {key!r} is missing; allowed: an integer >= 1")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: field {key}={value!r} is invalid; allowed: an integer >= 1")
    return value


def _positive_number(data: dict, key: str, default: float, where: str) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: field {key}={value!r} is invalid; allowed: a number > 0")
    return float(value)


def check_priceable(data: dict, where: str = "config.json") -> None:
    """ValueError (one line) for a mixture-of-experts config or an unknown `model_type`."""
    for key in MOE_FIELDS:
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            raise ValueError(f"{where}: field {key}={value!r}: a mixture-of-experts model, which copus "
                             f"cannot price; allowed: a dense decoder ({', '.join(DENSE_MODEL_TYPES)})")
    kind = data.get("model_type")
    if kind is not None and kind not in DENSE_MODEL_TYPES:
        raise ValueError(f"{where}: field model_type={kind!r} is invalid; allowed: "
                         f"{', '.join(DENSE_MODEL_TYPES)}")


def shape_from_dict(data: dict, *, name: str, seq_len: int | None = None,
                    where: str = "config.json") -> ModelShape:
    """The `ModelShape` of a parsed config (module docstring); ValueError names the bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: top level is {type(data).__name__}; allowed: a JSON object")
    check_priceable(data, where)
    dims = {attr: _int_field(data, key, where) for key, attr in _REQUIRED}
    kv = data.get("num_key_value_heads")
    dims["n_kv_heads"] = dims["n_heads"] if kv is None else _int_field(data, "num_key_value_heads", where)
    if dims["dim"] % dims["n_heads"]:
        raise ValueError(f"{where}: field hidden_size={dims['dim']} is invalid; allowed: a multiple "
                         f"of num_attention_heads={dims['n_heads']}")
    if dims["n_heads"] % dims["n_kv_heads"]:
        raise ValueError(f"{where}: field num_key_value_heads={dims['n_kv_heads']} is invalid; "
                         f"allowed: a divisor of num_attention_heads={dims['n_heads']}")
    tie = data.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ValueError(f"{where}: field tie_word_embeddings={tie!r} is invalid; allowed: true or false")
    seq = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"--seq-len={seq!r} is invalid; allowed: an integer >= 1")
    return ModelShape(name=name, seq_len=seq, tie_embeddings=tie,
                      rope_theta=_positive_number(data, "rope_theta", 10000.0, where),
                      norm_eps=_positive_number(data, "rms_norm_eps", 1e-5, where), **dims)


def load_shape(path: str | Path, seq_len: int | None = None) -> ModelShape:
    """Read `path` (a config.json) into a `ModelShape` named after the file; one-line errors."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--model {str(p)!r} cannot be read ({exc.strerror or exc}); allowed: a "
                         "named shape or a readable config.json") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON (line {exc.lineno}: {exc.msg}); allowed: a "
                         "Hugging Face config.json") from None
    return shape_from_dict(data, name=str(p), seq_len=seq_len, where=str(p))
