"""The boundary between runtime and core: plain numbers per step in, decisions out.

The trainer (and the simulator, and the library API) build one `StepRecord` per optimizer step;
every policy, including the goodput controller, consumes them and may return a `Decision`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from copus.core.plan.plan import ParallelPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """What one optimizer step measured. Raw statistics are per step; the smoothed GNS comes
    from `copus.core.stats.gns.GnsEstimator` after this step's update.

    Raw gradient statistics (design §3): `small_sqnorm` = s̄ = mean_i ‖g_i‖² over `num_small`
    gradients of `small_batch` samples each; `big_sqnorm` = q = ‖ḡ‖² over the global batch.
    `ip_sq_mean` = (1/J) Σ_j (g_jᵀḡ)², only when the inner-product extras are enabled.
    """

    step: int  # optimizer steps completed, this one included
    samples: int  # samples consumed so far, this step included
    tokens: int  # tokens consumed so far
    plan: ParallelPlan  # the plan this step ran under
    step_s: float  # wall time of this step
    loss: float
    lr: float = 0.0
    small_sqnorm: float = float("nan")
    small_batch: float = float("nan")
    num_small: int = 0
    big_sqnorm: float = float("nan")
    ip_sq_mean: float | None = None
    # smoothed estimates after this step (NaN until the estimator has data)
    grad_sqnorm: float = float("nan")
    grad_trace_cov: float = float("nan")
    b_noise: float = float("nan")
    b_noise_rel_err: float = float("inf")
    skipped: bool = False  # non-finite loss/gradient: the step was not applied

    @property
    def global_batch_size(self) -> int:
        return self.plan.global_batch_size


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One ranked alternative, kept for explaining a decision."""

    plan: ParallelPlan
    step_s: float
    goodput: float
    efficiency: float = float("nan")


PURPOSES = ("decide", "probe", "revert", "undo")


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """Switch to `plan` at the next optimizer-step boundary.

    kind "batch": same (dp, tp, pp), new global batch and/or micro-batch (cheap, next step).
    kind "reconfigure": new (dp, tp, pp) (in-process reshard, costs seconds).
    purpose: "decide" (a ranked choice), "probe" (measure an unmeasured layout, core.explore),
    "revert" (a probe measured no faster), "undo" (an audit found the change delivered less,
    core.audit).
    """

    kind: str
    plan: ParallelPlan
    reason: str
    step: int = 0
    b_noise: float = float("nan")
    candidates: tuple[Candidate, ...] = field(default_factory=tuple)
    purpose: str = "decide"
    # gns.calibration = "auto": the posterior over c when the decision was taken (mean, median,
    # 5-95 % interval, experiments so far; core.stats.calibration_posterior); None otherwise
    calibration: dict | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("batch", "reconfigure"):
            raise ValueError(f"kind={self.kind!r} is invalid; allowed: 'batch', 'reconfigure'")
        if self.purpose not in PURPOSES:
            raise ValueError(f"purpose={self.purpose!r} is invalid; allowed: {', '.join(PURPOSES)}")

    def to_dict(self) -> dict:
        p = self.plan
        return {
            "step": self.step,
            "kind": self.kind,
            "purpose": self.purpose,
            "reason": self.reason,
            "b_noise": self.b_noise,
            "dp": p.dp,
            "tp": p.tp,
            "pp": p.pp,
            "micro_batch_size": p.micro_batch_size,
            "num_microbatches": p.num_microbatches,
            "global_batch_size": p.global_batch_size,
            "candidates": [
                {
                    "dp": c.plan.dp,
                    "tp": c.plan.tp,
                    "pp": c.plan.pp,
                    "micro_batch_size": c.plan.micro_batch_size,
                    "global_batch_size": c.plan.global_batch_size,
                    "step_s": c.step_s,
                    "goodput": c.goodput,
                    "efficiency": c.efficiency,
                }
                for c in self.candidates
            ],
        } | ({"calibration": self.calibration} if self.calibration is not None else {})


def decision_kind(old: ParallelPlan, new: ParallelPlan) -> str:
    return "batch" if old.layout == new.layout else "reconfigure"
