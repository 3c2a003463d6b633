"""Tensor names and layouts between copus's model and transformers' Llama / Qwen2 (both ways).

    tok_embeddings.weight                 model.embed_tokens.weight
    layers.i.attention.w{q,k,v,o}.weight  model.layers.i.self_attn.{q,k,v,o}_proj.weight
    layers.i.attention.w{q,k,v,o}.bias    model.layers.i.self_attn.{q,k,v,o}_proj.bias (if any)
    layers.i.feed_forward.w1 / w3 / w2    model.layers.i.mlp.gate_proj / up_proj / down_proj
    layers.i.attention_norm / ffn_norm    model.layers.i.input_layernorm / post_attention_layernorm
    norm.weight / output.weight           model.norm.weight / lm_head.weight (absent when tied)

Everything else already agrees: RMSNorm y = x·rsqrt(mean(x²) + eps)·w in fp32 with the same eps,
SwiGLU w2(silu(w1 x)·w3 x), GQA by repeating each kv head over consecutive query heads,
frequencies θ^(−2i/d) (llama3-scaled alike), scale 1/√d. The one difference is RoPE's pairing:
copus rotates consecutive pairs (x_{2i}, x_{2i+1}) (Su et al.; Meta's Llama code), transformers
rotates halves (x_i, x_{i+d/2}). Permuting the rows of wq and wk (and their biases) inside each
head — HF row j < d/2 takes copus row 2j, row d/2 + j takes row 2j + 1 — maps one onto the other
exactly (q·k per head is unchanged because q and k are permuted alike); this is the permutation
of transformers' `convert_llama_weights_to_hf.py`. Pure tensor reshapes: one tensor at a time, so
the export streams and the import reads only what a rank needs.
"""

from __future__ import annotations

import torch

from copus.core.specs.models import ModelShape

LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_ROPE_ROWS = ("attention.wq.", "attention.wk.")
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def copus_names(shape: ModelShape) -> list[str]:
    """Every tensor name of copus's full model for `shape`, in module order."""
    names = ["tok_embeddings.weight"]
    for i in range(shape.n_layers):
        for src in LAYER_MAP:
            if src.endswith(".bias") and not (shape.o_bias if ".wo." in src else shape.qkv_bias):
                continue
            names.append(f"layers.{i}.{src}")
    names.append("norm.weight")
    if not shape.tie_embeddings:
        names.append("output.weight")
    return names


def hf_name(name: str) -> str:
    """The transformers name of copus tensor `name`."""
    if name in _TOP:
        return _TOP[name]
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{LAYER_MAP[rest]}"


def _is_rope_rows(name: str) -> bool:
    return any(k in name for k in _ROPE_ROWS)


def permute_rope(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head from consecutive-pair order to half-split order (module doc)."""
    flat = w.reshape(w.shape[0], -1)
    heads = flat.shape[0] // head_dim
    out = flat.view(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(flat.shape)
    return out.reshape(w.shape)


def unpermute_rope(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `permute_rope`: half-split order back to consecutive pairs."""
    flat = w.reshape(w.shape[0], -1)
    heads = flat.shape[0] // head_dim
    out = flat.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(flat.shape)
    return out.reshape(w.shape)


def to_hf(name: str, tensor: torch.Tensor, shape: ModelShape) -> tuple[str, torch.Tensor]:
    """(transformers name, tensor in transformers' layout), contiguous."""
    if _is_rope_rows(name):
        tensor = permute_rope(tensor, shape.head_dim)
    return hf_name(name), tensor.contiguous()


def from_hf(name: str, tensor: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """copus tensor `name` from its transformers tensor (see `hf_name`), contiguous."""
    if _is_rope_rows(name):
        tensor = unpermute_rope(tensor, shape.head_dim)
    return tensor.contiguous()


def hf_architecture(shape: ModelShape) -> tuple[str, str]:
    """(architecture, model_type): Qwen2 for q/k/v biases without an o bias, else Llama."""
    if shape.qkv_bias and not shape.o_bias:
        return "Qwen2ForCausalLM", "qwen2"
    return "LlamaForCausalLM", "llama"
