"""The per-rank 3D training engine: one layout's mesh, model, optimizer and gradient statistics.

Build order (each step documented in its module): meta model → pipeline split (`pipeline.py`)
→ TP → activation checkpointing → torch.compile → FSDP2 with its mixed-precision policy
(`parallelize.py`) → `to_empty` + shard-local tile-seeded init (`model.py`; none with
`init=False`) → AdamW (after wrapping: parameters are DTensors; fused on CUDA) → `GradStats`
hooks. `close()` frees the tensors by reference counting (`release.py`).

Precision (`dtype`): "bf16" runs FSDP2's `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`: fp32 sharded master weights and optimizer state, bf16 all-gathers and
compute, fp32 gradient accumulation and reduce-scatters (torchtitan's default); "auto" is bf16 on
CUDA and fp32 elsewhere. The loss and every noise-scale sum are fp32 (`grad_stats`).

One `train_step` = num_microbatches forward/backward passes per dp rank (plain gradient
accumulation, or a pipeline schedule at pp > 1), ONE all-reduce of a small fp32/fp64 vector
[loss, Σ_j‖g_j‖², ‖ḡ‖², g_jᵀḡ...] over the world, clipping by the global norm, then AdamW.
Statistics are taken before clipping; if the loss or any statistic is not finite the optimizer
step is skipped and the gradients dropped.

Accumulation memory (pp = 1): with `gns.small = "microbatch"` (the default) FSDP2 reduce-scatters
after every micro-batch and adds the result to the sharded fp32 gradient, so per rank the
gradient costs 4·P/(tp·dp) bytes plus one FSDP unit's unsharded gradient in flight, whatever
num_microbatches is (the per-micro-batch statistic is read by a tensor hook before the reduce,
unchanged). `gns.small = "rank"` needs this rank's gradient summed over its micro-batches before
the dp reduction, which by definition is dp-unsharded: it reduce-scatters on the last
micro-batch only and holds 4·P/tp bytes of unsharded fp32 gradient when num_microbatches ≥ 2
(`core/cost/memory.py` counts it in that mode only). Under pp > 1 torch's pipeline schedule
disables gradient sync until the last backward in both modes (`pipeline.py`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from copus.core.specs.models import ModelShape
from copus.core.plan.plan import ParallelPlan
from copus.runtime.engine.dist import MeshCache
from copus.runtime.engine.grad_stats import MODES, GradStats, weighted_sqnorm
from copus.runtime.engine.model import build_model, materialize
from copus.runtime.engine.optim import build_adamw
from copus.runtime.engine.parallelize import DTYPES, ac_mode, check_compile_available, parallelize
from copus.runtime.engine.pipeline import SCHEDULES, Pipeline, split_stage
from copus.runtime.engine.release import drop_tensors

DCP_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """Learning-rate-independent settings of the model build and optimizer."""

    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = off
    pp_schedule: str = "1f1b"  # "1f1b" | "gpipe"
    activation_checkpointing: bool | str = "none"  # "none" | "selective" | "full" (bool: full/none)
    reshard_after_forward: bool = True
    sequence_parallel: bool = False
    loss_parallel: bool = True  # under TP: vocab-sharded logits and loss
    gns_small: str = "microbatch"  # "microbatch" | "rank"
    ip_extras: bool = False  # keep small gradients for g_jᵀḡ (memory, see grad_stats)
    dtype: str = "auto"  # "auto" (bf16 on CUDA, else fp32) | "fp32" | "bf16"
    compile: bool = False  # torch.compile each block (inductor)

    def __post_init__(self) -> None:
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule={self.pp_schedule!r} is invalid; allowed: {', '.join(SCHEDULES)}")
        if self.gns_small not in MODES:
            raise ValueError(f"gns_small={self.gns_small!r} is invalid; allowed: {', '.join(MODES)}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype={self.dtype!r} is invalid; allowed: auto, {', '.join(DTYPES)}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip={self.grad_clip} is invalid; allowed: >= 0 (0 = off)")
        ac_mode(self.activation_checkpointing)  # raises on an unknown mode
        if self.compile:
            check_compile_available()

    def resolved_dtype(self, device: torch.device) -> str:
        """ "auto" → "bf16" on CUDA, "fp32" elsewhere; other values as given."""
        if self.dtype == "auto":
            return "bf16" if torch.device(device).type == "cuda" else "fp32"
        return self.dtype


def settings_from_config(cfg, ip_extras: bool = False) -> EngineSettings:
    """The engine's settings from a `copus.config.Config` (trainer, profiler, benchmarks)."""
    t, par = cfg.train, cfg.parallel
    return EngineSettings(
        weight_decay=t.weight_decay,
        beta1=t.beta1,
        beta2=t.beta2,
        eps=t.eps,
        grad_clip=t.grad_clip,
        pp_schedule=par.pp_schedule,
        activation_checkpointing=par.activation_checkpointing,
        reshard_after_forward=par.reshard_after_forward,
        sequence_parallel=par.sequence_parallel,
        loss_parallel=par.loss_parallel,
        gns_small=cfg.gns.small,
        ip_extras=ip_extras,
        dtype=t.dtype,
        compile=t.compile,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutput:
    """One optimizer step, identical on every rank (statistics before clipping)."""

    loss: float  # mean token loss over the global batch
    small_sqnorm: float  # s̄ = mean_j ‖g_j‖²
    small_batch: int  # samples per small gradient
    num_small: int  # J
    big_sqnorm: float  # q = ‖ḡ‖², ḡ over the global batch
    ip_sq_mean: float | None  # (1/J) Σ_j (g_jᵀḡ)², only with ip_extras
    grad_norm: float  # ‖ḡ‖ before clipping
    finite: bool  # False: optimizer step skipped, gradients dropped


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32). With vocab-sharded DTensor logits (loss parallel)
    it must run inside `loss_parallel()`, and so must its backward."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A (replicated) DTensor loss as this rank's plain tensor; plain tensors unchanged."""
    return x.to_local() if isinstance(x, DTensor) else x


