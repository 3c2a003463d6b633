"""Measure, don't guess: probe a few unmeasured layouts in the running job (issue 15, part 3).

COPUS profiles every plan offline before training (arXiv 2604.26687 §4.4). copus switches
layout in the running processes in about a second (`runtime/state/reconfigure.py`), so the goodput
controller can instead *measure* a candidate layout that its step-time model ranks near the top
at the current global batch but that it has never measured:

1. **propose** (`probe_candidate`): at batch B, the best predicted micro-batch of every other
   layout in the candidate set (so never a plan over the memory budget: those were pruned, and
   the memory check is repeated here), ranked by predicted step time; the first of the model's
   `top_k` layouts whose (layout, B) has no measurement is probed;
2. **measure**: the trainer switches to it like any layout change (its cost goes to
   `Controller.record_switch_cost`, i.e. into T_elapsed and c_reconfig); the first step under
   it is a warm-up, the next `probe_steps` steps are measured;
3. **decide on measurements** (`probe_verdict`): same global batch, so goodput ∝ 1 / step
   time: keep the probed layout iff `t_before / t_probe − 1 > margin` (the switching margin,
   COPUS's 10 %), else switch back.

Bounds (config `[controller] explore_*`): at most `max_probes` probes per run, at most
`top_k` layouts per batch, `probe_steps` measured steps each, and `interval_steps` steps
between the end of one probe and the start of the next. `max_probes = 0` turns it off.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from copus.core.plan.goodput import CandidateSet, StepTimePredictor
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Candidate, Decision, decision_kind

Layout = tuple[int, int, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExploreSettings:
    """How much in-run exploration is allowed (the `[controller] explore_*` keys)."""

    max_probes: int = 4  # probes per run; 0 = never explore
    probe_steps: int = 3  # measured steps per probe (after one warm-up step)
    interval_steps: int = 10  # steps from the end of one probe to the start of the next
    top_k: int = 2  # only layouts among the model's top_k (other than the current)

    def __post_init__(self) -> None:
        for name, lo in (("max_probes", 0), ("probe_steps", 1), ("interval_steps", 0), ("top_k", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"controller.explore_{name}={value!r} is invalid; allowed: an integer >= {lo}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeChoice:
    """The plan to probe and the model's ranking that chose it (for decisions.jsonl)."""

    plan: ParallelPlan
    predicted_step_s: float
    rank: int  # 1 = the model's best other layout
    ranking: tuple[dict, ...]  # {layout, plan, predicted step_s, measured?} per layout


def best_per_layout(
    candidates: CandidateSet, step_s: np.ndarray, batch: int, memory_capacity_bytes: float | None = None
) -> list[tuple[int, float]]:
    """(candidate index, predicted step_s) of the fastest micro-batch of each layout at `batch`,
    fastest layout first. Plans predicted over `memory_capacity_bytes` are left out."""
    ok = candidates.global_batch_size == batch
    if memory_capacity_bytes is not None:
        mem = candidates.memory_bytes
        ok &= ~(np.isfinite(mem) & (mem > memory_capacity_bytes))
    ok &= np.isfinite(step_s) & (step_s > 0)
    best: dict[Layout, tuple[int, float]] = {}
    for i in np.flatnonzero(ok):
        lay = (int(candidates.dp[i]), int(candidates.tp[i]), int(candidates.pp[i]))
        if lay not in best or step_s[i] < best[lay][1]:
            best[lay] = (int(i), float(step_s[i]))
    return sorted(best.values(), key=lambda x: (x[1], x[0]))


def probe_candidate(
    candidates: CandidateSet,
    model: StepTimePredictor,
    current: ParallelPlan,
    measured: Iterable[tuple[Layout, int]],
    *,
    top_k: int,
    memory_capacity_bytes: float | None = None,
) -> ProbeChoice | None:
    """The plan to probe at the current global batch, or None (see the module docstring).

    `measured`: every (layout, global batch) with a measured step time, probes included.
    """
    batch = current.global_batch_size
    seen = set(measured)
    step_s = candidates.predict_step_s(model)
    others = [
        (i, s)
        for i, s in best_per_layout(candidates, step_s, batch, memory_capacity_bytes)
        if candidates.plan(i).layout != current.layout
    ][:top_k]
    ranking = tuple(
        {
            "layout": list(candidates.plan(i).layout),
            "plan": candidates.plan(i).describe(),
            "predicted_step_s": s,
            "measured": (candidates.plan(i).layout, batch) in seen,
        }
        for i, s in others
    )
    for rank, (i, s) in enumerate(others, start=1):
        plan = candidates.plan(i)
        if (plan.layout, batch) not in seen:
            return ProbeChoice(plan=plan, predicted_step_s=s, rank=rank, ranking=ranking)
    return None


def probe_verdict(before_step_s: float, probe_step_s: float, margin: float) -> tuple[bool, float]:
    """(keep the probed plan?, its measured gain): same global batch, so the goodput ratio is
    the inverse step-time ratio; keep iff gain = t_before / t_probe − 1 > margin."""
    if not (np.isfinite(before_step_s) and np.isfinite(probe_step_s) and probe_step_s > 0):
        return False, float("nan")
    gain = before_step_s / probe_step_s - 1.0
    return gain > margin, float(gain)


