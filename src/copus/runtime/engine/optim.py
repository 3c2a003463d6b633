"""Learning rate: a schedule defined in tokens, times the LR-rule factor of the current batch.

`lr(tokens) = base_lr · factor · s(tokens)` where `s` is a linear warm-up over `warmup_tokens`
followed by a constant, cosine or linear decay down to `min_lr_ratio` at `total_tokens`
(Loshchilov & Hutter 2017 for cosine; the usual GPT-style warm-up). Counting in tokens, not steps,
keeps the schedule unchanged when the global batch changes mid-run.

`factor` is the LR rule applied on a batch change, relative to the reference batch
`batch.initial` (design §3): `none` (1), `linear` (B/B0), `sqrt` (√(B/B0), Adam's square-root
rule), `adascale` (AdaScale's gain, Johnson et al. 2020) or `sqrt-gain` (√gain, AdaptDL's
bounded AdamScale), via `copus.core.stats.efficiency.lr_scale`.
The schedule needs no torch: the trainer passes the returned float to `Engine.train_step`.
`build_adamw` builds the optimizer itself (torch imported inside it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SCHEDULES = ("constant", "cosine", "linear")
RULES = ("none", "linear", "sqrt", "adascale", "sqrt-gain")


@dataclass(frozen=True, slots=True, kw_only=True)
class LrSchedule:
    """Shape of the learning rate over tokens (the factor-free part)."""

    base_lr: float
    kind: str = "cosine"
    warmup_tokens: int = 0
    total_tokens: int = 0  # decay horizon; 0 = no decay (constant after warm-up)
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"train.lr_schedule={self.kind!r} is invalid; allowed: {', '.join(SCHEDULES)}")
        if not (self.base_lr > 0 and math.isfinite(self.base_lr)):
            raise ValueError(f"train.lr={self.base_lr!r} is invalid; allowed: a number > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio!r} is invalid; allowed: 0 <= ratio <= 1")
        if self.warmup_tokens < 0 or self.total_tokens < 0:
            raise ValueError("train.warmup_tokens and the decay horizon must be >= 0")

    def multiplier(self, tokens: int) -> float:
        """s(t): t/warmup during warm-up, then 1 → min_lr_ratio by the chosen decay."""
        if self.warmup_tokens > 0 and tokens < self.warmup_tokens:
            return max(tokens, 1) / self.warmup_tokens
        if self.kind == "constant" or self.total_tokens <= self.warmup_tokens:
            return 1.0
        progress = (tokens - self.warmup_tokens) / (self.total_tokens - self.warmup_tokens)
        progress = min(max(progress, 0.0), 1.0)
        r = self.min_lr_ratio
        if self.kind == "linear":
            return 1.0 - (1.0 - r) * progress
        return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(slots=True, kw_only=True)
class LearningRate:
    """The schedule plus the LR-rule state (the factor of the current batch). JSON-serialisable."""

    schedule: LrSchedule
    rule: str = "sqrt"
    ref_batch: int = 1
    factor: float = 1.0
    history: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"train.lr_rule={self.rule!r} is invalid; allowed: {', '.join(RULES)}")
        if self.ref_batch < 1:
            raise ValueError(f"reference batch {self.ref_batch!r} must be >= 1")

    def lr(self, tokens: int) -> float:
        """Learning rate for the step that starts after `tokens` consumed tokens."""
        return self.schedule.base_lr * self.factor * self.schedule.multiplier(tokens)

    def on_batch_change(
        self, new_batch: int, *, step: int = 0, grad_sqnorm: float = float("nan"), grad_trace_cov: float = float("nan")
    ) -> float:
        """Recompute the factor for `new_batch` relative to `ref_batch`; return the new factor.

        The factor is absolute (relative to the reference batch), not a product of successive
        ratios, so growing and shrinking the batch never drifts. AdaScale needs the current
        `grad_sqnorm` and `grad_trace_cov` estimates; with none yet it falls back to 1.
        """
        from copus.core.stats.efficiency import lr_scale

        new = float(
            lr_scale(self.rule, new_batch, self.ref_batch, grad_sqnorm=grad_sqnorm, grad_trace_cov=grad_trace_cov)
        )
        if not math.isfinite(new) or new <= 0:
            new = self.factor
        self.history.append(
            {"step": step, "global_batch_size": int(new_batch), "old_factor": self.factor, "factor": new}
        )
        self.factor = new
        return new

    def state_dict(self) -> dict:
        s = self.schedule
        return {
            "base_lr": s.base_lr,
            "kind": s.kind,
            "warmup_tokens": s.warmup_tokens,
            "total_tokens": s.total_tokens,
            "min_lr_ratio": s.min_lr_ratio,
            "rule": self.rule,
            "ref_batch": self.ref_batch,
            "factor": self.factor,
            "history": list(self.history),
        }

    def load_state_dict(self, d: dict) -> None:
        """Restore the rule state. The schedule stays as configured (a resumed run may extend
        max_tokens); only the factor and history come from the checkpoint."""
        self.factor = float(d["factor"])
        self.history = list(d.get("history", []))


def build_learning_rate(train_cfg, ref_batch: int, seq_len: int) -> LearningRate:
    """From `[train]` settings: decay horizon = max_tokens, else max_steps × initial tokens/step."""
    total = int(train_cfg.max_tokens)
    if total <= 0 and train_cfg.max_steps > 0:
        total = int(train_cfg.max_steps) * ref_batch * seq_len
    schedule = LrSchedule(
        base_lr=float(train_cfg.lr),
        kind=train_cfg.lr_schedule,
        warmup_tokens=int(train_cfg.warmup_tokens),
        total_tokens=total,
        min_lr_ratio=float(train_cfg.min_lr_ratio),
    )
    return LearningRate(schedule=schedule, rule=train_cfg.lr_rule, ref_batch=ref_batch)


def adamw_impl(devices: set[str]) -> str:
    """ "fused" when every parameter is on CUDA (one multi-tensor kernel per step, as torchtitan
    runs it), else "default" (torch's own choice: the per-tensor loop on CPU, where DTensor
    parameters on different meshes (norms on dp, projections on dp×tp) meet in one group)."""
    return "fused" if devices == {"cuda"} else "default"


def build_adamw(params: list, *, weight_decay: float, betas: tuple[float, float], eps: float):
    """torch AdamW over `params` (plain tensors or DTensors), weight decay on matrices (ndim ≥ 2)
    only, not on norm weights; lr starts at 0 (the engine sets it every step). Fused on CUDA
    (`adamw_impl`); the update is the same AdamW (Loshchilov & Hutter 2019) either way."""
    import torch

    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    impl = adamw_impl({p.device.type for p in params})
    extra = {"fused": True} if impl == "fused" else {}
    return torch.optim.AdamW(groups, lr=0.0, betas=betas, eps=eps, **extra)
