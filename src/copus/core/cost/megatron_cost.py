"""Step time of a plan on Megatron-LM, the stack COPUS ran (arXiv 2604.26687 §4; copus-notes §1.8).

`StepTimeModel(stack="megatron")` dispatches here; the coefficients are the same
`StepTimeParams` (so `copus.core.cost.fit` refits them unchanged), only the structure differs from
copus's FSDP2 runtime:

    layers     = ceil(L/pp); units = layers + 1 (embedding or head)
    t_compute  = α_c·units + β_c·flops_stage(b_m)/(tp·ε_tp^log2(tp))  slowest (last) stage: blocks +
                 head; ε_tp = `HardwareProfile.tp_efficiency`, per-GPU efficiency kept per TP doubling
                 (+ eager attention's score traffic, `StepTimeModel.attention_scores_s`)
    t_tp       = n_tp·[2(tp−1)·α_tp + 2(tp−1)/tp·b_m·s·h·e·β_tp·slow_tp]    Megatron TP, 4 all-reduces
                                                                  per block (+2 when recomputing)
    t_p2p      = 2·[α_pp + b_m·s·h·e·β_pp·slow_pp]                1F1B send/recv, blocking (no overlap)
    t_elem     = layers·s·b_m·h·E_elem / memory_bw                    element-wise work TP does not split
                 (no sequence parallelism: RMSNorms, residual adds and their backward run on the
                 full s·b·h tensor on every TP rank; Korthikanti et al. 2022 §4.2.2), E_elem = 48
                 bytes per element: 2 norms × 6 passes + 2 residual adds × 6 passes, bf16
    t_mb       = t_compute + t_elem + t_tp + t_p2p
    t_grad     = 2(dp−1)·α_dp·n_buckets + g(dp)·P_local·β_dp·slow_dp
                 replicated optimizer (COPUS, Megatron DDP): ring all-reduce of fp32 grads,
                 g = 2(dp−1)/dp·4 bytes; distributed optimizer: reduce-scatter fp32 grads +
                 all-gather bf16 params, g = (dp−1)/dp·(4 + 2) bytes
    t_emb      = tied embeddings and pp > 1: all-reduce of the V·h/tp fp32 embedding grads between
                 the first and the last stage (Megatron's embedding group), α_pp + V·h/tp·4·β·slow
    t_opt      = β_opt·P_local / (dp if distributed optimizer else 1) + c_step
    step_s     = (m + pp − 2)·t_mb + (t_mb^γ + t_grad^γ)^(1/γ) + t_emb + t_opt

Sources: Megatron-LM `arguments.py` forces fp32 gradient accumulation and all-reduce for bf16
("bfloat16 requires gradient accumulation and all-reduce to be done in fp32"); the distributed
optimizer's reduce-scatter/all-gather and its 18 → 6 + 12/d bytes per parameter are from
Megatron-LM's README ("Distributed Optimizer"); DDP buckets of max(4e7, 1e6·dp) elements
(megatron/core/distributed `DistributedDataParallelConfig.bucket_size`); the gradient reduce
overlaps the last micro-batch's backward only with `--overlap-grad-reduce` (off by default:
γ = 1, `HardwareProfile.overlap_gamma`); 1F1B bubble (pp−1)/(m+pp−1) (Narayanan et al. SC'21
§2.2); ring all-reduce volume 2(n−1)/n (Thakur et al. 2005). `slow_*` are the tier slowdowns
of `StepTimeModel.slowdowns` (NVLink / PCIe / network, with the shared NIC split).
"""

from __future__ import annotations

import numpy as np

from copus.core.cost.compute import roofline, stage_compute_flops
from copus.core.cost.overlap import gamma_sum
from copus.core.specs.hardware import link_tier

GRAD_BYTES = 4  # fp32 gradient all-reduce / reduce-scatter (Megatron, bf16 training)
PARAM_GATHER_BYTES = 2  # bf16 parameter all-gather of the distributed optimizer
BUCKET_ELEMENTS = 4e7  # Megatron DDP bucket_size default: max(40M, 1M·dp) elements
ELEMENTWISE_BYTES = 48.0  # bytes moved per s·b·h element per block by the unsplit element-wise ops


