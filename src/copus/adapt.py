"""copus inside your own training loop: adaptive global batch from online gradient statistics.

Add a few lines to an existing FSDP2 / DDP / single-process loop; copus never wraps or patches
your optimizer. Per optimizer step::

    adapt = AdaptiveBatch(model, policy="norm-test", initial_batch=16, micro_batch_size=4)
    ...
    adapt.begin_step()
    for k in range(adapt.num_microbatches):              # this rank's micro-batches
        model.set_requires_gradient_sync(adapt.is_last_microbatch(k))   # FSDP2 (optional)
        (loss_fn(model(x_k), y_k) / adapt.num_microbatches).backward()
    decision = adapt.end_step(loss)                      # statistics before clipping
    for g in optimizer.param_groups: g["lr"] = base_lr * adapt.lr_factor
    optimizer.step(); optimizer.zero_grad()

Statistics (design.md §3, McCandlish et al. 2018 App. A): the gradient of each micro-batch on
each rank is a "small" gradient g_j of `micro_batch_size` samples, seen by a tensor hook before
it is accumulated (`copus.runtime.engine.grad_stats.GradStats`, the collector the trainer uses); the
synchronised gradient after the last backward is ḡ over the global batch. One all-reduce of
three scalars per step. Decisions come from `copus.core.control.policies` (the same objects the trainer
and the simulator use); rank 0's decision is broadcast so all ranks apply the same batch.

What each policy needs beyond the three scalars (docs/lau.md):
- `inner-product-test` (the augmented inner-product test, Bollapragada et al. 2018): g_jᵀḡ for
  every micro-batch gradient, so the hooks keep this rank's micro-batch gradients until ḡ is
  known (memory: num_microbatches local gradient copies); the dot products join the all-reduce.
- `norm_test_form = "paper"` (Lau et al. eq. 5 over per-worker gradients): each rank's mean of
  its micro-batch gradients, from the same kept copies; needs world_size ≥ 2.
- `norm-test-lau`: the norm test with Lau et al.'s schedule (`core.control.policy_presets`).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from copus.core.stats.efficiency import lr_scale
from copus.core.stats.gns import DecaySchedule, GnsEstimator
from copus.core.plan.plan import ParallelPlan
from copus.core.control.policies import PolicySettings, make_policy
from copus.core.control.policy_presets import POLICY_PRESETS
from copus.core.plan.records import Decision, StepRecord
from copus.runtime.engine.grad_stats import GradStats, weighted_sqnorm

__all__ = ["AdaptiveBatch"]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class AdaptiveBatch:
    """Adaptive global batch size for a user-owned data-parallel training loop.

    Args:
        model: the (FSDP2- or DDP-wrapped, or plain) module whose gradients define the step.
        policy: `constant`, `ramp`, `norm-test`, `norm-test-lau`, `inner-product-test` or `gns`
            (`goodput` needs copus's trainer, which can also change the parallel layout).
        initial_batch, min_batch, max_batch: global batch sizes in samples (all ranks).
        micro_batch_size: samples per forward per rank (fixed; the number of micro-batches
            changes with the batch).
        lr_rule: `none`, `linear`, `sqrt` or `adascale`; `lr_factor` is relative to
            `initial_batch` (`copus.core.stats.efficiency.lr_scale`). Default: the policy
            preset's (`none` for `norm-test-lau`), else `sqrt`.
        seq_len: tokens per sample (for token counts and the GNS decay schedule).
        settings: a full `PolicySettings` to override the policy's other knobs (default: the
            policy preset's `[batch]` keys, e.g. `norm-test-lau`'s, on `PolicySettings()`),
            among them `norm_test_form`: "per-sample", "micro-batch" or "paper".
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        policy: str = "norm-test",
        initial_batch: int = 8,
        micro_batch_size: int = 1,
        min_batch: int | None = None,
        max_batch: int = 256,
        lr_rule: str | None = None,
        seq_len: int = 1,
        settings: PolicySettings | None = None,
        decay: DecaySchedule | float | None = None,
    ) -> None:
        if policy.startswith("goodput"):
            raise ValueError(
                "policy='goodput' is invalid here; allowed: constant, ramp, norm-test, "
                "inner-product-test, gns (goodput needs `copus train`)"
            )
        self.rank, world = _world()
        per_step = world * micro_batch_size
        if initial_batch % per_step:
            raise ValueError(
                f"initial_batch={initial_batch} is invalid; allowed: a multiple of "
                f"world_size*micro_batch_size={per_step}"
            )
        preset = POLICY_PRESETS.get(policy, {})
        if lr_rule is None:
            lr_rule = preset.get("train", {}).get("lr_rule", "sqrt")
        lr_scale(lr_rule, 1.0, 1.0)  # validates the rule name
        base = settings or PolicySettings(**preset.get("batch", {}))
        self.settings = replace(
            base, initial=initial_batch, min=initial_batch if min_batch is None else min_batch, max=max_batch
        )
        self.plan = ParallelPlan(
            dp=world, tp=1, pp=1, micro_batch_size=micro_batch_size, num_microbatches=initial_batch // per_step
        )
        self.policy = make_policy(policy, self.settings, self.plan, world_size=world)
        self.gns = GnsEstimator(decay)
        self.per_worker = self.settings.norm_test_form == "paper" and policy.startswith("norm-test")
        self.dots = policy == "inner-product-test"
        self.stats = GradStats(model, tp=1, mode="microbatch", keep_grads=self.dots or self.per_worker)
        self.model, self.lr_rule, self.seq_len = model, lr_rule, seq_len
        self.step, self.samples = 0, 0
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------ what the loop asks
    @property
    def global_batch_size(self) -> int:
        return self.plan.global_batch_size

    @property
    def num_microbatches(self) -> int:
        return self.plan.num_microbatches

    @property
    def micro_batch_size(self) -> int:
        return self.plan.micro_batch_size

    @property
    def lr_factor(self) -> float:
        """Multiplier of the base learning rate for the current batch (the LR rule)."""
        return float(
            lr_scale(
                self.lr_rule,
                self.global_batch_size,
                self.settings.initial,
                self.gns.grad_sqnorm,
                self.gns.grad_trace_cov,
            )
        )

    def is_last_microbatch(self, k: int) -> bool:
        return k == self.num_microbatches - 1

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        """Call before the step's first backward. The loop backpropagates loss/num_microbatches."""
        self.stats.begin(self.num_microbatches, grad_scale=float(self.num_microbatches))
        self._t0 = time.perf_counter()

    def _big_sqnorm_share(self) -> torch.Tensor:
        """This rank's share of ‖ḡ‖²: DTensor (FSDP2) grads are shards; plain grads (DDP) are
        full replicas on every rank, so each rank contributes 1/world of its local norm²."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if any(isinstance(g, DTensor) for g in grads):
            return weighted_sqnorm(grads, tp=1)
        return weighted_sqnorm(grads, tp=1) / self.plan.dp

    def end_step(self, loss: float | torch.Tensor, step_s: float | None = None) -> Decision | None:
        """Call after the last backward, before clipping and `optimizer.step()`.

        `loss` is this rank's mean loss over its micro-batches; the global mean is logged.
        Returns the Decision applied (the batch for the next step), or None.
        """
        p, world = self.plan, self.plan.dp
        vec = self._statistics(loss)
        vec = torch.cat([vec, self._extras().to(vec.device, torch.float64)])
        if world > 1:
            dist.all_reduce(vec)
        host = vec.tolist()  # the step's one host read
        mean_loss, small_sum, big_sq = host[:3]
        extras = host[3:]
        num_small = world * p.num_microbatches
        ip_sq_mean = sum(x * x for x in extras) / len(extras) if self.dots else None
        small_batch = p.micro_batch_size
        gns_small_sqnorm = small_sum / num_small  # the GNS keeps micro-batch gradients
        if self.per_worker:  # Lau eq. 5: J = world per-worker gradients
            small_sum, num_small = float(extras[0]), world
            small_batch = p.micro_batch_size * p.num_microbatches
        self.stats.kept.clear()
        self.step += 1
        self.samples += p.global_batch_size
        finite = all(math.isfinite(x) for x in (mean_loss, small_sum, big_sq))
        if finite:
            self.gns.update(
                gns_small_sqnorm, p.micro_batch_size, big_sq, p.global_batch_size, tokens=self.samples * self.seq_len
            )
        record = StepRecord(
            step=self.step,
            samples=self.samples,
            tokens=self.samples * self.seq_len,
            plan=p,
            step_s=step_s if step_s is not None else time.perf_counter() - self._t0,
            loss=mean_loss,
            small_sqnorm=small_sum / num_small,
            small_batch=small_batch,
            num_small=num_small,
            big_sqnorm=big_sq,
            ip_sq_mean=ip_sq_mean,
            grad_sqnorm=self.gns.grad_sqnorm,
            grad_trace_cov=self.gns.grad_trace_cov,
            b_noise=self.gns.b_noise,
            b_noise_rel_err=self.gns.rel_err,
            skipped=not finite,
        )
        self.last_record = record
        decision = self.policy.observe(record)
        new_batch = self._agree(decision.plan.global_batch_size if decision else p.global_batch_size)
        if new_batch != p.global_batch_size:
            self.plan = p.with_batch(new_batch)
            if decision is None or decision.plan != self.plan:
                decision = Decision(
                    kind="batch", plan=self.plan, step=self.step, reason="rank 0's decision", b_noise=self.gns.b_noise
                )
            return decision
        return None

    def _extras(self) -> torch.Tensor:
        """This rank's share of what its policy needs beyond [loss, Σ‖g_j‖², ‖ḡ‖²] (float64,
        summed over ranks by the step's one all-reduce): ‖mean_k g_k‖² of its micro-batch
        gradients (the per-worker gradient, "paper" form), or g_jᵀḡ for every micro-batch
        gradient j of the global batch, this rank's at rank·K … rank·K + K − 1."""
        if self.per_worker:
            total = torch.zeros((), dtype=torch.float64, device=self.stats.device)
            for kept in self.stats.kept.values():
                mean = kept[0].double()
                for g in kept[1:]:
                    mean = mean + g.double()
                total = total + (mean / len(kept)).pow(2).sum().to(total.device)
            return total.reshape(1)
        if self.dots:
            k = self.plan.num_microbatches
            return self.stats.dots(self.model, self.rank * k, self.plan.dp * k)
        return torch.zeros(0, dtype=torch.float64, device=self.stats.device)

    def _statistics(self, loss: float | torch.Tensor) -> torch.Tensor:
        """[loss/world, this rank's Σ_j‖g_j‖², this rank's share of ‖ḡ‖²] as one float64
        vector on the statistics' device (the gradients' device: CUDA under a CUDA model, and
        the communication device for NCCL). No host round trip for a device `loss`."""
        small = self.stats.small_sqnorm_sum()
        big = self._big_sqnorm_share()
        device = self._device(small.device)
        if isinstance(loss, torch.Tensor):
            loss_t = loss.detach().reshape(()).to(device, torch.float64)
        else:
            loss_t = torch.tensor(float(loss), dtype=torch.float64, device=device)
        return torch.stack([loss_t / self.plan.dp, small.to(device, torch.float64), big.to(device, torch.float64)])

    def _device(self, stats_device: torch.device | None = None) -> torch.device:
        """The collectives' device: the current CUDA device under NCCL, else the statistics'
        device (CPU for gloo; the model's device outside a process group)."""
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")
        return stats_device if stats_device is not None else self.stats.device

    def _agree(self, batch: int) -> int:
        """Rank 0's batch for everyone (decisions are deterministic, this makes it certain)."""
        if self.plan.dp == 1:
            return batch
        t = torch.tensor([batch], dtype=torch.int64, device=self._device())
        dist.broadcast(t, src=0)
        return int(t.item())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Plain JSON-able state: save it with your checkpoint (e.g. inside DCP's `extra`)."""
        p = self.plan
        return {
            "step": self.step,
            "samples": self.samples,
            "gns": self.gns.state_dict(),
            "policy": self.policy.state_dict(),
            "plan": {"micro_batch_size": p.micro_batch_size, "num_microbatches": p.num_microbatches},
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples = int(state["step"]), int(state["samples"])
        self.gns.load_state_dict(state["gns"])
        self.policy.load_state_dict(state["policy"])
        plan = state["plan"]
        self.plan = replace(
            self.plan, micro_batch_size=int(plan["micro_batch_size"]), num_microbatches=int(plan["num_microbatches"])
        )

    def close(self) -> None:
        """Remove the gradient hooks."""
        self.stats.close()
