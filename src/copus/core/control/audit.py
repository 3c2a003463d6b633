"""Check every decision against what it delivered (issue 15, part 4).

A decision predicts the new plan's step time (`Decision.candidates[0].step_s`) and expects its
goodput to beat the plan it left by more than the margin. After the switch the controller
collects `steps` measured step times of the new plan (the first step under it is a warm-up and
is not counted), then compares, at the *current* calibrated noise scale b:

    realised goodput  G_new = goodput(median realised step_s, B_new, b)
    left-plan goodput G_old = goodput(measured median step_s of the old plan, B_old, b)
                              (its prediction when it was never measured)
    undo  iff  (G_new − G_old) / G_old < −margin

goodput is `core.goodput.goodput` (COPUS Eqs. 5–8), with the controller's LR-aware setting, so
the comparison is the one the decision itself made, with measured step times in place of
predictions. The model is refitted after every check. An undo returns to the old plan even when
that shrinks the global batch. Every check becomes one decisions.jsonl row (`event: "audit"`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from copus.core.control.explore import plan_list as _plan_list, plan_of as _plan_of
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Decision, decision_kind


@dataclass(slots=True, kw_only=True)
class PendingAudit:
    """A decision waiting for its measurements."""

    step: int  # the step the decision was taken at
    kind: str
    before: ParallelPlan
    after: ParallelPlan
    predicted_step_s: float  # the decision's prediction for `after`
    before_step_s: float  # measured (else predicted) step time of `before`
    before_measured: bool
    times: list[float] = field(default_factory=list)
    warm: bool = False

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "kind": self.kind,
            "before": _plan_list(self.before),
            "after": _plan_list(self.after),
            "predicted_step_s": self.predicted_step_s,
            "before_step_s": self.before_step_s,
            "before_measured": self.before_measured,
            "times": list(self.times),
            "warm": self.warm,
        }

    @classmethod
    def from_dict(cls, d: dict) -> PendingAudit:
        return cls(
            step=int(d["step"]),
            kind=str(d["kind"]),
            before=_plan_of(d["before"]),
            after=_plan_of(d["after"]),
            predicted_step_s=float(d["predicted_step_s"]),
            before_step_s=float(d["before_step_s"]),
            before_measured=bool(d["before_measured"]),
            times=[float(x) for x in d["times"]],
            warm=bool(d["warm"]),
        )

    def add(self, plan: ParallelPlan, step_s: float) -> None:
        """Count a step of the new plan; the first one under it is the warm-up."""
        if plan != self.after or not (math.isfinite(step_s) and step_s > 0):
            return
        if not self.warm:
            self.warm = True
            return
        self.times.append(float(step_s))


GoodputFn = Callable[[float, int], float]  # (step_s, global batch) -> goodput


def audit_row(pending: PendingAudit, goodput_of: GoodputFn, *, margin: float, step: int, b_noise: float) -> dict:
    """The comparison of one decision with what it delivered (see the module docstring)."""
    realised = float(np.median(pending.times))
    g_new = goodput_of(realised, pending.after.global_batch_size)
    g_old = goodput_of(pending.before_step_s, pending.before.global_batch_size)
    g_pred = goodput_of(pending.predicted_step_s, pending.after.global_batch_size)
    change = (g_new - g_old) / g_old if g_old > 0 else float("nan")
    undo = bool(math.isfinite(change) and change < -margin)
    return {
        "event": "audit",
        "step": step,
        "decision_step": pending.step,
        "kind": pending.kind,
        "before": pending.before.describe(),
        "after": pending.after.describe(),
        "predicted_step_s": pending.predicted_step_s,
        "realised_step_s": realised,
        "step_error": realised / pending.predicted_step_s - 1.0 if pending.predicted_step_s > 0 else None,
        "num_steps": len(pending.times),
        "before_step_s": pending.before_step_s,
        "before_measured": pending.before_measured,
        "b_noise": _num(b_noise),
        "predicted_goodput": g_pred,
        "realised_goodput": g_new,
        "before_goodput": g_old,
        "realised_vs_before": _num(change),
        "margin": margin,
        "verdict": "undo" if undo else "keep",
    }


def _num(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


class Auditor:
    """Holds at most one decision under audit (the latest), see the module docstring.
    `steps = 0` turns audits off."""

    def __init__(self, steps: int = 3, *, margin: float = 0.10) -> None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"controller.audit_steps={steps!r} is invalid; allowed: an integer >= 0")
        self.steps = steps
        self.margin = margin
        self.pending: PendingAudit | None = None

    @property
    def busy(self) -> bool:
        return self.pending is not None

    def start(self, decision: Decision, before: ParallelPlan, before_step_s: float, before_measured: bool) -> None:
        """Audit `decision` (taken under `before`) once its plan has run `steps` steps."""
        if self.steps == 0 or not decision.candidates:
            return
        self.pending = PendingAudit(
            step=decision.step,
            kind=decision.kind,
            before=before,
            after=decision.plan,
            predicted_step_s=float(decision.candidates[0].step_s),
            before_step_s=float(before_step_s),
            before_measured=before_measured,
        )

    def follow(
        self, step: int, plan: ParallelPlan, step_s: float, goodput_of: GoodputFn, b_noise: float
    ) -> tuple[dict | None, Decision | None]:
        """Count one step; when the audit is complete, its row and (maybe) the undo Decision."""
        p = self.pending
        if p is None:
            return None, None
        if plan != p.after:  # refused by the trainer or replaced: nothing to audit
            self.pending = None
            return {
                "event": "audit",
                "step": step,
                "decision_step": p.step,
                "after": p.after.describe(),
                "verdict": "not applied",
            }, None
        p.add(plan, step_s)
        if len(p.times) < self.steps:
            return None, None
        self.pending = None
        row = audit_row(p, goodput_of, margin=self.margin, step=step, b_noise=b_noise)
        if row["verdict"] != "undo":
            return row, None
        reason = (
            f"undo the step-{p.step} {p.kind} to {p.after.describe()}: realised "
            f"{row['realised_step_s']:.4g} s/step vs predicted {p.predicted_step_s:.4g} s; "
            f"realised goodput {row['realised_goodput']:.4g} is "
            f"{-row['realised_vs_before']:.1%} below {p.before.describe()}'s "
            f"{row['before_goodput']:.4g} (margin {self.margin:.0%})"
        )
        undo = Decision(
            kind=decision_kind(plan, p.before),
            plan=p.before,
            reason=reason,
            step=step,
            b_noise=float(b_noise),
            purpose="undo",
        )
        return row, undo

    def state_dict(self) -> dict:
        return {"pending": self.pending.to_dict() if self.pending else None}

    def load_state_dict(self, state: dict) -> None:
        self.pending = PendingAudit.from_dict(state["pending"]) if state.get("pending") else None
