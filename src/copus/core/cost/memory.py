"""Memory model: peak bytes per rank of a plan, to prune candidates that would not fit (design §4).

    bytes = (states + buffers + activations) · (1 + allocator_overhead)   fuller of first/last stage

Each term is one small method below whose docstring states its count. P_stage = parameters of
the stage (ceil(L/pp) blocks + embedding or head), t = tp, d = dp, m = micro-batches per step,
b = micro-batch size, s = sequence length, h = hidden size, f = ffn width, kv = KV width, V = vocab.

Precision (three regimes):
    fp32                        mixed_precision=False: everything 4 bytes (copus on CPU)
    bf16 autocast               mixed_precision=True, autocast=True (copus on CUDA before issue 24):
                                fp32 parameters, gradients and all-gathers; matmuls in bf16, and
                                each micro-batch's graph keeps a bf16 copy of every weight it used
    bf16 parameters             mixed_precision=True, autocast=False (FSDP2 MixedPrecisionPolicy
                                as copus's runtime and torchtitan run it, Megatron): bf16 params/all-gathers, fp32
                                master weights, gradients reduced (and accumulated) in fp32
states (ZeRO-3 / FSDP2 sharding; Rajbhandari et al. SC'20 §3.1, mixed-precision Adam = 2Ψ + 2Ψ + 12Ψ):
    P_stage / (t·d) · (param + grad + master + optimizer bytes) = 16 B/param for AdamW
buffers (FSDP2; one unit = one block or the embedding/head, FSDP2's `fully_shard` granularity):
    gathered parameters  2 units (current + prefetched) with reshard-after-forward, else the
                         whole stage; the whole stage also under a pipeline with m ≥ 2
                         (torch.distributed.pipelining keeps FSDP modules unsharded between
                         micro-batches: `set_reshard_after_backward(False)`)
    gradients            1 unit unsharded while it is reduce-scattered. copus's runtime
                         reduce-scatters every micro-batch at pp = 1 (torchtitan's way), so
                         that stays 1 unit for any m. With m ≥ 2 the whole stage's gradients
                         stay unsharded in fp32 (FSDP2 accumulates in the reduce dtype),
                         4·P_stage/t, where gradient sync is off until the last micro-batch:
                         under a pipeline (torch.distributed.pipelining does that) and, with
                         `unsharded_accumulation` (the runtime's gns.small = "rank" at
                         dp ≥ 2, which needs each rank's own accumulated gradient), at pp = 1;
                         the sharded gradient (in "states") then only appears after the peak,
                         at the last micro-batch's reduce-scatter, and is not counted
    communicators        `comm_bytes_per_group` per process group this rank belongs to with
                         more than one rank (dp, tp, pp and the world): NCCL's per-peer
                         channel buffers (CUDA; 0 on CPU / gloo, whose buffers are per call)
    weight copies        bf16 autocast: the saved bf16 copy of every weight, 2·P_stage/t per
                         micro-batch in flight (one unit with checkpointing, recast on recompute)
activations per micro-batch and block (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4.1 eq. 2 and §4.2.2 eq. 4, 16-bit):
    none        s·b·h·(10 + 24/t) + 5·a·s²·b/t      bytes; 10 → 10/t with sequence parallel; the
                                                   last term (attention scores) is absent with
                                                   flash attention
    selective   torchtitan's op policy (`apply_ac`, "op"): the block's input, the outputs of wq,
                wv, attention (+ its fp32 log-sum-exp, one per head) and w1 (every second
                matmul, t-sharded) and of w2 are kept:
                s·b·[r·h/t_sp + (e·(2h + kv + f) + 4·a)/t + e·h/t_sp]   (t_sp = t with SP, else 1)
                (measured on copus's block through a dispatch mode applying that policy:
                exact, tests/core/test_memory.py)
    full        the block's input only, s·b·h·r/t_sp (§4.3)
    with either checkpointing mode one block's full set (the "none" count) is live during its
    recompute. r = residual bytes (4 under autocast), e = compute bytes.
    sequence parallel, any mode: one block's backward also holds the re-all-gathered input of a
    column-parallel group and its full-size gradient before the reduce-scatter, 2·e·s·b·h
    (`sp_gather_bytes`; at large micro-batches the term that full AC's s·b·h·r/t count misses).
    copus's own block (`runtime/engine/model.py`: RMSNorm and RoPE in fp32, SwiGLU, SDPA with
    `enable_gqa`) saves more: measured on `small` with `torch.autograd.graph.saved_tensors_hooks`,
    per sample per block, 78.8 bytes·s·h in fp32, 53.4 under bf16 autocast and 43.4 with bf16
    parameters (the formula: 68, 34 and 34). With bf16 parameters the count is, per token,
        2 RMSNorms × (4h fp32 input copy + 2h normalised + 2h weighted output) + SDPA's q, out (2h
        each), k, v (2·kv each) and fp32 log-sum-exp (4·a) + SwiGLU's w1, w3, silu, product (2f each)
        = 20h + 4·kv + 8f + 4a                (43.4·h on small; 42.6·h on TinyLlama-1.1B)
    (RoPE saves only its fp32 table: its angles need no gradient). The fp32 ratio (1.16 = 78.8/68)
    would under-count this by 9 %, hence a ratio of its own. `activation_factor` (default those
    ratios, RUNTIME_ACTIVATION_FACTOR) scales the "none" count; 1.0 gives the paper's numbers.
micro-batches in flight (in units of one micro-batch through a whole stage): 1 without a
    pipeline; GPipe: m; 1F1B: first stage min(pp, m), last 1 (Narayanan et al. SC'21 §2.2);
    interleaved 1F1B with v chunks per rank: first stage min(pp + (pp−1)/v, m) — L·(1 + (pp−1)/(pp·v))
    layer-micro-batches (Korthikanti §4.2.3; torch's ScheduleInterleaved1F1B warm-up of rank 0 is
    2(pp−1) + (v−1)·pp chunks) — last stage min(((v−1)·pp + 1)/v, m).
logits (head stage): s·b·V/t_lp·c bytes, t_lp = t with loss parallel. c = e + 4 by default,
    the logits in the compute dtype and their fp32 log-softmax. copus's runtime measured 12.0
    bytes per logit at the forward+backward peak in both fp32 and bf16 (bench/engine_memory.py,
    "logits": the fp32 log-softmax output, its gradient and the logits' gradient are live
    together; the head's weight gradient excluded), so the runtime passes `logit_bytes = 12`.
    torchtitan (`logit_bytes=12`): the bf16 logits are deleted before the backward (`del pred`),
    whose log-softmax backward holds three fp32 tensors (saved output, its gradient, the input
    gradient): c = 12 ≥ the forward's 2 + 4 + 4 (bf16 logits, `.float()` copy, log-softmax output).
allocator overhead: the CUDA caching allocator's reserved − allocated (fragmentation), a fraction
    of the rest; 0 by default, `ALLOCATOR_OVERHEAD` as fitted on torchtitan's 8B FSDP 8 row
    (bench/published.py, docs/published.md). Published GiB are `max_memory_reserved`. The
    runtime uses the fitted value on CUDA (the guard must hold reserved memory) and 0 on CPU
    (glibc returns large blocks to the system on free: reserved = allocated).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, replace

import numpy as np

from copus.core.plan.plan import AC_MODES, PIPELINE_SCHEDULES, ac_mode_name, check_choice, option_codes
from copus.core.specs.models import ModelShape

OPTIMIZER_BYTES = {"adamw": 8, "sgd": 4}
# measured / Korthikanti for copus's runtime block (module docstring)
RUNTIME_ACTIVATION_FACTOR = {"fp32": 78.8 / 68.0, "autocast": 53.4 / 34.0, "bf16": 43.4 / 34.0}
PP_SCHEDULES = PIPELINE_SCHEDULES
# reserved / allocated of the CUDA caching allocator, fitted on torchtitan's Llama-3.1-8B FSDP 8
# row (Table 1, 82.4 GiB) by bench/published.py; every other published row is held out.
ALLOCATOR_OVERHEAD = 0.10
# bytes per logit at the loss's forward+backward peak, measured on copus's runtime (fp32 and bf16
# alike; bench/engine_memory.py) and torchtitan's `logit_bytes`
RUNTIME_LOGIT_BYTES = 12.0
# NCCL buffers per communicator (hypothesis, not measured here): the Simple protocol's
# NCCL_BUFFSIZE = 4 MiB per channel, send and receive, up to 32 channels on NVLink: 2·32·4 MiB
NCCL_COMM_BYTES = 256 * 2**20


def _f(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """Peak bytes per rank; see the module docstring. All methods broadcast over int arrays.

    The fields are defaults; `breakdown`/`bytes_per_rank` take the per-plan choices
    (activation_checkpointing, pipeline_schedule, virtual_stages, sequence_parallel,
    reshard_after_forward) as keywords too: a name, or an array of codes (indices into
    `AC_MODES` / `PIPELINE_SCHEDULES`) or of booleans, one per candidate.
    """

    shape: ModelShape
    _: KW_ONLY
    bytes_per_param: int | None = None  # unsharded parameter bytes; None: from the regime
    optimizer: str = "adamw"
    mixed_precision: bool = True
    autocast: bool = True  # bf16 autocast over fp32 params (the runtime passes False)
    activation_checkpointing: bool | str = False  # False/"none", "selective", True/"full"
    reshard_after_forward: bool = True
    pp_schedule: str = "1f1b"
    flash_attention: bool = True
    activation_factor: float | None = None  # None: RUNTIME_ACTIVATION_FACTOR; 1.0: the paper
    # "fsdp2" (copus's runtime, the regimes above) or "megatron" (Megatron-LM as COPUS ran it:
    # bf16 params, fp32 main grads, fp32 master + moments, nothing sharded over dp: 18 bytes per
    # parameter; with `distributed_optimizer` 6 + 12/dp; Megatron-LM README, "Distributed
    # Optimizer"); Korthikanti's activation count as published (factor 1.0), no FSDP buffers.
    stack: str = "fsdp2"
    distributed_optimizer: bool = False
    virtual_stages: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False  # logits sharded over tp along the vocabulary
    logit_bytes: float | None = None  # bytes per logit at the loss peak; None: e + 4 (torchtitan: 12)
    allocator_overhead: float = 0.0  # reserved/allocated − 1 (ALLOCATOR_OVERHEAD: fitted)
    accumulation_buffers: bool = True  # unsharded fp32 grads (+ params under pp) when m ≥ 2
    unsharded_accumulation: bool = False  # pp = 1 also without gradient sync until the last
    #                                          micro-batch (the runtime's gns.small = "rank")
    comm_bytes_per_group: float = 0.0  # communicator buffers per process group (> 1 rank)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_BYTES:
            raise ValueError(f"optimizer={self.optimizer!r} is invalid; allowed: {', '.join(OPTIMIZER_BYTES)}")
        check_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        ac_mode_name(self.activation_checkpointing)
        if self.activation_factor is not None and not self.activation_factor > 0:
            raise ValueError(f"activation_factor={self.activation_factor!r} is invalid; allowed: a number > 0")
        if self.stack not in ("fsdp2", "megatron"):
            raise ValueError(f"stack={self.stack!r} is invalid; allowed: fsdp2, megatron")
        if self.bytes_per_param is not None and self.bytes_per_param not in (1, 2, 4, 8):
            raise ValueError(f"bytes_per_param={self.bytes_per_param!r} is invalid; allowed: 1, 2, 4, 8")
        if not self.allocator_overhead >= 0:
            raise ValueError(f"allocator_overhead={self.allocator_overhead!r} is invalid; allowed: >= 0")
        if self.virtual_stages < 1:
            raise ValueError(f"virtual_stages={self.virtual_stages!r} is invalid; allowed: an integer >= 1")

    def with_plan_options(self, **options) -> MemoryModel:
        """This model with a plan's options (`ParallelPlan.options` keys) as its defaults."""
        names = {
            "activation_checkpointing": "activation_checkpointing",
            "pipeline_schedule": "pp_schedule",
            "virtual_stages": "virtual_stages",
            "sequence_parallel": "sequence_parallel",
            "reshard_after_forward": "reshard_after_forward",
        }
        unknown = set(options) - set(names)
        if unknown:
            raise ValueError(f"unknown plan options {sorted(unknown)}; allowed: {', '.join(names)}")
        return replace(self, **{names[k]: v for k, v in options.items()})

    # ---- per-element bytes ----------------------------------------------------------------------

    @property
    def ac_mode(self) -> str:
        """The default activation-checkpointing mode: "none", "selective" or "full"."""
        return ac_mode_name(self.activation_checkpointing)

    @property
    def regime(self) -> str:
        """ "fp32", "autocast" or "bf16" (module docstring)."""
        if not self.mixed_precision:
            return "fp32"
        return "autocast" if self.autocast and self.stack == "fsdp2" else "bf16"

    @property
    def param_bytes(self) -> int:
        """Bytes of an unsharded (all-gathered) parameter and of its gradient."""
        if self.bytes_per_param is not None:
            return self.bytes_per_param
        return 2 if self.regime == "bf16" else 4

    @property
    def compute_bytes(self) -> int:
        """Bytes of an activation element in matmuls: 2 under bf16, else 4."""
        return 4 if self.regime == "fp32" else 2

    @property
    def residual_bytes(self) -> int:
        """Bytes of the residual stream (a block's input): fp32 under autocast."""
        return 2 if self.regime == "bf16" else 4

    @property
    def state_bytes_per_param(self) -> int:
        """param + grad + fp32 master (bf16 parameters only) + optimizer moments."""
        master = 4 if self.param_bytes < 4 else 0
        return 2 * self.param_bytes + master + OPTIMIZER_BYTES[self.optimizer]

    def megatron_bytes_per_param(self, dp) -> np.ndarray:
        """Megatron-LM, bf16 params + fp32 grads: 18 replicated, 6 + 12/dp distributed (README)."""
        moments = 4.0 + OPTIMIZER_BYTES[self.optimizer]  # fp32 master + Adam moments
        if self.distributed_optimizer:
            return 6.0 + moments / _f(dp)
        return 6.0 + moments + 0.0 * _f(dp)

    # ---- stage contents --------------------------------------------------------------------

    def _stage_params(self, pp: np.ndarray, last: bool) -> np.ndarray:
        """Parameters on the first (last=False) or last stage: ceil(L/pp) blocks + embedding/head."""
        s = self.shape
        blocks = np.ceil(s.n_layers / pp) * s.layer_params()
        single = float(s.embedding_params())
        stage_emb = s.vocab_size * s.dim + (s.dim if last else 0)
        return blocks + np.where(pp > 1, stage_emb, single)

    def _factor(self) -> float:
        if self.activation_factor is not None:
            return self.activation_factor
        return 1.0 if self.stack == "megatron" else RUNTIME_ACTIVATION_FACTOR[self.regime]

    def activation_bytes_per_block(self, tp, micro_batch_size, sequence_parallel=None) -> np.ndarray:
        """ "none": Korthikanti eq. 2 (eq. 4 with sequence parallel) × factor; bytes, one block, one micro-batch."""
        s = self.shape
        sp = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        tp = _f(tp)
        sbh = s.seq_len * _f(micro_batch_size) * s.dim
        out = sbh * (10.0 / np.where(sp, tp, 1.0) + 24.0 / tp)
        if not self.flash_attention:
            out = out + 5.0 * s.n_heads * s.seq_len * s.seq_len * _f(micro_batch_size) / tp
        return out * (self.compute_bytes / 2.0) * self._factor()

    def selective_bytes_per_block(self, tp, micro_batch_size, sequence_parallel=None) -> np.ndarray:
        """ "selective" (torchtitan op policy): s·b·[r·h/t_sp + (e·(2h + kv + f) + 4·a)/t + e·h/t_sp] bytes."""
        s = self.shape
        sp = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        tp = _f(tp)
        t_sp = np.where(sp, tp, 1.0)
        kv = s.n_kv_heads * s.head_dim
        e, r = float(self.compute_bytes), float(self.residual_bytes)
        return (
            s.seq_len
            * _f(micro_batch_size)
            * (r * s.dim / t_sp + (e * (2 * s.dim + kv + s.ffn_dim) + 4.0 * s.n_heads) / tp + e * s.dim / t_sp)
        )

    def full_bytes_per_block(self, tp, micro_batch_size, sequence_parallel=None) -> np.ndarray:
        """ "full": the block's input, s·b·h·r/t_sp bytes (Korthikanti §4.3)."""
        sp = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        t_sp = np.where(sp, _f(tp), 1.0)
        return self.shape.seq_len * _f(micro_batch_size) * self.shape.dim * float(self.residual_bytes) / t_sp

    def sp_gather_bytes(self, tp, micro_batch_size, sequence_parallel=None) -> np.ndarray:
        """Sequence parallel's unsharded transients in a block's backward: the all-gathered
        input of a column-parallel group (wq·wk·wv or w1·w3) and the input gradient before its
        reduce-scatter, full sequence, compute dtype: 2·e·s·b·h bytes with sp and t > 1, else 0.

        Korthikanti et al. 2022 §4.2.2 store only the sharded norm output (10·s·b·h/t) and
        all-gather it again in the backward; the gathered copy and its full-size gradient are
        alive together while that group's weight and input gradients are computed. Without
        sequence parallelism those tensors are full size already (the "none" count holds them).
        """
        sp = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        tp = _f(tp)
        full = 2.0 * self.compute_bytes * self.shape.seq_len * _f(micro_batch_size) * self.shape.dim
        return np.where(np.asarray(sp) & (tp > 1), full, 0.0)

    def stored_per_block(self, tp, micro_batch_size, ac, sequence_parallel=None) -> np.ndarray:
        """Bytes one block keeps per in-flight micro-batch under AC mode codes `ac` (0, 1, 2)."""
        ac = np.asarray(ac)
        none = self.activation_bytes_per_block(tp, micro_batch_size, sequence_parallel)
        sel = self.selective_bytes_per_block(tp, micro_batch_size, sequence_parallel)
        full = self.full_bytes_per_block(tp, micro_batch_size, sequence_parallel)
        return np.where(ac == 2, full, np.where(ac == 1, np.minimum(sel, none), none))

    def in_flight(self, pp, num_microbatches, last: bool, schedule=None, virtual_stages=None) -> np.ndarray:
        """Micro-batches (through a whole stage) whose activations a stage holds at its peak."""
        pp, m = _f(pp), _f(num_microbatches)
        code = option_codes(schedule, self.pp_schedule, PIPELINE_SCHEDULES, "pipeline_schedule")
        v = _f(self.virtual_stages if virtual_stages is None else virtual_stages)
        one_f = np.ones_like(pp * m) if last else np.minimum(pp, m)
        inter = np.minimum(((v - 1) * pp + 1) / v, m) if last else np.minimum(pp + (pp - 1) / v, m)
        sched = np.where(code == 1, m, np.where(code == 2, inter, one_f))
        return np.where(pp > 1, sched, 1.0)

    # ---- components (bytes) -----------------------------------------------------------------

    def states_bytes(self, params, dp, tp) -> np.ndarray:
        """Sharded parameters, gradients, master weights and moments: P/(t·d) · 16 (AdamW);
        Megatron: P/t · (18, or 6 + 12/d with the distributed optimizer)."""
        if self.stack == "megatron":
            return params / tp * self.megatron_bytes_per_param(dp)
        return params / (tp * dp) * self.state_bytes_per_param

    def gathered_params_bytes(self, params, unit, tp, pp, m, reshard) -> np.ndarray:
        """Unsharded parameters: 2 units (current + prefetched) · e_p when resharding after
        forward; the whole stage, P/t · e_p, without it or under a pipeline with m ≥ 2."""
        whole = (np.asarray(reshard) == 0) | ((pp > 1) & (m >= 2) & self.accumulation_buffers)
        return np.where(whole, params / tp, 2.0 * unit) * self.param_bytes

    def unsharded_grad_bytes(self, params, unit, tp, m, pp=1, dp=2) -> np.ndarray:
        """One unit · e_p while it is reduce-scattered; with m ≥ 2 and gradient sync off until
        the last micro-batch (pp > 1, or `unsharded_accumulation` at dp ≥ 2) the stage's fp32
        accumulated gradients, 4 · P/t."""
        acc = self._no_sync(m, pp, dp)
        return np.where(acc, 4.0 * params / tp, unit * self.param_bytes)

    def _no_sync(self, m, pp, dp) -> np.ndarray:
        """Whether gradient sync is off until the last micro-batch (see `unsharded_grad_bytes`)."""
        no_sync = (_f(pp) > 1) | (self.unsharded_accumulation & (_f(dp) > 1))
        return (_f(m) >= 2) & self.accumulation_buffers & no_sync

    def comm_bytes(self, dp, tp, pp) -> np.ndarray:
        """`comm_bytes_per_group` × the process groups of > 1 rank this rank is in (dp, tp, pp,
        world)."""
        dp, tp, pp = _f(dp), _f(tp), _f(pp)
        groups = (dp > 1).astype(float) + (tp > 1) + (pp > 1) + (dp * tp * pp > 1)
        return groups * self.comm_bytes_per_group

    def weight_copy_bytes(self, params, unit, tp, in_flight, ac) -> np.ndarray:
        """bf16 autocast: 2 · P/t per micro-batch in flight (2 · unit with checkpointing); else 0."""
        if self.regime != "autocast":
            return np.zeros(np.broadcast(params, in_flight, ac).shape)
        return 2.0 * np.where(np.asarray(ac) > 0, unit, in_flight * params / tp)

    def logits_bytes(self, tp, micro_batch_size) -> np.ndarray:
        """s·b·V/t_lp · c: c = e + 4 (logits + fp32 log-softmax) unless `logit_bytes` is set."""
        s = self.shape
        t_lp = _f(tp) if self.loss_parallel else 1.0
        c = self.compute_bytes + 4.0 if self.logit_bytes is None else float(self.logit_bytes)
        return s.seq_len * _f(micro_batch_size) * s.vocab_size / t_lp * c

    # ---- totals ---------------------------------------------------------------------------------

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
        """Every component of the fuller of the first and last stage (bytes); "total" = bytes_per_rank.

        "states", "buffers" (= params_gathered + grads_unsharded + weight_copies + communicators) and
        "activations" (= blocks + recompute + sp_gather + logits) are the sums the memory guard reads;
        "allocator" = allocator_overhead · their sum.
        """
        dp, tp, pp, m = _f(dp), _f(tp), _f(pp), _f(num_microbatches)
        b = _f(micro_batch_size)
        ac = option_codes(activation_checkpointing, self.ac_mode, AC_MODES, "activation_checkpointing")
        sp = np.asarray(self.sequence_parallel if sequence_parallel is None else sequence_parallel) & (tp > 1)
        reshard = np.asarray(
            self.reshard_after_forward if reshard_after_forward is None else reshard_after_forward
        ).astype(np.int64)
        layers = np.ceil(self.shape.n_layers / pp)
        unit = max(self.shape.layer_params(), self.shape.vocab_size * self.shape.dim) / tp
        full_set = self.activation_bytes_per_block(tp, b, sp)
        stored = self.stored_per_block(tp, b, ac, sp)
        out: dict[str, np.ndarray] = {}
        for last in (False, True):
            params = self._stage_params(pp, last)
            flight = self.in_flight(pp, m, last, pipeline_schedule, virtual_stages)
            parts = {"states": self.states_bytes(params, dp, tp)}
            zero = np.zeros_like(parts["states"])
            if self.stack == "megatron":
                parts.update(params_gathered=zero, grads_unsharded=zero)
            else:
                parts["params_gathered"] = self.gathered_params_bytes(params, unit, tp, pp, m, reshard)
                parts["grads_unsharded"] = self.unsharded_grad_bytes(params, unit, tp, m, pp, dp)
                # without sync the sharded gradient is created by the last micro-batch's
                # reduce-scatter, after the peak (the previous step's was freed by zero_grad)
                parts["states"] = parts["states"] - np.where(
                    self._no_sync(m, pp, dp), params / (tp * dp) * self.param_bytes, 0.0
                )
            parts["weight_copies"] = self.weight_copy_bytes(params, unit, tp, flight, ac)
            parts["communicators"] = self.comm_bytes(dp, tp, pp) + zero
            parts["blocks"] = flight * layers * stored
            parts["recompute"] = np.where(ac > 0, full_set, 0.0) + zero
            parts["sp_gather"] = self.sp_gather_bytes(tp, b, sp) + zero
            head = self.logits_bytes(tp, b)
            parts["logits"] = (head if last else np.where(pp > 1, 0.0, head)) + zero
            parts["buffers"] = (
                parts["params_gathered"] + parts["grads_unsharded"] + parts["weight_copies"] + parts["communicators"]
            )
            parts["activations"] = parts["blocks"] + parts["recompute"] + parts["sp_gather"] + parts["logits"]
            raw = parts["states"] + parts["buffers"] + parts["activations"]
            parts["allocator"] = raw * self.allocator_overhead
            parts["total"] = raw + parts["allocator"]
            if not out:
                out = parts
            else:
                pick = parts["total"] > out["total"]
                out = {k: np.where(pick, v, out[k]) for k, v in parts.items()}
        return out

    def bytes_per_rank(self, dp, tp, pp, micro_batch_size, num_microbatches, **options) -> np.ndarray:
        """Peak bytes on the fullest rank of the plan (vectorised); `options` as `breakdown`."""
        return self.breakdown(dp, tp, pp, micro_batch_size, num_microbatches, **options)["total"]

    def fits(self, dp, tp, pp, micro_batch_size, num_microbatches, capacity_bytes: float, **options) -> np.ndarray:
        """Boolean mask: bytes_per_rank ≤ capacity_bytes."""
        if not capacity_bytes > 0:
            raise ValueError(f"capacity_bytes={capacity_bytes!r} is invalid; allowed: a number > 0")
        return self.bytes_per_rank(dp, tp, pp, micro_batch_size, num_microbatches, **options) <= capacity_bytes