class Engine:
    """This rank's share of one (dp, tp, pp) layout; see module docstring."""

    def __init__(
        self,
        shape: ModelShape,
        plan: ParallelPlan,
        settings: EngineSettings,
        device: torch.device | str,
        mesh_cache: MeshCache,
        seed: int = 0,
        allocate: bool = True,
        init: bool = True,
    ) -> None:
        """`allocate=False`: the model stays on the meta device (no memory, no optimizer); the
        caller fills it (reconfigure's direct path: `runtime/state/redistribute.py`) and then calls
        `finish_build()`. `init=False`: memory but no initial values drawn (the caller loads a
        checkpoint or Hugging Face weights into every parameter next)."""
        plan.validate(dist.get_world_size(), shape)
        self.shape, self.plan, self.settings = shape, plan, settings
        self.device = torch.device(device)
        self.mesh = mesh_cache.get(dp=plan.dp, tp=plan.tp, pp=plan.pp)
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.pp_rank = self.mesh["pp"].get_local_rank()
        model = build_model(shape, "meta")
        if plan.pp > 1:
            split_stage(model, self.pp_rank, plan.pp)
        self.dtype = settings.resolved_dtype(self.device)
        self.loss_parallel = settings.loss_parallel and plan.tp > 1
        parallelize(
            model,
            self.mesh,
            sequence_parallel=settings.sequence_parallel,
            activation_checkpointing=settings.activation_checkpointing,
            reshard_after_forward=settings.reshard_after_forward,
            dtype=self.dtype,
            compile=settings.compile,
            loss_parallel=self.loss_parallel,
        )
        self.model = materialize(model, self.device, seed, init=init) if allocate else model
        self.optimizer = self.pipeline = self.stats = None
        if allocate:
            self.finish_build()

    # ----------------------------------------------------------------------------- build
    def finish_build(self) -> None:
        """AdamW, pipeline stage and gradient statistics on the materialised model."""
        settings, plan = self.settings, self.plan
        self.optimizer = self._build_optimizer()
        self.pipeline = (
            Pipeline(self.model, self.mesh["pp"], self.device, settings.pp_schedule, token_loss)
            if plan.pp > 1
            else None
        )
        self.gns_small = settings.gns_small if plan.dp > 1 else "microbatch"
        self.stats = GradStats(self.model, plan.tp, self.gns_small, settings.ip_extras)

    def _build_optimizer(self) -> torch.optim.AdamW:
        """AdamW (`optim.build_adamw`: fused on CUDA, torch's default elsewhere)."""
        s = self.settings
        return build_adamw(
            list(self.model.parameters()), weight_decay=s.weight_decay, betas=(s.beta1, s.beta2), eps=s.eps
        )

    def _loss_context(self):
        """`loss_parallel()` around the loss and its backward under TP's vocab-sharded logits."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def set_plan(self, plan: ParallelPlan) -> None:
        """Same layout, new micro-batching (the pipeline builds a new schedule on next use)."""
        if plan.layout != self.plan.layout:
            raise ValueError(
                f"set_plan: layout {plan.layout} differs from the engine's "
                f"{self.plan.layout}; allowed: same (dp, tp, pp), rebuild otherwise"
            )
        plan.validate(dist.get_world_size(), self.shape)
        self.plan = plan

    # ----------------------------------------------------------------------------- steps
    def _check_tokens(self, local_tokens: torch.Tensor, rows: int | None) -> torch.Tensor:
        if (
            local_tokens.ndim != 2
            or local_tokens.shape[1] != self.shape.seq_len + 1
            or (rows is not None and local_tokens.shape[0] != rows)
        ):
            raise ValueError(
                f"local_tokens shape {tuple(local_tokens.shape)} is invalid; allowed: "
                f"[{rows or 'n'}, {self.shape.seq_len + 1}]"
            )
        return local_tokens.to(self.device)

    def _forward_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        """All micro-batches' forward + backward; returns this rank's share of the loss."""
        p = self.plan
        k, inputs, targets = p.num_microbatches, tokens[:, :-1], tokens[:, 1:]
        share = 1.0 / (p.dp * p.tp)
        if self.pipeline is None:
            self.stats.begin(k, grad_scale=float(k) if self.gns_small == "microbatch" else 1.0)
            total = torch.zeros((), device=self.device)
            for i, (x, y) in enumerate(zip(inputs.chunk(k), targets.chunk(k))):
                # "microbatch": reduce-scatter every micro-batch into the sharded fp32
                # gradient (torchtitan's way; no unsharded gradient outlives its FSDP unit's
                # backward). "rank" needs this rank's unsharded sum over its micro-batches,
                # so it reduce-scatters on the last micro-batch only (module docstring).
                self.model.set_requires_gradient_sync(self.gns_small != "rank" or i == k - 1)
                if not self.settings.reshard_after_forward:
                    # keep parameters gathered across the accumulation, as a pipeline stage
                    # does: one all-gather per step instead of one per micro-batch
                    self.model.set_reshard_after_backward(i == k - 1)
                with self._loss_context():
                    loss = token_loss(self.model(x), y)
                    (loss / k).backward()
                total = total + _plain(loss.detach())
            return total.float() * (share / k)
        self.stats.begin(k, grad_scale=1.0 if self.gns_small == "microbatch" else 1.0 / k)
        with self._loss_context():
            losses = self.pipeline.run(inputs, targets, k, train=True)
        if not self.pipeline.is_last:
            return torch.zeros((), device=self.device)
        return torch.stack([_plain(x.detach()).float() for x in losses]).mean() * share

    def train_step(self, local_tokens: torch.Tensor, lr: float) -> StepOutput:
        """Forward/backward over this dp rank's `micro_batch_size·num_microbatches` sequences
        (`seq_len + 1` tokens each), statistics, clipping and one AdamW step at `lr`."""
        p = self.plan
        tokens = self._check_tokens(local_tokens, p.micro_batch_size * p.num_microbatches)
        loss_share = self._forward_backward(tokens)
        grads = [q.grad for q in self.model.parameters() if q.grad is not None]
        num_small = p.dp * (p.num_microbatches if self.gns_small == "microbatch" else 1)
        per_rank = num_small // p.dp
        head = [loss_share, self.stats.small_sqnorm_sum(), weighted_sqnorm(grads, p.tp)]
        vec = torch.stack([h.to(self.device, torch.float64) for h in head])
        if self.settings.ip_extras:
            dots = self.stats.dots(self.model, self.dp_rank * per_rank, num_small)
            vec = torch.cat([vec, dots.to(self.device)])
        dist.all_reduce(vec)  # the step's only statistics collective: [loss, Σ‖g_j‖², ‖ḡ‖², dots]
        loss, small_sum, big_sq, *dots = vec.tolist()  # the step's one host read of it
        ip = sum(d * d for d in dots) / len(dots) if self.settings.ip_extras else None
        finite = all(math.isfinite(x) for x in (loss, small_sum, big_sq))
        grad_norm = math.sqrt(big_sq) if finite and big_sq >= 0 else float("nan")
        if finite:
            self._clip(grads, grad_norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.stats.kept.clear()
        small_batch = p.micro_batch_size * (p.num_microbatches // per_rank)
        return StepOutput(
            loss=loss,
            small_sqnorm=small_sum / num_small,
            small_batch=small_batch,
            num_small=num_small,
            big_sqnorm=big_sq,
            ip_sq_mean=ip,
            grad_norm=grad_norm,
            finite=finite,
        )

    @torch.no_grad()
    def _clip(self, grads: list[torch.Tensor], grad_norm: float) -> None:
        """Scale every gradient shard by min(1, grad_clip/‖ḡ‖); see `clip_grads`."""
        clip_grads(grads, grad_norm, self.settings.grad_clip)

    @torch.no_grad()
    def eval_loss(self, local_tokens: torch.Tensor) -> float:
        """Mean token loss over every dp rank's `local_tokens` (no gradients, no state change).
        Rows run in equal chunks of at most micro_batch_size (at least pp chunks under PP)."""
        p = self.plan
        tokens = self._check_tokens(local_tokens, None)
        rows = tokens.shape[0]
        k = -(-rows // p.micro_batch_size)  # chunks of at most micro_batch_size rows
        if self.pipeline is not None:
            k = max(k, p.pp)  # a schedule needs >= one micro-batch per stage
        if rows % k:
            raise ValueError(
                f"eval rows {rows} cannot be split into {k} equal micro-batches; allowed: a multiple of {k}"
            )
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        share = 1.0 / (p.dp * p.tp)
        with self._loss_context():
            if self.pipeline is None:
                losses = [token_loss(self.model(x), y) for x, y in zip(inputs.chunk(k), targets.chunk(k))]
            else:
                losses = self.pipeline.run(inputs, targets, k, train=False)
        part = (
            torch.stack([_plain(x).float() for x in losses]).mean() * share
            if losses
            else torch.zeros((), device=self.device)
        )
        vec = part.to(self.device, torch.float64).reshape(1)
        dist.all_reduce(vec)
        return float(vec.cpu()[0])

    # ----------------------------------------------------------------------------- state
    def state_dicts(self) -> tuple[dict, dict]:
        """(model, optimizer) state dicts for DCP (flattened optimizer state: cpu-notes e)."""
        return get_state_dict(self.model, self.optimizer, options=DCP_OPTIONS)

    def model_state(self) -> dict:
        return self.state_dicts()[0]

    def optim_state(self) -> dict:
        return self.state_dicts()[1]

    def load_state(self, model_sd: dict, optim_sd: dict) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=DCP_OPTIONS
        )

    def close(self) -> None:
        """Drop hooks, model and optimizer (the cached mesh and its groups stay alive). The
        tensors are freed now, by reference counting (`release.drop_tensors`: FSDP2's reference
        cycles would otherwise keep them until the next `gc.collect()`)."""
        if self.stats is not None:
            self.stats.close()
        self.stats = self.pipeline = None
        drop_tensors(self.model, self.optimizer)
        self.optimizer = None
        self.model = None


@torch.no_grad()
def clip_grads(grads: list[torch.Tensor], total_norm: float, max_norm: float) -> float:
    """Clip by a precomputed global norm: multiply each local shard by min(1, max/(norm+1e-6)).

    The global norm comes from `grad_stats.weighted_sqnorm` summed over the world, which works
    for gradients on different meshes (plain TP puts norm weights on the dp mesh and projections
    on the (dp, tp) mesh, where `clip_grad_norm_` fails: cpu-notes c). Returns the coefficient.
    """
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    coef = min(1.0, max_norm / (total_norm + 1e-6))
    if coef < 1.0:
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        torch._foreach_mul_(locals_, coef)
    return coef
