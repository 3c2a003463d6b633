"""A model shape from a Hugging Face style `config.json` (Llama, Qwen2, Mistral fields).

Every field copus meets is honoured or refused: a field copus cannot represent is one ValueError
line naming it (the CLI exits 2). Fields read (transformers' `LlamaConfig` / `Qwen2Config` /
`MistralConfig` names; transformers 5's `rope_parameters` and 4's `rope_scaling` alike):

    model_type           "llama", "mistral", "qwen2", "qwen3" (absent: read as llama); others refused
    head_dim             → explicit_head_dim optional even integer (default hidden_size / heads)
    attention_bias       → qkv_bias, o_bias  Llama: biases on q, k, v and o; qwen2: q, k, v always
    rope_scaling / rope_parameters  rope_type "default" or "llama3" (→ RopeScaling); others refused

    num_hidden_layers    → n_layers          required, integer ≥ 1
    hidden_size          → dim               required, integer ≥ 1, a multiple of the heads
    num_attention_heads  → n_heads           required, integer ≥ 1
    num_key_value_heads  → n_kv_heads        optional (default: num_attention_heads), divides heads
    intermediate_size    → ffn_dim           required, integer ≥ 1
    vocab_size           → vocab_size        required, integer ≥ 1
    tie_word_embeddings  → tie_embeddings    optional boolean (default false, as LlamaConfig)
    rope_theta           → rope_theta        optional number > 0 (default 10000)
    rms_norm_eps         → norm_eps          optional number > 0 (default 1e-5)

Configs copus cannot price are refused (one line, `check_priceable`): a mixture of experts (any
of `num_local_experts`, `num_experts`, `n_routed_experts`, `moe_intermediate_size` > 0: the
dense-block FLOP and memory counts do not hold) and a `model_type` outside `DENSE_MODEL_TYPES`.

Configs copus can price but its runtime model cannot represent are read, and the first such field
is kept as one line in `ModelShape.unsupported`: `copus plan` / `simulate` rank them, while
`copus train`, `--init-from` and `build_model` refuse them with that line (exit 2). They are:
QK-norm (`model_type` qwen3; `use_qk_norm`), a sliding window shorter than the sequence length
(Mistral's sliding_window, Qwen2's use_sliding_window / layer_types), mlp_bias, hidden_act other
than silu, attention_dropout > 0, partial_rotary_factor < 1, RoPE types other than default and
llama3.

The sequence length is not a model field: `seq_len` (the `--seq-len` flag) or 2048 (COPUS
§6.1). Pure: json + the dataclass; every bad file is one ValueError line naming the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from copus.core.specs.models import ModelShape, RopeScaling

DEFAULT_SEQ_LEN = 2048
_REQUIRED = (
    ("num_hidden_layers", "n_layers"),
    ("hidden_size", "dim"),
    ("num_attention_heads", "n_heads"),
    ("intermediate_size", "ffn_dim"),
    ("vocab_size", "vocab_size"),
)


DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
_QK_NORM_KEYS = ("qk_norm", "use_qk_norm", "qk_layernorm")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: field {key}={value!r} is invalid; allowed: a number > 0")
    return float(value)


def check_priceable(data: dict, where: str = "config.json") -> None:
    """ValueError (one line) for a mixture-of-experts config or an unknown `model_type`."""
    for key in MOE_FIELDS:
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            raise ValueError(
                f"{where}: field {key}={value!r}: a mixture-of-experts model, which copus "
                f"cannot price; allowed: a dense decoder ({', '.join(DENSE_MODEL_TYPES)})"
            )
    kind = data.get("model_type")
    if kind is not None and kind not in DENSE_MODEL_TYPES:
        raise ValueError(f"{where}: field model_type={kind!r} is invalid; allowed: {', '.join(DENSE_MODEL_TYPES)}")


def _unsupported(where: str, key: str, value: object, why: str, allowed: str) -> str:
    return f"{where}: field {key}={value!r} is not supported by copus's model ({why}); allowed: {allowed}"


def runtime_problem(data: dict, seq: int, where: str) -> str:
    """The first field copus's runtime model cannot represent, as one line ('' if none)."""
    if data.get("model_type") == "qwen3":
        return _unsupported(where, "model_type", "qwen3", "QK-norm", "'llama', 'mistral', 'qwen2'")
    for key in _QK_NORM_KEYS:
        if data.get(key):
            return _unsupported(where, key, data[key], "QK-norm", "false or absent")
    window = data.get("sliding_window")
    uses_window = data.get("use_sliding_window", data.get("model_type") == "mistral") or any(
        t != "full_attention" for t in data.get("layer_types") or ()
    )
    if uses_window and window is not None and not (isinstance(window, int) and window >= seq):
        return _unsupported(
            where,
            "sliding_window",
            window,
            f"a window shorter than seq_len={seq}",
            f"null, use_sliding_window=false, or a window >= seq_len={seq}",
        )
    checks = (
        ("mlp_bias", False, "MLP biases", "false"),
        ("hidden_act", "silu", "copus's MLP is SwiGLU", "'silu'"),
        ("attention_dropout", 0.0, "no dropout in copus", "0"),
        ("partial_rotary_factor", 1.0, "partial RoPE", "1.0"),
    )
    for key, ok, why, allowed in checks:
        if key == "hidden_act" and data.get(key) == "swish":  # transformers' ACT2FN: swish = silu
            continue
        if key in data and data[key] not in (ok, None):
            return _unsupported(where, key, data[key], why, allowed)
    return ""