@dataclass(slots=True, kw_only=True)
class ActiveProbe:
    """A probe in progress: the plan it left, the plan measured, the step times so far."""

    start_step: int
    before: ParallelPlan
    plan: ParallelPlan
    predicted_step_s: float
    times: list[float]
    warm: bool = False  # the first step under the probed plan has been seen

    def to_dict(self) -> dict:
        return {
            "start_step": self.start_step,
            "before": plan_list(self.before),
            "plan": plan_list(self.plan),
            "predicted_step_s": self.predicted_step_s,
            "times": list(self.times),
            "warm": self.warm,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ActiveProbe:
        return cls(
            start_step=int(d["start_step"]),
            before=plan_of(d["before"]),
            plan=plan_of(d["plan"]),
            predicted_step_s=float(d["predicted_step_s"]),
            times=[float(x) for x in d["times"]],
            warm=bool(d["warm"]),
        )


def plan_list(plan: ParallelPlan) -> list[int]:
    """[dp, tp, pp, micro_batch_size, num_microbatches] (JSON state)."""
    return [plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches]


def plan_of(values) -> ParallelPlan:
    """The inverse of `plan_list`."""
    dp, tp, pp, mbs, nmb = (int(v) for v in values)
    return ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=nmb)


MeasuredFn = Callable[[ParallelPlan], float]  # measured median step_s of a plan (NaN: never)


class Explorer:
    """The probe state machine of one run (module docstring); rank 0's controller owns it."""

    def __init__(self, settings: ExploreSettings, *, margin: float, memory_capacity_bytes: float | None = None) -> None:
        self.settings = settings
        self.margin = margin
        self.memory_capacity_bytes = memory_capacity_bytes
        self.active: ActiveProbe | None = None
        self.probed: list[tuple[Layout, int]] = []  # (layout, global batch) of every probe
        self.last_end_step = -(10**9)

    @property
    def busy(self) -> bool:
        return self.active is not None

    def can_probe(self, step: int) -> bool:
        s = self.settings
        return self.active is None and len(self.probed) < s.max_probes and step - self.last_end_step >= s.interval_steps

    def propose(
        self,
        step: int,
        current: ParallelPlan,
        candidates: CandidateSet,
        model: StepTimePredictor,
        measured: Iterable[tuple[Layout, int]],
    ) -> Decision | None:
        """A probe Decision for the model's best unmeasured layout at the current batch."""
        if not self.can_probe(step):
            return None
        choice = probe_candidate(
            candidates,
            model,
            current,
            [*measured, *self.probed],
            top_k=self.settings.top_k,
            memory_capacity_bytes=self.memory_capacity_bytes,
        )
        if choice is None:
            return None
        self.active = ActiveProbe(
            start_step=step, before=current, plan=choice.plan, predicted_step_s=choice.predicted_step_s, times=[]
        )
        self.probed.append((choice.plan.layout, current.global_batch_size))
        reason = (
            f"probe {len(self.probed)}/{self.settings.max_probes}: "
            f"{choice.plan.describe()} is the model's #{choice.rank} other layout at "
            f"B={current.global_batch_size} (predicted {choice.predicted_step_s:.4g} s/step)"
            f" and was never measured there; {self.settings.probe_steps} steps, then "
            "keep it only if measured faster than "
            f"{current.describe()} by more than the margin {self.margin:.0%}"
        )
        cands = (Candidate(plan=choice.plan, step_s=choice.predicted_step_s, goodput=float("nan")),)
        return Decision(
            kind=decision_kind(current, choice.plan),
            plan=choice.plan,
            reason=reason,
            step=step,
            candidates=cands,
            purpose="probe",
        )

    def follow(
        self, step: int, plan: ParallelPlan, step_s: float, measured_s: MeasuredFn
    ) -> tuple[dict | None, Decision | None]:
        """Count one step of the active probe; at its end the verdict row and, if the probed
        plan is not kept, the Decision back to the plan it left."""
        probe = self.active
        if probe is None:
            return None, None
        if plan != probe.plan:  # the probe was refused or replaced: nothing to judge
            self.active, self.last_end_step = None, step
            return {
                "event": "probe_result",
                "step": step,
                "plan": probe.plan.describe(),
                "verdict": "not applied",
            }, None
        if not probe.warm:
            probe.warm = True
        elif math.isfinite(step_s) and step_s > 0:
            probe.times.append(float(step_s))
        if len(probe.times) < self.settings.probe_steps:
            return None, None
        before_s = measured_s(probe.before)
        probe_s = float(np.median(probe.times))
        keep, gain = probe_verdict(before_s, probe_s, self.margin)
        self.active, self.last_end_step = None, step
        row = {
            "event": "probe_result",
            "step": step,
            "probe_step": probe.start_step,
            "plan": probe.plan.describe(),
            "before": probe.before.describe(),
            "predicted_step_s": probe.predicted_step_s,
            "measured_step_s": probe_s,
            "before_step_s": before_s,
            "gain": gain if math.isfinite(gain) else None,
            "margin": self.margin,
            "verdict": "keep" if keep else "revert",
        }
        if keep:
            return row, None
        reason = (
            f"probe result: {probe.plan.describe()} measured {probe_s:.4g} s/step vs "
            f"{before_s:.4g} s/step for {probe.before.describe()} "
            f"(gain {gain:+.1%} <= margin {self.margin:.0%}): back to {probe.before.describe()}"
        )
        back = Decision(
            kind=decision_kind(plan, probe.before), plan=probe.before, reason=reason, step=step, purpose="revert"
        )
        return row, back

    def state_dict(self) -> dict:
        return {
            "active": self.active.to_dict() if self.active else None,
            "probed": [[list(lay), b] for lay, b in self.probed],
            "last_end_step": self.last_end_step,
        }

    def load_state_dict(self, state: dict) -> None:
        self.active = ActiveProbe.from_dict(state["active"]) if state.get("active") else None
        self.probed = [(tuple(int(v) for v in lay), int(b)) for lay, b in state["probed"]]
        self.last_end_step = int(state["last_end_step"])
