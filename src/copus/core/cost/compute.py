"""Compute time of one micro-batch on one pipeline stage from the hardware's physical constants.

A GPU profile with `HardwareProfile.gemm_efficiency` set is priced by a roofline per kernel class
(Williams et al. 2009, summed rather than maxed: a kernel's time is its FLOP time plus its HBM
traffic time, which gives the "achieved fraction = η·I/(I + I_half)" efficiency curve with
I = FLOPs per byte of the GEMM and I_half = η·peak/HBM bandwidth, the ridge point):

    GEMMs      t = F_gemm/(η_g·P) + e·3·Σ_g (M·K_g + K_g·N_g + M·N_g)/BW
                   the block's seven projections (wq, wk, wv, wo, w1, w3, w2) at M = b·s tokens,
                   column-parallel ones split N by tp, row-parallel ones K; forward, input
                   gradient and weight gradient each touch the three matrices once (the 3);
                   F_gemm = 6·M·Σ K_g·N_g / tp. η_g = maximum achievable matmul FLOPS / peak,
                   measured per GPU generation (S. Bekman, ml-engineering, "Maximum Achievable
                   Matmul FLOPS comparison table": A100 SXM 85.9 %, H100 SXM 80.1 %, MI250X
                   one GCD 76.7 %); narrow GEMMs (large tp, small b·s) lose to the byte term.
    attention  flash: t = 7·b·s²·q/tp / (η_a·P)  causal FLOPs executed (forward 2·b·s²·q,
                   backward 2.5× forward, FlashAttention-2's count, Dao 2023 §4.1), η_a the
                   fraction of peak FlashAttention-2 reaches per generation (Dao 2023 Fig. 5–6:
                   ≈ 0.6 on A100; FlashAttention-3 §1: 35 % on H100);
               eager: the QKᵀ and AV batched GEMMs non-causal, 12·b·s²·q/tp at η_g (the score
                   traffic is `StepTimeModel.attention_scores_s`)
    elementwise t = b·s·h·E/t_sp / BW   norms, residual adds, activation function, rotary
                   embedding: E bytes per hidden element per block, counted per software stack
                   (`ELEMENTWISE_BYTES`); t_sp = tp with sequence parallel
    head       the output projection as a GEMM (K = h, N = V/tp) + its loss, M·V/tp·LOSS_BYTES/BW

The sum is returned in "GEMM-equivalent FLOPs" X (time × η_g·P) so that the fitted coefficient
`StepTimeParams.s_per_flop` = 1/(κ·η_g·P) scales every term at once: κ (`COMPUTE_EFFICIENCY`,
`core.cost.throughput`) is the one fitted, hardware-independent factor of the compute term (the
share of the summed roofline an end-to-end step reaches: launch gaps, GEMM tails, host work).
A profile without `gemm_efficiency` (the CPU's) keeps the plain FLOP count (X = F).
"""

from __future__ import annotations

import numpy as np

# Bytes moved per hidden element per block (forward + backward) by the memory-bound ops.
# fsdp2: copus's / torchtitan's eager Llama block, counted: 2 RMSNorms in fp32 (upcast, square,
# mean, scale, downcast, weight: 36 B forward, ~72 backward, 216 for both), rotary embeddings on
# q and k in fp32 (40 B per q/k element, ×1.25 for 8 KV heads of 32: 50), SwiGLU on the f-wide
# intermediate (26 B per f element, f ≈ 3.5h: 91), 2 residual adds (24), the attention output
# transpose (8): 390. megatron: fused kernels, 2 norms × 6 passes + 2 residual adds × 6 passes,
# bf16 (`core.cost.megatron_cost`).
ELEMENTWISE_BYTES = {"fsdp2": 390.0, "megatron": 48.0}
LOSS_BYTES = 16.0  # bytes per logit: bf16 logits read, fp32 log-softmax written and read back
FLASH_FLOPS = 7.0  # executed causal FlashAttention-2 FLOPs, × b·s²·q/tp (module docstring)
EAGER_FLOPS = 12.0  # non-causal QKᵀ + AV, forward + backward, × b·s²·q/tp