def _rope(data: dict, where: str) -> tuple[float, RopeScaling | None, str]:
    """(rope_theta, scaling, problem) from transformers 5's `rope_parameters` or 4's `rope_theta`
    + `rope_scaling`; rope_type "default" / "llama3" are built, others are a runtime problem."""
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    key = "rope_parameters" if data.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise ValueError(f"{where}: field {key}={params!r} is invalid; allowed: an object or null")
    theta = _positive_number(
        {"rope_theta": params.get("rope_theta", data.get("rope_theta", 10000.0))}, "rope_theta", 10000.0, where
    )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None, ""
    if kind != "llama3":
        return (
            theta,
            None,
            _unsupported(
                where, f"{key}.rope_type", kind, "RoPE scaling copus does not implement", "'default' or 'llama3'"
            ),
        )
    vals = {k: _positive_number(params, k, float("nan"), f"{where}: {key}") for k in _LLAMA3_KEYS}
    if vals["high_freq_factor"] <= vals["low_freq_factor"]:
        raise ValueError(
            f"{where}: field {key}.high_freq_factor={vals['high_freq_factor']!r} is "
            f"invalid; allowed: > low_freq_factor={vals['low_freq_factor']!r}"
        )
    vals["original_max_position_embeddings"] = int(vals["original_max_position_embeddings"])
    return theta, RopeScaling(**vals), ""


def _head_dim(data: dict, dims: dict, where: str) -> int | None:
    """config.json's head_dim when it differs from hidden_size / heads (None: the default)."""
    if data.get("head_dim") is None:
        return None
    hd = _int_field(data, "head_dim", where)
    if hd % 2:
        raise ValueError(f"{where}: field head_dim={hd} is invalid; allowed: an even integer (RoPE pairs)")
    return None if hd * dims["n_heads"] == dims["dim"] else hd


def _attention_bias(data: dict, where: str) -> tuple[bool, bool]:
    """(qkv_bias, o_bias): qwen2 has q/k/v biases always (modeling_qwen2), Llama's
    attention_bias puts one on q, k, v and o."""
    if data.get("model_type") == "qwen2":
        return True, False
    bias = data.get("attention_bias", False)
    if not isinstance(bias, bool):
        raise ValueError(f"{where}: field attention_bias={bias!r} is invalid; allowed: true or false")
    return bias, bias


def shape_from_dict(data: dict, *, name: str, seq_len: int | None = None, where: str = "config.json") -> ModelShape:
    """The `ModelShape` of a parsed config (module docstring); ValueError names the bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: top level is {type(data).__name__}; allowed: a JSON object")
    check_priceable(data, where)
    dims = {attr: _int_field(data, key, where) for key, attr in _REQUIRED}
    kv = data.get("num_key_value_heads")
    dims["n_kv_heads"] = dims["n_heads"] if kv is None else _int_field(data, "num_key_value_heads", where)
    head_dim = _head_dim(data, dims, where)
    if head_dim is None and dims["dim"] % dims["n_heads"]:
        raise ValueError(
            f"{where}: field hidden_size={dims['dim']} is invalid; allowed: a multiple "
            f"of num_attention_heads={dims['n_heads']}"
        )
    if dims["n_heads"] % dims["n_kv_heads"]:
        raise ValueError(
            f"{where}: field num_key_value_heads={dims['n_kv_heads']} is invalid; "
            f"allowed: a divisor of num_attention_heads={dims['n_heads']}"
        )
    tie = data.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ValueError(f"{where}: field tie_word_embeddings={tie!r} is invalid; allowed: true or false")
    seq = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"--seq-len={seq!r} is invalid; allowed: an integer >= 1")
    theta, scaling, rope_problem = _rope(data, where)
    qkv_bias, o_bias = _attention_bias(data, where)
    return ModelShape(
        name=name,
        seq_len=seq,
        tie_embeddings=tie,
        rope_theta=theta,
        norm_eps=_positive_number(data, "rms_norm_eps", 1e-5, where),
        explicit_head_dim=head_dim,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        rope_scaling=scaling,
        unsupported=runtime_problem(data, seq, where) or rope_problem,
        **dims,
    )


def load_shape(path: str | Path, seq_len: int | None = None) -> ModelShape:
    """Read `path` (a config.json) into a `ModelShape` named after the file; one-line errors."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(
            f"--model {str(p)!r} cannot be read ({exc.strerror or exc}); allowed: a "
            "named shape or a readable config.json"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{p}: not valid JSON (line {exc.lineno}: {exc.msg}); allowed: a Hugging Face config.json"
        ) from None
    return shape_from_dict(data, name=str(p), seq_len=seq_len, where=str(p))