def _f(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def megatron_breakdown(
    model, dp, tp, pp, micro_batch_size, num_microbatches, *, ac=None, chunks=1.0, sequence_parallel=False
) -> dict[str, np.ndarray]:
    """Every term of the module equation (seconds), broadcast; "step_s" is the total.

    `model` is a `copus.core.cost.throughput.StepTimeModel` (params, shape, tiers, options);
    `ac` AC mode codes (None: the model's), `chunks` the v of an interleaved schedule (bubble
    (pp−1)/v, v× the p2p messages), `sequence_parallel` splits t_elem over tp.
    """
    ac = model.ac_codes() if ac is None else np.asarray(ac)

    p, s = model.params, model.shape
    dp_f, tp_f, pp_f, b, m = (_f(x) for x in (dp, tp, pp, micro_batch_size, num_microbatches))
    slow_tp, slow_dp, slow_pp = model.slowdowns(dp, tp, pp)
    layers = model.stage_layers(pp_f)
    units = layers + 1.0
    local_params = model.stage_params(pp_f) / tp_f
    act_bytes = b * s.seq_len * s.dim * model.dtype_bytes

    tp_eff = model.hardware.tp_efficiency if model.hardware is not None else 1.0
    work = stage_compute_flops(model, tp_f, pp_f, b, ac, sequence_parallel)
    slow = tp_eff ** np.log2(tp_f) * model.compile_speedup
    compute = (
        p.layer_overhead_s * units + p.s_per_flop * work["total"] / slow + model.attention_scores_s(tp_f, pp_f, b, ac)
    )
    n_tp = (4.0 + model.tp_recompute_per_block(ac)) * layers + 2.0
    tp_s = n_tp * (2 * (tp_f - 1) * p.tp_latency_s + 2 * (tp_f - 1) / tp_f * act_bytes * p.tp_s_per_byte * slow_tp)
    v = _f(chunks)
    p2p = np.where(pp_f > 1, 2.0 * v * (p.pp_latency_s + act_bytes * p.pp_s_per_byte * slow_pp), 0.0)
    memory_bw = model.hardware.memory_bw if model.hardware is not None else np.inf
    elementwise = (
        layers
        * b
        * s.seq_len
        * s.dim
        * ELEMENTWISE_BYTES
        / memory_bw
        / np.where(np.asarray(sequence_parallel) & (tp_f > 1), tp_f, 1.0)
    )
    if roofline(model):  # the roofline's compute term holds the element-wise traffic already
        elementwise = np.zeros_like(elementwise)
    microbatch = compute + elementwise + tp_s + p2p

    grad = grad_sync_s(model, dp_f, local_params, slow_dp)
    emb = embedding_sync_s(model, dp, tp, pp, slow_pp)
    last = gamma_sum(microbatch, grad, p.gamma)
    shard = dp_f if model.distributed_optimizer else 1.0
    optimizer = p.optimizer_s_per_param * local_params / shard + p.step_overhead_s
    bubble = (pp_f - 1.0) / v * microbatch
    step = (m - 1.0) * microbatch + bubble + last + emb + optimizer
    zero = np.zeros_like(step)
    return {
        "compute_s": compute,
        "recompute_s": p.s_per_flop * work["recompute"] / slow,
        "elementwise_s": elementwise,
        "tp_s": tp_s,
        "p2p_s": p2p,
        "allgather_s": zero,
        "microbatch_s": microbatch,
        "sync_s": grad,
        "embedding_sync_s": emb,
        "optimizer_s": optimizer,
        "bubble_s": bubble,
        "step_s": step,
    }


def grad_sync_s(model, dp_f: np.ndarray, local_params: np.ndarray, slow_dp: np.ndarray) -> np.ndarray:
    """Data-parallel gradient sync of one step (module equation t_grad); 0 when dp = 1."""
    p = model.params
    if model.distributed_optimizer:
        volume = (dp_f - 1) / dp_f * (GRAD_BYTES + PARAM_GATHER_BYTES)
    else:
        volume = 2 * (dp_f - 1) / dp_f * GRAD_BYTES
    buckets = np.ceil(local_params / np.maximum(BUCKET_ELEMENTS, 1e6 * dp_f))
    return 2 * (dp_f - 1) * buckets * p.dp_latency_s + volume * local_params * p.dp_s_per_byte * slow_dp


def embedding_sync_s(model, dp, tp, pp, slow_pp: np.ndarray) -> np.ndarray:
    """Tied embeddings split by the pipeline: first ↔ last stage all-reduce of V·h/tp fp32 grads.

    The pair is (pp−1)·dp·tp ranks apart; its tier comes from `link_tier` of a 2-member group at
    that stride (the NIC share of a pipeline hop, `slow_pp`, is reused when it crosses nodes).
    """
    s, p = model.shape, model.params
    dp_i, tp_i, pp_i = (np.asarray(x) for x in (dp, tp, pp))
    if not s.tie_embeddings:
        return np.zeros(np.broadcast(dp_i, tp_i, pp_i).shape)
    world = dp_i * tp_i * pp_i
    g, n = model._domains
    tier = link_tier(np.where(pp_i > 1, 2, 1), np.maximum(pp_i - 1, 1) * dp_i * tp_i, world, g, n)
    base = model._slow[tier]
    pp_tier = link_tier(pp_i, dp_i * tp_i, world, g, n)
    slow = np.where((tier == 2) & (pp_tier == 2), slow_pp, base)
    volume = s.vocab_size * s.dim / _f(tp_i) * GRAD_BYTES
    return np.where(pp_i > 1, p.pp_latency_s + volume * p.pp_s_per_byte * slow, 0.0)
