"""What the goodput controllers share (`ControllerBase`): the step-time model and its online
fit, measured switch costs, the posterior over c, the decision gate, the start plan,
forbidden plans and checkpointing (core/control/controller.py has the module overview)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from copus.core.cost.fit import OnlineFitter
from copus.core.plan.goodput import CandidateSet, StepTimePredictor
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import StepRecord
from copus.core.stats.calibration_posterior import CalibrationPosterior

STATE_VERSION = 2


class ControllerBase:
    """Step-time model, switch costs, calibration and checkpointing of a goodput controller."""

    def __init__(
        self,
        *,
        candidates: CandidateSet,
        initial_plan: ParallelPlan,
        fitter: OnlineFitter | None = None,
        model: StepTimePredictor | None = None,
        min_batch: int,
        max_batch: int,
        interval_steps: int = 10,
        warmup_steps: int = 10,
        calibration: float = 2.0,
        lr_aware: bool = False,
        lr_ref_batch: float | None = None,
        reconfig_cost_s: float = 2.0,
        allow_reconfigure: bool = True,
        refit_interval_steps: int = 20,
        refit_tolerance: float = 0.05,
        posterior: CalibrationPosterior | None = None,
        lr_warmup_tokens: float = 0.0,
    ) -> None:
        if fitter is None and model is None:
            raise ValueError("Controller needs a step-time model or an OnlineFitter")
        if interval_steps < 1 or warmup_steps < 0 or not calibration > 0:
            raise ValueError(
                f"interval_steps={interval_steps}, warmup_steps={warmup_steps}, "
                f"calibration={calibration} are invalid; allowed: interval >= 1, "
                "warmup >= 0, calibration > 0"
            )
        self.candidates = candidates
        self.fitter = fitter
        self._fixed_model = model
        self.search_options = dict(
            min_batch=min_batch,
            max_batch=max_batch,
            allow_reconfigure=allow_reconfigure,
            lr_aware=lr_aware,
            lr_ref_batch=lr_ref_batch or float(initial_plan.global_batch_size),
        )
        self.interval_steps, self.warmup_steps = interval_steps, warmup_steps
        self.calibration = calibration
        self.posterior = posterior
        self.lr_warmup_tokens = float(lr_warmup_tokens)  # no calibration evidence before
        self.read_from_step = 0  # nor before this step (the planner: the noise-scale EMA's warm-up)
        if posterior is not None:
            self.calibration = posterior.value()
        self.prior_reconfig_cost_s = reconfig_cost_s
        self.refit_interval_steps, self.refit_tolerance = refit_interval_steps, refit_tolerance
        self.plan = initial_plan
        self.elapsed_s = 0.0
        self.switch_costs: list[float] = []
        self.history: list[dict] = []
        self.last_decision_step: int | None = None
        self.seen_plan: ParallelPlan | None = None
        self.last_explanation: dict = {"action": "wait", "why": "no step observed yet"}
        self._predicted: tuple[object, np.ndarray] | None = None  # (model, step_s of every cand.)
        self.events: list[dict] = []  # decisions.jsonl rows

    # ---- what decisions use --------------------------------------------------------------------

    @property
    def model(self) -> StepTimePredictor:
        """The step-time model in use: the online fit when there is a fitter, else the fixed one."""
        return self.fitter.model if self.fitter is not None else self._fixed_model

    def decision_model(self) -> StepTimePredictor:
        """What decisions rank by (subclasses: measured medians first)."""
        return self.model

    def predicted_step_s(self) -> np.ndarray:
        """The decision model's step time for every candidate, recomputed when it changes."""
        model = self.decision_model()
        if self._predicted is None or self._predicted[0] is not model:
            self._predicted = (model, self.candidates.predict_step_s(model))
        return self._predicted[1]

    @property
    def reconfig_cost_s(self) -> float:
        """c_reconfig: mean measured parallelism-change cost, the prior before the first."""
        return float(np.mean(self.switch_costs)) if self.switch_costs else self.prior_reconfig_cost_s

    @property
    def useful_s(self) -> float:
        """T_useful = T_elapsed − time spent reconfiguring (COPUS Alg. 2)."""
        return max(self.elapsed_s - sum(self.switch_costs), 0.0)

    def record_switch_cost(self, seconds: float) -> None:
        """A measured parallelism change: it counts in T_elapsed and in c_reconfig."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds={seconds!r} is invalid; allowed: a finite number >= 0")
        self.switch_costs.append(float(seconds))
        self.elapsed_s += float(seconds)

    def drain_events(self) -> list[dict]:
        """decisions.jsonl rows since the last call (calibration windows, considered moves)."""
        out, self.events = self.events, []
        return out

    def start_plan(self, micro_batch_size: int | None = None) -> ParallelPlan:
        """The plan to start on: the shortest predicted step at the current batch (memory-feasible
        candidates; `micro_batch_size`: only plans with it), or the current plan when it is as
        fast or nothing qualifies. A run starts with no elapsed time to amortise a switch over."""
        idx = self._start_indices(micro_batch_size)
        if idx is None:
            return self.plan
        all_s = self.predicted_step_s()
        best = int(idx[np.argmin(all_s[idx])])
        cur = self.candidates.index_of(self.plan)
        if cur is not None and np.isfinite(all_s[cur]) and all_s[cur] <= all_s[best]:
            return self.plan
        return self.candidates.plan(best)

    def _start_indices(self, micro_batch_size: int | None) -> np.ndarray | None:
        """Candidates at the current batch with a finite step time (None: keep the plan)."""
        if not self.search_options["allow_reconfigure"]:
            return None
        c = self.candidates
        keep = c.global_batch_size == self.plan.global_batch_size
        if micro_batch_size:
            keep &= c.micro_batch_size == micro_batch_size
        s = self.predicted_step_s()
        idx = np.flatnonzero(keep & np.isfinite(s) & (s > 0))
        return idx if len(idx) else None

    # ---- per step --------------------------------------------------------------------------------

    def _account(self, record: StepRecord) -> None:
        """Elapsed time, the step time into the fitter (not the first step under a plan), the
        loss into the posterior."""
        if math.isfinite(record.step_s) and record.step_s > 0:
            self.elapsed_s += record.step_s
        first = record.plan != self.seen_plan
        self.seen_plan = record.plan
        if self.fitter is not None and not first and not record.skipped:
            self.fitter.observe(record.plan, record.step_s)
        self._learn_calibration(record)
        self.plan = record.plan

    def _learn_calibration(self, record: StepRecord) -> None:
        """gns.calibration = "auto": one step into the posterior over c; follow its median.
        A closed window (an experiment) is logged to decisions.jsonl as a "calibration" row."""
        if self.posterior is None or record.skipped:
            return
        row = self.posterior.observe(
            record.loss,
            record.plan.global_batch_size,
            record.b_noise,
            usable=record.tokens >= self.lr_warmup_tokens and record.step >= self.read_from_step,
            tokens=record.tokens,
        )
        if row is not None:
            self.calibration = self.posterior.value()
            self.events.append({"event": "calibration", "step": record.step, **row})

    def _gate(self, record: StepRecord) -> str | None:
        """Why no decision is taken at this step (None: decide)."""
        if record.step < self.warmup_steps:
            return f"warmup: step {record.step} < warmup_steps {self.warmup_steps}"
        if self.last_decision_step is not None and record.step - self.last_decision_step < self.interval_steps:
            return (
                f"next decision at step {self.last_decision_step + self.interval_steps} "
                f"(interval_steps {self.interval_steps})"
            )
        if record.skipped:
            return "step skipped (non-finite statistics)"
        if not (math.isfinite(record.b_noise) and record.b_noise > 0):
            return f"gns not ready: b_noise={record.b_noise}"
        return None

    def model_error(self) -> float:
        """Largest relative miss of the model on the median measured step time of any plan."""
        obs = self.fitter.observations() if self.fitter is not None else []
        if not obs:
            return 0.0
        pred = self.model.predict_plans([p for p, _ in obs])
        return float(np.max(np.abs(pred / np.array([s for _, s in obs]) - 1.0)))

    def _maybe_refit(self) -> bool:
        f = self.fitter
        if f is None or f.since_fit < self.refit_interval_steps:
            return False
        if self.model_error() <= self.refit_tolerance:
            return False
        f.refit()
        return True

    def forbid(self, rule: Callable[[ParallelPlan], bool]) -> int:
        """Drop every candidate plan for which `rule(plan)` holds (e.g. one that ran out of
        device memory in this run): it is never chosen again. Returns how many were dropped."""
        c = self.candidates
        keep = np.array([not rule(c.plan(i)) for i in range(len(c))], dtype=bool)
        if keep.all():
            return 0
        self.candidates, self._predicted = c.subset(keep), None
        self._candidates_changed()
        return int((~keep).sum())

    def _candidates_changed(self) -> None:
        """Hook: the candidate set was narrowed."""

    # ---- checkpointing -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-able state: fitter (measurements + fitted coefficients), switch costs, history."""
        return {
            "version": STATE_VERSION,
            "plan": _plan_list(self.plan),
            "seen_plan": _plan_list(self.seen_plan),
            "elapsed_s": self.elapsed_s,
            "switch_costs": list(self.switch_costs),
            "history": list(self.history),
            "last_decision_step": self.last_decision_step,
            "fitter": self.fitter.state_dict() if self.fitter is not None else None,
            "posterior": self.posterior.state_dict() if self.posterior is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"controller state version={state.get('version')!r} is invalid; allowed: {STATE_VERSION}")
        self.plan = _plan_of(state["plan"])
        self.seen_plan = _plan_of(state["seen_plan"])
        self.elapsed_s = float(state["elapsed_s"])
        self.switch_costs = [float(x) for x in state["switch_costs"]]
        self.history = list(state["history"])
        self.last_decision_step = state["last_decision_step"]
        if self.fitter is not None and state.get("fitter") is not None:
            self.fitter.load_state_dict(state["fitter"])
        if self.posterior is not None and state.get("posterior") is not None:
            self.posterior.load_state_dict(state["posterior"])
            self.calibration = self.posterior.value()


def _plan_list(plan: ParallelPlan | None) -> list[int] | None:
    if plan is None:
        return None
    return [plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches]


def _plan_of(values: Sequence[int] | None) -> ParallelPlan | None:
    if values is None:
        return None
    dp, tp, pp, mbs, nmb = (int(v) for v in values)
    return ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=nmb)
