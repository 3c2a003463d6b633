"""Step time of copus's own runtime on CPU + gloo when ranks share cores (issue 15 part 5).

Two models, the second the CPU prior (`core.fit.prior_model` when world > cores):

`SharedCoreStepTimeModel` (the first version, kept for comparison in bench/throughput_model.py)
takes `StepTimeModel`'s terms and adds the shared-core bound below. `GlooCpuStepTimeModel`
replaces the communication terms by the collectives copus's runtime actually issues, each priced
per *call*, which is what dominates on an oversubscribed CPU (docs/cost-model.md, "Step time
on CPU + gloo": hypothesis, counts, fitted values, benchmark).

Shared-core bound (both models). `StepTimeModel` prices the critical path as if every rank had its
own processor. With more ranks than cores the ranks time-share the cores: a rank that waits (a
pipeline bubble, a collective whose peers are not scheduled) gives its core away, and the step
cannot end before the cores have done all the ranks' work:

    busy_s   = step_s − bubble_s            one rank's own work per step
    shared_s = (world / cores) · busy_s     every rank's work spread over the cores
    step_s'  = max(step_s, shared_s)

(cf. the CPU lower bound `max(Σ_ranks CPU / cores, CPU of the busiest rank)` in
docs/plan-moves.md). With world ≤ cores it is the critical path unchanged.

Collectives per micro-batch on one rank of the last (head) stage, counted on the runtime
(`runtime/engine/parallelize.py`; a fake-process-group count in tests/runtime/test_cpu_collectives.py):

    TP (DTensor, no sequence parallel): per block 2 forward all-reduces (row-wise wo, w2) and 5
        backward all-reduces (the input gradient of each column-wise wq, wk, wv, w1, w3 is
        reduced by its own `from_local` backward), 2 more forward with activation checkpointing;
        the embedding's forward all-reduce (pp = 1) and the head's input-gradient all-reduce; one
        all-gather of the vocab-sharded logits:
            n_ar = (7 + 2·AC)·L_stage + (2 if pp = 1 else 1),   n_ag = 1
        (StepTimeModel counts Megatron's 4 per block + 2: the source of the old model's ±10 %
        errors on dp1·tp2·pp2 and dp2·tp2·pp1.)
    FSDP2: one all-gather per unit (block or root) per forward and per backward without a
        pipeline (2·units); inside a pipeline stage 1·units, because torch's `PipelineStage`
        keeps parameters unsharded after a non-last backward (`set_reshard_after_backward(False)`)
        so the next forward finds them gathered; with reshard_after_forward=False one all-gather
        per unit per step. One reduce-scatter per unit per step.
    PP: 2 point-to-point messages (activation out, gradient back), as StepTimeModel.

Per-call pricing (α per call, not per ring step): a gloo collective on a host with more ranks
than cores costs a few milliseconds per call (the calling rank sleeps in its gloo worker, is
woken when every peer has entered, and waits for a core; about one scheduler slice), nearly
whatever the group size: one α per call for the 2- and 4-rank FSDP groups fits the 4-rank
profile better than (dp−1) ring steps per call, which mispriced dp4 against dp2·tp2
(held-out MAPE 8.1 vs 10.7 %). Terms, all in seconds on one rank:

    compute   = α_c·units + β_c·flops_stage(b)·b / tp                          (StepTimeModel)
    tp_s      = (n_ar + n_ag)·α_tp + [n_ar·2(tp−1)/tp·b·s·h + n_ag·(tp−1)/tp·b·s·V]·e·β_tp
    ag_s      = k·units·α_dp + k·(dp−1)/dp · P_stage/tp · e_p · β_dp      k = all-gathers per unit
    p2p_s     = 2·(α_pp + b·s·h·e·β_pp)
    t_mb      = compute + tp_s + ag_s + p2p_s                           (γ = 1: no idle core to
                                                                          overlap a collective on)
    sync_s    = units·α_dp + (dp−1)/dp · P_stage/tp · 4 · β_dp         fp32 gradient reduce-scatter
    step_s    = (m + pp − 1)·t_mb + sync_s + β_opt·P_stage/(tp·dp) + c_step,  then the bound above

α_tp, α_dp, α_pp: seconds per call of that group's collectives (tp_latency_s, dp_latency_s,
pp_latency_s); β: seconds per byte (gloo over TCP loopback, the reduction arithmetic included);
the other coefficients as in `StepTimeModel`. All are fitted by `core.fit.fit_model`; γ is not
used (`unused_params`, pinned by the fit). `cores` is the machine's (`setup.job_cores`), not
fitted. Not modelled: sequence parallelism (its all-gathers / reduce-scatters replace the
all-reduces), the cache-size effect on per-sample compute (tried: −0.2 points of MAPE).
"""

from __future__ import annotations

import numpy as np

from copus.core.specs.hardware import HardwareProfile
from copus.core.specs.models import ModelShape
from copus.core.cost.throughput import (
    GRAD_BYTES,
    TP_ALLREDUCES_PER_BLOCK,
    StepTimeModel,
    StepTimeParams,
)


