"""Memory model: peak bytes per rank of a plan, to prune candidates that would not fit (design §4).

    bytes = states + buffers + activations          on the fuller of the first and last stage

Precision (three regimes):
    fp32                        mixed_precision=False: everything 4 bytes (copus on CPU)
    bf16 autocast               mixed_precision=True, autocast=True (copus on CUDA, engine.py):
                                fp32 parameters, gradients and all-gathers; matmuls in bf16, and
                                each micro-batch's graph keeps a bf16 copy of every weight it used
    bf16 parameters             mixed_precision=True, autocast=False (FSDP2 MixedPrecisionPolicy,
                                Megatron): bf16 params/grads/all-gathers + fp32 master weights
states (ZeRO-3 / FSDP2 sharding; Rajbhandari et al. SC'20 §3.1, mixed-precision Adam = 2Ψ + 2Ψ + 12Ψ):
    P_stage / (tp·dp) · (param_bytes + grad_bytes + master_bytes + optimizer_bytes)
    = 16 bytes per parameter for AdamW in every regime (4+4+0+8 or 2+2+4+8); SGD with momentum 12.
buffers (FSDP2 unsharded parameters and gradients, one unit = one block or the embedding/head):
    reshard_after_forward: 2 units unsharded at a time (current + prefetched), else every unit of
    the stage stays unsharded from forward to backward; plus 1 unit of unsharded gradients.
    bf16 autocast adds the saved bf16 weight copies: 2·P_stage/tp per micro-batch in flight
    (one unit with activation checkpointing, which recasts during the recompute).
activations per micro-batch and block (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4.1 eq. 2, tensor parallel without sequence
parallel, 16-bit activations):
    s·b·h · (10 + 24/tp) + 5·a·s²·b/tp         bytes; the last term is the stored attention scores,
                                                absent with flash / memory-efficient attention
    With full activation checkpointing (§4.3) each block keeps only its input, s·b·h elements of
    the residual stream, and one block's full set is live while it is recomputed. A SwiGLU MLP of
    width f ≈ 8h/3 stores three f-wide tensors (6·s·b·f ≈ 16·s·b·h bytes), as GPT's two 4h-wide
    GeLU tensors do, so the count carries over to Llama blocks.
    copus's own block (`runtime/engine/model.py`: RMSNorm and RoPE in fp32, SwiGLU, SDPA) saves more:
    measured with `torch.autograd.graph.saved_tensors_hooks`, per sample per block, 83 bytes·s·h
    in fp32 and 55.6 under bf16 autocast (the formula: 68 and 34). `activation_factor` (default
    those ratios, RUNTIME_ACTIVATION_FACTOR) scales the formula; 1.0 gives the paper's numbers.
    head (last stage): logits in the compute dtype and in fp32 for the loss, s·b·V·(e + 4).
    micro-batches in flight: 1 without a pipeline; 1F1B: the first stage holds min(pp, m), the last
    stage 1 (Narayanan et al. SC'21 §2.2); GPipe: every stage holds all m.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import numpy as np

from copus.core.specs.models import ModelShape

OPTIMIZER_BYTES = {"adamw": 8, "sgd": 4}
# measured / Korthikanti for copus's runtime block (module docstring)
RUNTIME_ACTIVATION_FACTOR = {"fp32": 83.1 / 68.0, "autocast": 55.6 / 34.0, "bf16": 83.1 / 68.0}
PP_SCHEDULES = ("1f1b", "gpipe")


def _f(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """Peak bytes per rank; see the module docstring. All methods broadcast over int arrays."""

    shape: ModelShape
    _: KW_ONLY
    bytes_per_param: int | None = None       # unsharded parameter bytes; None: from the regime
    optimizer: str = "adamw"
    mixed_precision: bool = True
    autocast: bool = True                    # with mixed_precision: copus's runtime regime
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    pp_schedule: str = "1f1b"
    flash_attention: bool = True
    activation_factor: float | None = None   # None: RUNTIME_ACTIVATION_FACTOR; 1.0: the paper
    # "fsdp2" (copus's runtime, the regimes above) or "megatron" (Megatron-LM as COPUS ran it:
    # bf16 params, fp32 main grads, fp32 master + moments, nothing sharded over dp: 18 bytes per
    # parameter; with `distributed_optimizer` 6 + 12/dp; Megatron-LM README, "Distributed
    # Optimizer"); Korthikanti's activation count as published (factor 1.0), no FSDP buffers.
    stack: str = "fsdp2"
    distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_BYTES:
            raise ValueError(f"optimizer={self.optimizer!r} is invalid; allowed: {', '.join(OPTIMIZER_BYTES)}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"pp_schedule={self.pp_schedule!r} is invalid; allowed: {', '.join(PP_SCHEDULES)}")
        if self.activation_factor is not None and not self.activation_factor > 0:
            raise ValueError(f"activation_factor={self.activation_factor!r} is invalid; allowed: a number > 0")
        if self.stack not in ("fsdp2", "megatron"):
            raise ValueError(f"stack={self.stack!r} is invalid; allowed: fsdp2, megatron")
        if self.bytes_per_param is not None and self.bytes_per_param not in (1, 2, 4, 8):
            raise ValueError(f"bytes_per_param={self.bytes_per_param!r} is invalid; allowed: 1, 2, 4, 8")

    # ---- per-element bytes ----------------------------------------------------------------------

    @property
    def regime(self) -> str:
        """"fp32", "autocast" or "bf16" (module docstring)."""
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
        moments = 4.0 + OPTIMIZER_BYTES[self.optimizer]          # fp32 master + Adam moments
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

    def activation_bytes_per_block(self, tp, micro_batch_size) -> np.ndarray:
        """Korthikanti et al. 2022 eq. 2 (bytes, one block, one micro-batch), no checkpointing."""
        s = self.shape
        sbh = s.seq_len * _f(micro_batch_size) * s.dim
        out = sbh * (10.0 + 24.0 / _f(tp))
        if not self.flash_attention:
            out = out + 5.0 * s.n_heads * s.seq_len * s.seq_len * _f(micro_batch_size) / _f(tp)
        factor = self.activation_factor
        if factor is None:
            factor = 1.0 if self.stack == "megatron" else RUNTIME_ACTIVATION_FACTOR[self.regime]
        return out * (self.compute_bytes / 2.0) * factor

    def _stored_per_block(self, tp, micro_batch_size) -> np.ndarray:
        """What one block keeps per in-flight micro-batch: everything, or only its input (AC)."""
        if self.activation_checkpointing:
            return self.shape.seq_len * _f(micro_batch_size) * self.shape.dim * float(self.residual_bytes)
        return self.activation_bytes_per_block(tp, micro_batch_size)

    def _head_bytes(self, micro_batch_size) -> np.ndarray:
        s = self.shape
        return s.seq_len * _f(micro_batch_size) * s.vocab_size * (self.compute_bytes + 4.0)

    def in_flight(self, pp, num_microbatches, last: bool) -> np.ndarray:
        """Micro-batches whose activations a stage holds at its peak."""
        pp, m = _f(pp), _f(num_microbatches)
        if self.pp_schedule == "gpipe":
            return np.where(pp > 1, m, 1.0)
        return np.ones_like(pp * m) if last else np.where(pp > 1, np.minimum(pp, m), 1.0)

    # ---- totals ---------------------------------------------------------------------------------

    def breakdown(self, dp, tp, pp, micro_batch_size, num_microbatches) -> dict[str, np.ndarray]:
        """Terms of the larger of the first and last stage (bytes); "total" is bytes_per_rank."""
        dp, tp, pp = _f(dp), _f(tp), _f(pp)
        b = _f(micro_batch_size)
        layers = np.ceil(self.shape.n_layers / pp)
        unit = max(self.shape.layer_params(), self.shape.vocab_size * self.shape.dim) / tp
        out: dict[str, np.ndarray] = {}
        for last in (False, True):
            params = self._stage_params(pp, last)
            in_flight = self.in_flight(pp, num_microbatches, last)
            if self.stack == "megatron":
                states = params / tp * self.megatron_bytes_per_param(dp)
                buffers = np.zeros_like(states)
            else:
                states = params / (tp * dp) * self.state_bytes_per_param
                if self.reshard_after_forward:
                    gathered = 2.0 * unit * self.param_bytes
                else:
                    gathered = params / tp * self.param_bytes
                buffers = gathered + unit * self.param_bytes
            if self.regime == "autocast":
                buffers = buffers + 2.0 * (unit if self.activation_checkpointing else in_flight * params / tp)
            acts = in_flight * layers * self._stored_per_block(tp, b)
            if self.activation_checkpointing:
                acts = acts + self.activation_bytes_per_block(tp, b)
            if last:
                acts = acts + self._head_bytes(b)
            else:
                acts = acts + np.where(pp > 1, 0.0, self._head_bytes(b))
            total = states + buffers + acts
            if not out:
                out = {"states": states, "buffers": buffers, "activations": acts, "total": total}
            else:
                pick = total > out["total"]
                for k, v in (("states", states), ("buffers", buffers), ("activations", acts),
                             ("total", total)):
                    out[k] = np.where(pick, v, out[k])
        return out

    def bytes_per_rank(self, dp, tp, pp, micro_batch_size, num_microbatches) -> np.ndarray:
        """Peak bytes on the fullest rank of the plan (vectorised)."""
        return self.breakdown(dp, tp, pp, micro_batch_size, num_microbatches)["total"]

    def fits(self, dp, tp, pp, micro_batch_size, num_microbatches, capacity_bytes: float) -> np.ndarray:
        """Boolean mask: bytes_per_rank ≤ capacity_bytes."""
        if not capacity_bytes > 0:
            raise ValueError(f"capacity_bytes={capacity_bytes!r} is invalid; allowed: a number > 0")
        return self.bytes_per_rank(dp, tp, pp, micro_batch_size, num_microbatches) <= capacity_bytes