def _f(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def gemm_dims(shape) -> tuple[list[tuple[float, float, bool]], float]:
    """The block's projections as (K, N, column_parallel) and Σ K·N (matmul parameters)."""
    h, f = float(shape.dim), float(shape.ffn_dim)
    q = float(shape.n_heads * shape.head_dim)
    kv = float(shape.n_kv_heads * shape.head_dim)
    dims = [(h, q, True), (h, kv, True), (h, kv, True), (q, h, False), (h, f, True), (h, f, True), (f, h, False)]
    return dims, sum(k * n for k, n, _ in dims)


def block_terms(model, tp, micro_batch_size, sequence_parallel=False) -> dict[str, np.ndarray]:
    """GEMM, attention and element-wise seconds of one block and one micro-batch at κ = 1."""
    hw, s = model.hardware, model.shape
    tp_f, b = _f(tp), _f(micro_batch_size)
    peak = hw.sustained_flops * hw.gemm_efficiency
    e = float(model.dtype_bytes)
    M = b * s.seq_len
    dims, weights = gemm_dims(s)
    sum_kn = sum(k + n for k, n, _ in dims)  # Σ (K + N) split: each term has one sharded side
    sharded = sum(n if col else k for k, n, col in dims)
    edge = (sum_kn - sharded) + sharded / tp_f
    gemm = 6.0 * M * weights / tp_f / peak + 3.0 * e * (M * edge + weights / tp_f) / hw.memory_bw
    q = float(s.n_heads * s.head_dim)
    scores = b * float(s.seq_len) ** 2 * q / tp_f
    if model.flash_attention:
        attention = FLASH_FLOPS * scores / (hw.sustained_flops * hw.attention_efficiency)
    else:
        attention = EAGER_FLOPS * scores / peak
    t_sp = np.where(np.asarray(sequence_parallel) & (tp_f > 1), tp_f, 1.0)
    elementwise = M * s.dim * ELEMENTWISE_BYTES[model.stack] / t_sp / hw.memory_bw
    return {"gemm_s": gemm, "attention_s": attention, "elementwise_s": elementwise}


def head_s(model, tp, micro_batch_size) -> np.ndarray:
    """The output projection (GEMM, K = h, N = V/tp) and its loss, seconds at κ = 1."""
    hw, s = model.hardware, model.shape
    tp_f, M = _f(tp), _f(micro_batch_size) * s.seq_len
    e = float(model.dtype_bytes)
    n = s.vocab_size / tp_f
    flops = 6.0 * M * s.dim * n / (hw.sustained_flops * hw.gemm_efficiency)
    return flops + (3.0 * e * (M * s.dim + s.dim * n + M * n) + M * n * LOSS_BYTES) / hw.memory_bw


def recompute_factors(model, ac) -> dict[str, np.ndarray]:
    """Time multiplier per kernel class of AC mode codes `ac` (0 none, 1 selective, 2 full).

    full: one more forward of everything: GEMMs and element-wise ops 4/3, flash attention
    1 + 1/3.5 (its forward is 1 of FlashAttention-2's 3.5 units), eager attention 4/3.
    selective (torchtitan's op policy, `runtime/engine/parallelize.py`): the saved ops are every
    second matmul and the attention output, so the unsaved matmuls (wk, wo, w3: share r_g of the
    matmul FLOPs) and every element-wise op (norms, rotary, SwiGLU's activation) run again:
    GEMMs 1 + r_g/3, element-wise 4/3, attention 1.
    """
    ac = np.asarray(ac)
    s = model.shape
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    r_g = (s.dim * kv + q * s.dim + s.dim * s.ffn_dim) / gemm_dims(s)[1]
    attn_full = 1.0 + (1.0 / 3.5 if model.flash_attention else 1.0 / 3.0)
    full, sel = ac == 2, ac == 1
    return {
        "gemm_s": np.where(full, 4.0 / 3.0, np.where(sel, 1.0 + r_g / 3.0, 1.0)),
        "attention_s": np.where(full, attn_full, 1.0),
        "elementwise_s": np.where(full | sel, 4.0 / 3.0, 1.0),
    }


def roofline(model) -> bool:
    """Whether `model` prices compute by the roofline (a GPU profile with gemm_efficiency)."""
    return model.hardware is not None and model.hardware.gemm_efficiency is not None


def stage_compute_flops(model, tp, pp, micro_batch_size, ac, sequence_parallel=False) -> dict[str, np.ndarray]:
    """GEMM-equivalent FLOPs X of one micro-batch on the largest stage (module docstring).

    Returns "total" (= layers·(block + recomputed part) + head), "recompute" (what
    `recompute_factors` adds), and the per-class parts without recompute "gemm", "attention",
    "elementwise", "head". Without the roofline: the FLOP count of
    `StepTimeModel.stage_flops_per_sample` · b / tp (its recompute factor on the whole stage, as
    before the roofline), split into total and recompute only.
    """
    layers = model.stage_layers(_f(pp))
    if not roofline(model):
        rf = model.recompute_factor(ac)
        base = model.stage_flops_per_sample(pp, "none") * _f(micro_batch_size) / _f(tp)
        total = base * rf
        zero = np.zeros_like(total)
        return {
            "total": total,
            "recompute": total - base,
            "gemm": base,
            "attention": zero,
            "elementwise": zero,
            "head": zero,
        }
    scale = model.hardware.sustained_flops * model.hardware.gemm_efficiency
    parts = block_terms(model, tp, micro_batch_size, sequence_parallel)
    block = parts["gemm_s"] + parts["attention_s"] + parts["elementwise_s"]
    factors = recompute_factors(model, ac)
    extra = sum(parts[k] * (factors[k] - 1.0) for k in ("gemm_s", "attention_s", "elementwise_s"))
    head = head_s(model, tp, micro_batch_size)
    total = (layers * (block + extra) + head) * scale
    return {
        "total": total,
        "recompute": layers * extra * scale,
        "gemm": layers * parts["gemm_s"] * scale,
        "attention": layers * parts["attention_s"] * scale,
        "elementwise": layers * parts["elementwise_s"] * scale,
        "head": head * scale + 0.0 * total,
    }
