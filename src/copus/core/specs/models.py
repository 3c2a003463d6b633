"""Model shapes by name: the numbers the planner, memory model and runtime model share.

Real shapes are taken from the public model configurations (Llama 3.2 3B, Llama 2 7B/13B,
Qwen 2.5 32B, TinyLlama 1.1B), the models COPUS (arXiv 2604.26687) and Lau et al. trained.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (`rope_type = "llama3"`, transformers'
    `_compute_llama3_parameters`): wavelengths longer than original_max_position_embeddings /
    low_freq_factor are divided by `factor`, shorter than .../high_freq_factor kept, and those
    between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention."""

    name: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    seq_len: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    explicit_head_dim: int | None = None  # config.json's head_dim when not dim / n_heads (Qwen3)
    qkv_bias: bool = False  # biases on q, k, v (Qwen2; Llama attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    rope_scaling: RopeScaling | None = None
    # a config.json field the planner can price but copus's model cannot build (one line naming
    # it, core/specs/hf_config.py); "" = buildable. The runtime refuses such a shape.
    unsupported: str = ""

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    def layer_params(self) -> int:
        """Parameters of one block: q,o (dim·heads·head_dim each) + k,v (dim·kv·head_dim each)
        + the attention biases present + 3·dim·ffn + 2 norms."""
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        attn = 2 * self.dim * q + 2 * self.dim * kv
        attn += (q + 2 * kv) * self.qkv_bias + self.dim * self.o_bias
        mlp = 3 * self.dim * self.ffn_dim
        return attn + mlp + 2 * self.dim

    def embedding_params(self) -> int:
        """Token embedding + output head (+ final norm); the head is shared when tied."""
        heads = 1 if self.tie_embeddings else 2
        return heads * self.vocab_size * self.dim + self.dim

    def num_params(self) -> int:
        return self.n_layers * self.layer_params() + self.embedding_params()

    def flops_per_token(self) -> float:
        """Training FLOPs per token ≈ 6·N + 12·L·dim·seq (Kaplan et al. 2020; PaLM App. B)."""
        return 6.0 * self.num_params() + 12.0 * self.n_layers * self.dim * self.seq_len

    def model_flops_per_token(self) -> float:
        """Model FLOPs per trained token for MFU: 6·N' + 12·L·dim·seq, N' = parameters less the
        input embedding (a lookup, not a matmul; tied weights count once, as the head). The
        count of torchtitan's `get_num_flop_per_token` and PaLM (Chowdhery et al. 2022, App. B:
        6N plus 6·L·H·Q·T forward+backward attention FLOPs per token with causal masking
        ignored, i.e. 12·L·dim·seq for T = seq, H·Q = dim); activation recomputation is not
        counted (model FLOPs, not hardware FLOPs)."""
        embedding = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return 6.0 * (self.num_params() - embedding) + 12.0 * self.n_layers * self.dim * self.seq_len


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        # CPU default: ~1.7M parameters, byte-level vocabulary.
        ModelShape(name="tiny", n_layers=4, dim=192, n_heads=6, n_kv_heads=2, ffn_dim=512, vocab_size=256, seq_len=128),
        ModelShape(
            name="small", n_layers=8, dim=384, n_heads=8, n_kv_heads=4, ffn_dim=1024, vocab_size=256, seq_len=256
        ),
        ModelShape(
            name="tinyllama-1.1b",
            n_layers=22,
            dim=2048,
            n_heads=32,
            n_kv_heads=4,
            ffn_dim=5632,
            vocab_size=32000,
            seq_len=2048,
        ),
        ModelShape(
            name="llama-3.2-3b",
            n_layers=28,
            dim=3072,
            n_heads=24,
            n_kv_heads=8,
            ffn_dim=8192,
            vocab_size=128256,
            seq_len=2048,
            tie_embeddings=True,
            rope_theta=500000.0,
        ),
        ModelShape(
            name="llama-2-7b",
            n_layers=32,
            dim=4096,
            n_heads=32,
            n_kv_heads=32,
            ffn_dim=11008,
            vocab_size=32000,
            seq_len=2048,
        ),
        ModelShape(
            name="llama-2-13b",
            n_layers=40,
            dim=5120,
            n_heads=40,
            n_kv_heads=40,
            ffn_dim=13824,
            vocab_size=32000,
            seq_len=2048,
        ),
        ModelShape(
            name="qwen-2.5-32b",
            n_layers=64,
            dim=5120,
            n_heads=40,
            n_kv_heads=8,
            ffn_dim=27648,
            vocab_size=152064,
            seq_len=2048,
            rope_theta=1000000.0,
        ),
    )
}
