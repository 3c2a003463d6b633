"""Step-time model: seconds per optimizer step of any (dp, tp, pp, micro_batch_size, num_microbatches).

design.md §4. COPUS profiles every plan (§4.4); copus adds this model so unprofiled plans are
predicted. Structure (per rank, slowest pipeline stage; mesh order (pp, dp, tp)):

    units      = ceil(L/pp) + 1                       blocks of the largest stage + embeddings/head
    t_compute  = α_c·units + β_c · flops_stage(b_m) · ac / tp        affine in b_m (Galvatron, Pollux);
                 a GPU profile replaces flops_stage·ac/tp by the roofline's GEMM-equivalent FLOPs
                 (`core.cost.compute`: GEMMs, flash attention, element-wise HBM traffic, head, per-class
                 recompute) and β_c = 1/(κ·η_g·peak), κ = COMPUTE_EFFICIENCY
    t_tp       = n_tp · [2(tp−1)·α_tp + 2(tp−1)/tp · b_m·s·h·e · β_tp · slow(tier_tp)]
                 ring all-reduce (Thakur et al. 2005), n_tp = (7 + 2·AC)·ceil(L/pp) + 2 per
                 micro-batch: copus's DTensor TP issues 2 all-reduces forward (wo, w2) and 5
                 backward (the input gradient of each column-wise wq, wk, wv, w1, w3), counted on
                 the runtime (tests/runtime/test_cpu_collectives.py); Megatron, which fuses QKV
                 and w1·w3, has 2 + 2 (`core.megatron_cost`)
    t_p2p      = 2 · [α_pp + b_m·s·h·e · β_pp · slow(tier_pp)]     activation out, gradient back
    t_ag       = n_ag · [(dp−1)·units·α_dp + (dp−1)/dp · P_stage/tp · e_p · β_dp · slow(tier_dp)]
                 FSDP2 all-gather per micro-batch, n_ag = 2 when resharding after forward;
                 e_p = param_bytes: 2 with FSDP2's MixedPrecisionPolicy(param_dtype=bf16) (copus's
                 runtime on GPUs, `copus plan`'s default there), 4 for fp32 parameters
    t_mb       = (t_compute^γ + t_ag^γ)^(1/γ) + t_tp + t_p2p        prefetch overlaps all-gathers
    t_rs       = (dp−1)·units·α_dp + (dp−1)/dp · P_stage/tp · 4 · β_dp · slow(tier_dp)   fp32 grads
    t_acc      = (t_compute^γ + (t_ag + t_rs)^γ)^(1/γ) + t_tp + t_p2p     a micro-batch that reduce-
                 scatters its own gradients (copus's engine, every micro-batch but the last;
                 t_acc = t_mb with torch's own PipelineStage at pp > 1, `pipeline_no_sync`)
    step_s     = (m − 1 + (pp − 1)/v)·t_acc + (t_mb^γ + t_rs^γ)^(1/γ) + β_opt·P_stage/(tp·dp) + c_step

Plan options (issue 25; per candidate, `breakdown(..., activation_checkpointing=...)`):
- activation checkpointing `ac` multiplies the FLOPs by the recomputed share of the forward:
  full 4/3 (one more forward), selective 1 + r/3 with r = `selective_recompute_share` — the
  forward FLOPs of the matmuls torchtitan's op policy recomputes (wk, wo, w3: every second
  one) over the block's forward FLOPs (0.28 for Llama-3.1-8B at seq 8192); TP all-reduces
  repeated: +2 per block (full), +1 (selective: wo);
- interleaved 1F1B with v chunks per rank: bubble (pp − 1)/v stage-times instead of pp − 1
  (Narayanan et al. SC'21 §2.2.2) and v times the point-to-point messages; GPipe's bubble is
  1F1B's;
- sequence parallel: an all-gather before and a reduce-scatter after attention and the MLP,
  the bytes of 2 all-reduces forward and 2 backward (Korthikanti et al. 2022 §4.2.2): the three
  (two) column-wise inputs share one all-gather, so their input gradients are summed before one
  reduce-scatter: n_tp = 4 per block instead of copus's 7 (`TP_COLLECTIVES_SP`); the Megatron
  stack's element-wise term is split by tp;
- reshard-after-forward: n_ag = 2 all-gathers per micro-batch, else 1.
Eager attention (`flash_attention=False`, e.g. Megatron-LM of 2021): the a·s² scores per sample
and block are written and read in memory, t_attn = layers·a·s²·b/t·E_attn/memory_bw per
micro-batch with E_attn = 30 bytes per 16-bit score (forward: QKᵀ writes 2, the fused
scale-mask-softmax reads 2 and writes 2, dropout reads 2, writes 2 and a 1-byte mask, AV reads
2 = 13; backward 17) + 13 per recomputed forward (`ATTN_SCORE_BYTES`); flash attention keeps the
scores on chip (Dao et al. 2022), no term.
`compile_speedup` divides t_compute (torch.compile; `COMPILE_SPEEDUP`, fitted on torchtitan's
Llama-3.1-8B FSDP 8 pair in bench/published.py, other rows held out).

The last line is Pollux's `T_iter = s·T_acc + (T_acc^γ + T_net^γ)^(1/γ)` (Qiao et al. OSDI'21,
§4.1) with the pipeline's fill and drain added: `(m + pp − 1)` stage-times per step, i.e. a
bubble fraction `(pp−1)/(m+pp−1)` (Narayanan et al. SC'21, §2.2; GPipe and 1F1B alike). m =
num_microbatches, e = activation/parameter bytes, slow(tier) = tier-0 bandwidth / tier bandwidth
(`copus.core.specs.hardware`). Every α, β, γ is a `StepTimeParams` field, fitted by `copus.core.cost.fit`.

That is copus's own runtime (stack "fsdp2"). With `stack="megatron"` (the profiles of COPUS's
clusters, `HardwareProfile.stack`) the same coefficients price Megatron-LM's structure instead:
no per-micro-batch all-gathers, one fp32 gradient all-reduce per step (or the distributed
optimizer's reduce-scatter + all-gather), the tied-embedding sync between the pipeline's ends
and a node-shared NIC (`copus.core.cost.megatron_cost`, docs/cost-model.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from copus.core.specs.hardware import STACKS, HardwareProfile, get_hardware, link_tier
from copus.core.cost.compute import stage_compute_flops
from copus.core.cost.megatron_cost import megatron_breakdown
from copus.core.cost.overlap import gamma_sum
from copus.core.specs.models import ModelShape
from copus.core.plan.plan import AC_MODES, PIPELINE_SCHEDULES, ParallelPlan, ac_mode_name, option_codes

GRAD_BYTES = 4  # FSDP2 reduce-scatters gradients in fp32 (MixedPrecisionPolicy reduce_dtype)
TP_ALLREDUCES_PER_BLOCK = 7  # copus's DTensor TP: 2 forward (wo, w2) + 5 backward (wq, wk, wv, w1, w3)
TP_RECOMPUTE_PER_BLOCK = 2  # activation checkpointing repeats the 2 forward all-reduces
ATTN_SCORE_BYTES = (30.0, 13.0)  # eager attention: bytes per score (fwd + bwd, per recomputed fwd)
TP_COLLECTIVES_SP = 4  # sequence parallel: 2 all-gathers + 2 reduce-scatters, fwd and bwd
TP_RECOMPUTE_SELECTIVE = 1  # torchtitan's op policy recomputes wo (row-wise): 1 all-reduce
# torch.compile's speed-up of the compute term, fitted on torchtitan's 8B FSDP 8 (5,762 → 6,667
# tokens/s/GPU, Table 1) by bench/published.py; Table 3 (128 GPUs) held out.
COMPILE_SPEEDUP = 1.16
# κ: the share of the summed roofline (`core.cost.compute`) an end-to-end training step reaches,
# one hardware-independent factor: between its fits on H100 rows alone (0.82) and on A100 rows
# alone (0.90) in bench/published.py (docs/published.md), rounded down to 0.85.
COMPUTE_EFFICIENCY = 0.85


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTimeParams:
    """Coefficients of the step-time model (seconds, seconds/FLOP, seconds/byte; γ ≥ 1)."""

    layer_overhead_s: float  # α_c: fixed time per block (or head) per micro-batch
    s_per_flop: float  # β_c: 1 / achieved FLOP/s
    tp_latency_s: float  # α_tp: per ring step of a tensor-parallel all-reduce
    tp_s_per_byte: float  # β_tp: per byte moved over tier 0
    dp_latency_s: float  # α_dp: per ring step per FSDP unit
    dp_s_per_byte: float  # β_dp
    pp_latency_s: float  # α_pp: per point-to-point message
    pp_s_per_byte: float  # β_pp
    optimizer_s_per_param: float  # β_opt: optimizer step per local parameter
    step_overhead_s: float  # c_step: fixed per optimizer step
    gamma: float = 1.0  # overlap exponent, Pollux's γ ∈ [1, 10]

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"{f.name}={v!r} is invalid; allowed: a finite number >= 0")
        if self.gamma < 1:
            raise ValueError(f"gamma={self.gamma!r} is invalid; allowed: >= 1")

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(StepTimeParams))

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> StepTimeParams:
        unknown = set(d) - set(cls.names())
        if unknown:
            raise ValueError(f"unknown StepTimeParams keys {sorted(unknown)}; allowed: {cls.names()}")
        return cls(**{k: float(v) for k, v in d.items()})

    def scaled_time(self, k: float) -> StepTimeParams:
        """Every time coefficient multiplied by `k` (γ unchanged): same shape, k× slower."""
        return replace(self, **{n: getattr(self, n) * k for n in self.names() if n != "gamma"})

    @classmethod
    def analytic(cls, hardware: HardwareProfile) -> StepTimeParams:
        """Priors from datasheet figures: β = 1/bandwidth, β_c = 1/(peak·MFU), optimizer memory-bound.

        AdamW touches ~32 bytes per parameter per step (read param, grad, 2 moments; write param,
        2 moments; fp32), so β_opt = 32 / memory_bw.
        """
        bw0 = hardware.link_bw[0]
        achieved = (
            hardware.achieved_flops
            if hardware.gemm_efficiency is None
            else hardware.sustained_flops * hardware.gemm_efficiency * COMPUTE_EFFICIENCY
        )
        return cls(
            layer_overhead_s=hardware.layer_overhead_s,
            s_per_flop=1.0 / achieved,
            tp_latency_s=hardware.latency_s,
            tp_s_per_byte=1.0 / bw0,
            dp_latency_s=hardware.latency_s,
            dp_s_per_byte=1.0 / bw0,
            pp_latency_s=hardware.latency_s,
            pp_s_per_byte=1.0 / bw0,
            optimizer_s_per_param=32.0 / hardware.memory_bw,
            step_overhead_s=hardware.step_overhead_s,
            gamma=hardware.overlap_gamma,
        )


def _i(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


class StepTimeModel:
    """Predicts seconds per optimizer step; see the module docstring for the equation.

    `hardware` supplies only the topology (gpus_per_node, nvlink_group, tier bandwidth ratios)
    and the default element size; the coefficients come from `params`. World size is taken per
    candidate as dp·tp·pp, so one model scores plans of any world size.
    """

    def __init__(
        self,
        params: StepTimeParams,
        shape: ModelShape,
        hardware: HardwareProfile | None = None,
        *,
        world_size: int | None = None,
        dtype_bytes: int | None = None,
        param_bytes: int = 4,
        activation_checkpointing: bool | str = False,
        reshard_after_forward: bool = True,
        stack: str | None = None,
        distributed_optimizer: bool | None = None,
        pipeline_schedule: str = "1f1b",
        virtual_stages: int = 1,
        sequence_parallel: bool = False,
        compile_speedup: float = 1.0,
        flash_attention: bool = True,
        pipeline_no_sync: bool = False,
    ) -> None:
        self.params = params
        self.shape = shape
        self.hardware = hardware
        self.world_size = world_size
        self.dtype_bytes = int(dtype_bytes or (hardware.dtype_bytes if hardware else 4))
        self.param_bytes = int(param_bytes)
        self.activation_checkpointing = activation_checkpointing
        self.ac_mode = ac_mode_name(activation_checkpointing)
        self.reshard_after_forward = reshard_after_forward
        option_codes(pipeline_schedule, "1f1b", PIPELINE_SCHEDULES, "pipeline_schedule")
        self.pipeline_schedule = pipeline_schedule
        self.virtual_stages = int(virtual_stages)
        self.sequence_parallel = bool(sequence_parallel)
        if not compile_speedup > 0:
            raise ValueError(f"compile_speedup={compile_speedup!r} is invalid; allowed: a number > 0")
        self.compile_speedup = float(compile_speedup)
        self.flash_attention = bool(flash_attention)
        self.pipeline_no_sync = bool(pipeline_no_sync)
        self.stack = stack or (hardware.stack if hardware else "fsdp2")
        if self.stack not in STACKS:
            raise ValueError(f"stack={self.stack!r} is invalid; allowed: {', '.join(STACKS)}")
        self.distributed_optimizer = bool(
            hardware.distributed_optimizer if distributed_optimizer is None and hardware else distributed_optimizer
        )
        self._slow = np.asarray(hardware.tier_slowdown if hardware else (1.0, 1.0, 1.0))
        self._domains = (hardware.nvlink_group, hardware.gpus_per_node) if hardware else (2**62, 2**62)
        self._shared_nic = bool(hardware and hardware.shared_nic)

    @classmethod
    def analytic(
        cls, shape: ModelShape, hardware: HardwareProfile | str, world_size: int | None = None, **options
    ) -> StepTimeModel:
        """A model priced from datasheet figures (`StepTimeParams.analytic`); no measurement."""
        hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
        return cls(StepTimeParams.analytic(hw), shape, hw, world_size=world_size, **options)

    def with_params(self, params: StepTimeParams) -> StepTimeModel:
        """The same model (shape, topology, options) with other coefficients."""
        return StepTimeModel(
            params,
            self.shape,
            self.hardware,
            world_size=self.world_size,
            dtype_bytes=self.dtype_bytes,
            param_bytes=self.param_bytes,
            activation_checkpointing=self.activation_checkpointing,
            reshard_after_forward=self.reshard_after_forward,
            stack=self.stack,
            distributed_optimizer=self.distributed_optimizer,
            pipeline_schedule=self.pipeline_schedule,
            virtual_stages=self.virtual_stages,
            sequence_parallel=self.sequence_parallel,
            compile_speedup=self.compile_speedup,
            flash_attention=self.flash_attention,
            pipeline_no_sync=self.pipeline_no_sync,
        )

    # ---- shape arithmetic -------------------------------------------------------------------

    def stage_layers(self, pp) -> np.ndarray:
        """Blocks on the largest pipeline stage: ceil(L / pp)."""
        return np.ceil(self.shape.n_layers / _i(pp))

    def stage_params(self, pp) -> np.ndarray:
        """Parameters of the largest stage: its blocks + one vocab×dim matrix (+ final norm)."""
        s = self.shape
        emb = np.where(_i(pp) > 1, s.vocab_size * s.dim + s.dim, s.embedding_params())
        return self.stage_layers(pp) * s.layer_params() + emb

    def selective_recompute_share(self) -> float:
        """Share of a block's forward FLOPs torchtitan's op policy recomputes: the matmuls wk,
        wo, w3 (every second one), h·kv + h² + h·f, over layer_params + 2·h·s (matmuls + attention)."""
        s = self.shape
        kv = s.n_kv_heads * s.head_dim
        return (s.dim * kv + s.dim * s.dim + s.dim * s.ffn_dim) / (s.layer_params() + 2.0 * s.dim * s.seq_len)

    def ac_codes(self, activation_checkpointing=None) -> np.ndarray:
        """AC mode codes (indices into AC_MODES) of the candidates; the model's own by default."""
        return option_codes(activation_checkpointing, self.ac_mode, AC_MODES, "activation_checkpointing")

    def recompute_factor(self, ac) -> np.ndarray:
        """FLOPs multiplier of AC codes: none 1, selective 1 + r/3, full 4/3 (one more forward)."""
        ac = np.asarray(ac)
        return np.where(ac == 2, 4.0 / 3.0, np.where(ac == 1, 1.0 + self.selective_recompute_share() / 3.0, 1.0))

    def tp_recompute_per_block(self, ac) -> np.ndarray:
        """TP all-reduces repeated per block by the recompute: full 2, selective 1, none 0."""
        ac = np.asarray(ac)
        return np.where(ac == 2, TP_RECOMPUTE_PER_BLOCK, np.where(ac == 1, TP_RECOMPUTE_SELECTIVE, 0)) * 1.0

    def bubble_chunks(self, pp, pipeline_schedule=None, virtual_stages=None) -> np.ndarray:
        """v of the bubble (pp − 1)/v: the virtual stages under interleaved 1F1B, else 1."""
        code = option_codes(pipeline_schedule, self.pipeline_schedule, PIPELINE_SCHEDULES, "pipeline_schedule")
        v = _i(self.virtual_stages if virtual_stages is None else virtual_stages)
        return np.where(code == 2, np.maximum(v, 1.0), 1.0) + 0.0 * _i(pp)

    def attention_scores_s(self, tp, pp, micro_batch_size, ac) -> np.ndarray:
        """Eager attention's score traffic per micro-batch (module docstring; 0 with flash)."""
        if self.flash_attention or self.hardware is None:
            return np.zeros(np.broadcast(_i(tp), _i(pp), _i(micro_batch_size), np.asarray(ac)).shape)
        s = self.shape
        recomputed = np.where(np.asarray(ac) > 0, 1.0, 0.0)
        per_score = ATTN_SCORE_BYTES[0] + ATTN_SCORE_BYTES[1] * recomputed
        scores = s.n_heads * float(s.seq_len) ** 2 * _i(micro_batch_size) / _i(tp)
        return self.stage_layers(pp) * scores * per_score / self.hardware.memory_bw

    def stage_flops_per_sample(self, pp, activation_checkpointing=None) -> np.ndarray:
        """Training FLOPs of one sample on the largest stage (forward + backward).

        Per block per token 6·layer_params + 12·dim·seq (Kaplan et al. 2020; PaLM App. B, as
        `ModelShape.flops_per_token`), plus the output head 6·vocab·dim; the embedding lookup
        is free. Activation checkpointing recomputes (part of) the forward: `recompute_factor`.
        """
        s = self.shape
        per_layer = 6.0 * s.layer_params() + 12.0 * s.dim * s.seq_len
        flops = (self.stage_layers(pp) * per_layer + 6.0 * s.vocab_size * s.dim) * s.seq_len
        return flops * self.recompute_factor(self.ac_codes(activation_checkpointing))

    def tiers(self, dp, tp, pp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Link tiers of the tp, dp and pp groups (0 fast domain, 1 node, 2 network)."""
        dp, tp, pp = np.asarray(dp), np.asarray(tp), np.asarray(pp)
        world = dp * tp * pp
        g, n = self._domains
        return (link_tier(tp, 1, world, g, n), link_tier(dp, tp, world, g, n), link_tier(pp, dp * tp, world, g, n))

    # ---- the model ----------------------------------------------------------------------------

    def breakdown(
        self,
        dp,
        tp,
        pp,
        micro_batch_size,
        num_microbatches,
        *,
        activation_checkpointing=None,
        pipeline_schedule=None,
        virtual_stages=None,
        sequence_parallel=None,
        reshard_after_forward=None,
    ) -> dict[str, np.ndarray]:
        """Every term of the equation (seconds), broadcast over the inputs; "step_s" is the total.

        The keywords are the plan options per candidate (names, or code / bool arrays as
        `MemoryModel.breakdown`); None takes the model's own.
        """
        ac = self.ac_codes(activation_checkpointing)
        v = self.bubble_chunks(pp, pipeline_schedule, virtual_stages)
        sp = self.sequence_parallel if sequence_parallel is None else np.asarray(sequence_parallel)
        if self.stack == "megatron":
            return megatron_breakdown(
                self, dp, tp, pp, micro_batch_size, num_microbatches, ac=ac, chunks=v, sequence_parallel=sp
            )
        raf = self.reshard_after_forward if reshard_after_forward is None else np.asarray(reshard_after_forward)
        p = self.params
        dp_f, tp_f, pp_f, b, m = (_i(x) for x in (dp, tp, pp, micro_batch_size, num_microbatches))
        t_tier, d_tier, p_tier = self.tiers(dp, tp, pp)
        layers = self.stage_layers(pp_f)
        units = layers + 1.0
        local_params = self.stage_params(pp_f) / tp_f
        act_bytes = b * self.shape.seq_len * self.shape.dim * self.dtype_bytes

        work = stage_compute_flops(self, tp_f, pp_f, b, ac, sp)
        compute = (
            p.layer_overhead_s * units
            + p.s_per_flop * work["total"] / self.compile_speedup
            + self.attention_scores_s(tp_f, pp_f, b, ac)
        )
        per_block = np.where(np.asarray(sp) & (tp_f > 1), TP_COLLECTIVES_SP, TP_ALLREDUCES_PER_BLOCK)
        n_tp = (per_block + self.tp_recompute_per_block(ac)) * layers + 2.0
        tp_s = n_tp * (
            2 * (tp_f - 1) * p.tp_latency_s + 2 * (tp_f - 1) / tp_f * act_bytes * p.tp_s_per_byte * self._slow[t_tier]
        )
        p2p = np.where(pp_f > 1, 2.0 * v * (p.pp_latency_s + act_bytes * p.pp_s_per_byte * self._slow[p_tier]), 0.0)
        dp_frac = (dp_f - 1) / dp_f
        n_ag = np.where(raf, 2.0, 1.0)
        allgather = n_ag * (
            (dp_f - 1) * units * p.dp_latency_s
            + dp_frac * local_params * self.param_bytes * p.dp_s_per_byte * self._slow[d_tier]
        )
        microbatch = gamma_sum(compute, allgather, p.gamma) + tp_s + p2p
        sync = (dp_f - 1) * units * p.dp_latency_s + dp_frac * local_params * GRAD_BYTES * p.dp_s_per_byte * self._slow[
            d_tier
        ]
        last = gamma_sum(microbatch, sync, p.gamma)
        # copus's engine reduce-scatters every micro-batch (gns.small = "microbatch", its
        # pipeline stages included; torchtitan's FSDP accumulation too): with m ≥ 2 each of the
        # first m − 1 micro-batches overlaps its all-gathers and its fp32 reduce-scatter with its
        # compute; torch's own PipelineStage (`pipeline_no_sync`) reduces once, after the last
        each_mb = (m >= 2) & ~(self.pipeline_no_sync & (pp_f > 1))
        accumulating = np.where(each_mb, gamma_sum(compute, allgather + sync, p.gamma) + tp_s + p2p, microbatch)
        optimizer = p.optimizer_s_per_param * local_params / dp_f + p.step_overhead_s
        bubble = (pp_f - 1.0) / v * accumulating
        step = (m - 1.0) * accumulating + bubble + last + optimizer
        return {
            "compute_s": compute,
            "recompute_s": p.s_per_flop * work["recompute"] / self.compile_speedup,
            "tp_s": tp_s,
            "p2p_s": p2p,
            "allgather_s": allgather,
            "microbatch_s": microbatch,
            "accumulating_s": accumulating,
            "sync_s": sync,
            "optimizer_s": optimizer,
            "bubble_s": bubble,
            "step_s": step,
        }

    def slowdowns(self, dp, tp, pp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Seconds per byte of the tp, dp and pp groups relative to tier 0 (module docstring).

        With a node-shared NIC (`HardwareProfile.shared_nic`) a group crossing nodes gets one
        per-GPU share of the NIC per member it has on the node: dp (dp at stride tp) has
        min(dp, max(1, gpus_per_node // tp)) members per node; a pipeline hop between nodes is
        made by every one of the dp·tp pipelines at once, gpus_per_node / min(dp·tp, gpus_per_node)
        shares each; tp has min(tp, gpus_per_node).
        """
        t_tier, d_tier, p_tier = self.tiers(dp, tp, pp)
        slow = [self._slow[t_tier], self._slow[d_tier], self._slow[p_tier]]
        if self._shared_nic:
            dp_f, tp_f = _i(dp), _i(tp)
            gpn = float(self._domains[1])
            shares = (
                np.minimum(tp_f, gpn),
                np.minimum(dp_f, np.maximum(1.0, np.floor(gpn / tp_f))),
                gpn / np.minimum(dp_f * tp_f, gpn),
            )
            slow = [np.where(tier == 2, s / k, s) for tier, s, k in zip((t_tier, d_tier, p_tier), slow, shares)]
        return tuple(slow)

    def predict(self, dp, tp, pp, micro_batch_size, num_microbatches, **options) -> np.ndarray:
        """Seconds per optimizer step, numpy-broadcast over integer arrays; `options` as `breakdown`."""
        return self.breakdown(dp, tp, pp, micro_batch_size, num_microbatches, **options)["step_s"]

    def predict_plans(self, plans: Sequence[ParallelPlan]) -> np.ndarray:
        cols = plan_columns(plans)
        return self.predict(*cols)

    def predict_plan(self, plan: ParallelPlan) -> float:
        return float(self.predict_plans([plan])[0])

    def throughput_samples_per_s(self, dp, tp, pp, micro_batch_size, num_microbatches) -> np.ndarray:
        """global_batch_size / step_s."""
        gbs = _i(dp) * _i(micro_batch_size) * _i(num_microbatches)
        return gbs / self.predict(dp, tp, pp, micro_batch_size, num_microbatches)


def time_split(model: StepTimeModel, dp, tp, pp, micro_batch_size, num_microbatches, **options) -> dict:
    """Where a step's seconds go, summing to step_s (vectorised; `options` as `breakdown`):

    compute_s (m micro-batches less their recompute, + Megatron's unsplit element-wise work),
    recompute_s, exposed communication per collective — fsdp_allgather_s (the part of FSDP's
    parameter all-gathers the prefetch does not hide), tp_s, pp_p2p_s, grad_sync_s (the exposed
    part of FSDP's gradient reduce-scatters — every micro-batch's in copus's engine — or DP's
    all-reduce beyond the last micro-batch), embedding_sync_s —
    then bubble_s (pipeline fill and drain) and optimizer_s (+ fixed per-step cost).
    """
    bd = model.breakdown(dp, tp, pp, micro_batch_size, num_microbatches, **options)
    m = _i(num_microbatches)
    zero = np.zeros_like(bd["step_s"])
    elementwise = bd.get("elementwise_s", zero)
    emb = bd.get("embedding_sync_s", zero)
    mb = bd["microbatch_s"]
    exposed_ag = np.maximum(mb - bd["compute_s"] - elementwise - bd["tp_s"] - bd["p2p_s"], 0.0)
    last = bd["step_s"] - (m - 1.0) * mb - bd["bubble_s"] - emb - bd["optimizer_s"]
    return {
        "compute_s": m * (bd["compute_s"] - bd["recompute_s"] + elementwise),
        "recompute_s": m * bd["recompute_s"],
        "fsdp_allgather_s": m * exposed_ag,
        "tp_s": m * bd["tp_s"],
        "pp_p2p_s": m * bd["p2p_s"],
        "grad_sync_s": last - mb,
        "embedding_sync_s": emb + zero,
        "bubble_s": bd["bubble_s"] + zero,
        "optimizer_s": bd["optimizer_s"] + zero,
    }


def plan_columns(plans: Sequence[ParallelPlan]) -> tuple[np.ndarray, ...]:
    """(dp, tp, pp, micro_batch_size, num_microbatches) of `plans` as int64 arrays."""
    return tuple(
        np.array([getattr(pl, f) for pl in plans], dtype=np.int64)
        for f in ("dp", "tp", "pp", "micro_batch_size", "num_microbatches")
    )