def _f(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def shared_core_bound(out: dict[str, np.ndarray], world: np.ndarray, cores: int) -> dict[str, np.ndarray]:
    """Adds "busy_s", "shared_s", "critical_s" to a breakdown; "step_s" becomes
    max(critical, max(world/cores, 1)·(critical − bubble)) (module docstring)."""
    share = np.maximum(world / cores, 1.0)
    busy = out["step_s"] - out["bubble_s"]
    shared = share * busy
    out.update(busy_s=busy, shared_s=shared, critical_s=out["step_s"], step_s=np.maximum(out["step_s"], shared))
    return out


class SharedCoreStepTimeModel(StepTimeModel):
    """`StepTimeModel` for `world` ranks time-sharing `cores` CPU cores (module docstring)."""

    unused_params: tuple[str, ...] = ()

    def __init__(
        self,
        params: StepTimeParams,
        shape: ModelShape,
        hardware: HardwareProfile | None = None,
        *,
        cores: int,
        **options,
    ) -> None:
        if not (isinstance(cores, int) and cores >= 1):
            raise ValueError(f"cores={cores!r} is invalid; allowed: an integer >= 1")
        super().__init__(params, shape, hardware, **options)
        self.cores = cores

    def with_params(self, params: StepTimeParams) -> SharedCoreStepTimeModel:
        return type(self)(
            params,
            self.shape,
            self.hardware,
            cores=self.cores,
            world_size=self.world_size,
            dtype_bytes=self.dtype_bytes,
            param_bytes=self.param_bytes,
            activation_checkpointing=self.activation_checkpointing,
            reshard_after_forward=self.reshard_after_forward,
        )

    def critical_breakdown(self, dp, tp, pp, micro_batch_size, num_microbatches) -> dict[str, np.ndarray]:
        """The terms of one rank with its own processor; "step_s" is the critical path."""
        return super().breakdown(dp, tp, pp, micro_batch_size, num_microbatches)

    def breakdown(self, dp, tp, pp, micro_batch_size, num_microbatches) -> dict[str, np.ndarray]:
        """The critical-path terms plus "busy_s", "shared_s" and "critical_s"; "step_s" is the larger."""
        out = self.critical_breakdown(dp, tp, pp, micro_batch_size, num_microbatches)
        return shared_core_bound(out, _f(dp) * _f(tp) * _f(pp), self.cores)


class GlooCpuStepTimeModel(SharedCoreStepTimeModel):
    """copus's runtime on CPU + gloo: counted collectives priced per call, shared cores
    (module docstring). The CPU prior of `core.fit.prior_model` when world > cores."""

    unused_params = ("gamma",)

    def tp_calls(self, tp, pp) -> tuple[np.ndarray, np.ndarray]:
        """(all-reduces, all-gathers) of tensor parallelism per micro-batch on the last stage."""
        layers = self.stage_layers(_f(pp))
        per_block = TP_ALLREDUCES_PER_BLOCK + self.tp_recompute_per_block(self.ac_codes())
        ends = np.where(_f(pp) > 1, 1.0, 2.0)  # embedding forward (pp = 1) + head backward
        on = _f(tp) > 1
        return np.where(on, per_block * layers + ends, 0.0), np.where(on, 1.0, 0.0)

    def fsdp_gathers_per_unit(self, dp, pp) -> np.ndarray:
        """FSDP2 all-gathers of each unit per micro-batch (0 at dp = 1: no collective)."""
        if not self.reshard_after_forward:
            per_unit = np.zeros(np.shape(_f(pp)))
        else:
            per_unit = np.where(_f(pp) > 1, 1.0, 2.0)
        return np.where(_f(dp) > 1, per_unit, 0.0)

    def critical_breakdown(self, dp, tp, pp, micro_batch_size, num_microbatches) -> dict[str, np.ndarray]:
        """Every term of the module docstring's equation on one rank; "step_s" is the critical path."""
        p, s = self.params, self.shape
        dp_f, tp_f, pp_f, b, m = (_f(x) for x in (dp, tp, pp, micro_batch_size, num_microbatches))
        layers = self.stage_layers(pp_f)
        units = layers + 1.0
        local_params = self.stage_params(pp_f) / tp_f
        e = self.dtype_bytes
        act_bytes = b * s.seq_len * s.dim * e
        logit_bytes = b * s.seq_len * s.vocab_size * e

        compute = p.layer_overhead_s * units + p.s_per_flop * self.stage_flops_per_sample(pp_f) * b / tp_f
        n_ar, n_ag = self.tp_calls(tp_f, pp_f)
        tp_s = (n_ar + n_ag) * p.tp_latency_s + (
            n_ar * 2 * (tp_f - 1) / tp_f * act_bytes + n_ag * (tp_f - 1) / tp_f * logit_bytes
        ) * p.tp_s_per_byte
        dp_on = dp_f > 1
        dp_frac = (dp_f - 1) / dp_f
        k = self.fsdp_gathers_per_unit(dp_f, pp_f)
        allgather = k * (units * p.dp_latency_s + dp_frac * local_params * self.param_bytes * p.dp_s_per_byte)
        p2p = np.where(pp_f > 1, 2.0 * (p.pp_latency_s + act_bytes * p.pp_s_per_byte), 0.0)
        microbatch = compute + tp_s + allgather + p2p
        gathers_per_step = np.where(dp_on & (k == 0), 1.0, 0.0)  # reshard_after_forward=False
        sync = np.where(
            dp_on,
            (1.0 + gathers_per_step) * units * p.dp_latency_s
            + dp_frac * local_params * (GRAD_BYTES + gathers_per_step * self.param_bytes) * p.dp_s_per_byte,
            0.0,
        )
        optimizer = p.optimizer_s_per_param * local_params / dp_f + p.step_overhead_s
        step = (m + pp_f - 1.0) * microbatch + sync + optimizer
        return {
            "compute_s": compute,
            "tp_s": tp_s,
            "p2p_s": p2p,
            "allgather_s": allgather,
            "microbatch_s": microbatch,
            "sync_s": sync,
            "optimizer_s": optimizer,
            "bubble_s": (pp_f - 1.0) * microbatch,
            "step_s": step,
            "tp_calls": n_ar + n_ag,
            "fsdp_calls": k * units,
        }
