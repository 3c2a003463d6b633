"""The "goodput" policy: COPUS's orchestrator (arXiv 2604.26687 Alg. 2; design §5).

Every optimizer step the trainer hands a `StepRecord` to `Controller.observe`:
1. the step time goes into an `OnlineFitter` (prior: the analytic model, or one fitted to a
   `copus profile` table); the first step under each plan is skipped (warm-up, first-call
   allocation). At a decision point the model is refitted from the trainer's measurements when
   ≥ `refit_interval_steps` steps arrived since the last fit AND the model misses a measured
   plan's median step time by more than `refit_tolerance` (relative): a fit costs ~1 s of
   least squares, so an accurate model is not refitted;
2. once `warmup_steps` have passed, every `interval_steps` it ranks every candidate plan by
   goodput with the calibrated noise scale `calibration · φ`, φ = the lower confidence bound
   `core.gns.lower_bound(b_noise, rel_err, confidence)` (issue 14; with `confidence` = 0, the
   point estimate once `b_noise_rel_err ≤ max_rel_err`: COPUS §1.2 with c = 2), holding for
   `recovery_steps` after a batch change (COPUS App. E transient), and calls
   `core.search.evaluate` (hysteresis, growth cap, amortised reconfiguration cost; the batch
   does not shrink unless `allow_shrink`); with `step_confidence` > 0 a switch must clear the
   margin plus the step times' measured uncertainty (`core.step_uncertainty`);
3. `record_switch_cost(seconds)` feeds the measured cost of each parallelism change back:
   `c_reconfig` = mean of the measured costs (the prior before the first one), and
   T_useful = T_elapsed − Σ costs.
4. exploration and audits (`core.explore`, `core.audit`; issue 15): between decisions it may
   probe the model's best unmeasured layout at the current batch for a few steps and keep it
   only if measured faster by more than the margin; every decision is checked against its
   measured outcome and undone when it delivered less than the plan it left by more than the
   margin. With either on, decisions rank plans by their *measured* median step time where
   there is one (`OnlineFitter.profiled`), the fitted model elsewhere. Their rows for
   decisions.jsonl wait in `drain_events()`.
5. with `gns.calibration = "auto"` (`posterior`), every step's loss, batch and b_noise go to a
   `core.stats.calibration_posterior.CalibrationPosterior`: each batch change is a natural
   experiment that updates a grid posterior over log c, and `calibration` follows its median
   (issue 26, docs/robust-goodput.md). Decisions carry the posterior's summary.
Every call leaves `last_explanation` (JSON-able dict: action, why, top candidates).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from copus.core.control.audit import Auditor
from copus.core.control.batch_move import best_batch_move
from copus.core.control.excursion import excursion_value
from copus.core.control.explore import ExploreSettings, Explorer
from copus.core.cost.fit import OnlineFitter, fit_model, prior_model
from copus.core.stats.calibration_posterior import CalibrationPosterior
from copus.core.stats.gns import lower_bound
from copus.core.plan.goodput import CandidateSet, StepTimePredictor, build_candidates, goodput
from copus.core.specs.hardware import HardwareProfile, get_hardware
from copus.core.cost.memory import MemoryModel
from copus.core.specs.models import ModelShape
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Decision, StepRecord
from copus.core.plan.search import evaluate
from copus.core.stats.step_uncertainty import median_error, model_error, relative_spread
from copus.core.cost.throughput import StepTimeModel

STATE_VERSION = 1


class Controller:
    """observe(record) -> Decision | None; see the module docstring."""

    def __init__(
        self,
        *,
        candidates: CandidateSet,
        initial_plan: ParallelPlan,
        fitter: OnlineFitter | None = None,
        model: StepTimePredictor | None = None,
        min_batch: int,
        max_batch: int,
        max_growth: float = 2.0,
        interval_steps: int = 10,
        warmup_steps: int = 10,
        max_rel_err: float = 0.5,
        calibration: float = 2.0,
        margin: float = 0.10,
        lr_aware: bool = True,
        lr_ref_batch: float | None = None,
        reconfig_cost_s: float = 2.0,
        allow_reconfigure: bool = True,
        allow_shrink: bool = False,
        refit_interval_steps: int = 20,
        refit_tolerance: float = 0.05,
        explore: ExploreSettings | None = None,
        audit_steps: int = 0,
        memory_capacity_bytes: float | None = None,
        confidence: float = 0.0,
        recovery_steps: int = 0,
        step_confidence: float = 0.0,
        posterior: CalibrationPosterior | None = None,
        batch_margin: float | None = None,
        lr_warmup_tokens: float = 0.0,
        shrink_batch: bool | None = None,
        max_excursions: int = 0,
        excursion_factor: float = 2.0,
        excursion_min_interval: float = 8.0,
        horizon_tokens: float = 0.0,
    ) -> None:
        if fitter is None and model is None:
            raise ValueError("Controller needs a step-time model or an OnlineFitter")
        if interval_steps < 1 or warmup_steps < 0 or calibration <= 0 or max_rel_err <= 0:
            raise ValueError(
                f"interval_steps={interval_steps}, warmup_steps={warmup_steps}, "
                f"calibration={calibration}, max_rel_err={max_rel_err} are invalid; "
                "allowed: interval >= 1, warmup >= 0, calibration > 0, max_rel_err > 0"
            )
        self.candidates = candidates
        self.fitter = fitter
        self._fixed_model = model
        self.search_options = dict(
            margin=margin,
            max_growth=max_growth,
            min_batch=min_batch,
            max_batch=max_batch,
            allow_shrink=allow_shrink,
            allow_reconfigure=allow_reconfigure,
            lr_aware=lr_aware,
            lr_ref_batch=lr_ref_batch or float(initial_plan.global_batch_size),
        )
        self.interval_steps = interval_steps
        self.warmup_steps = warmup_steps
        self.max_rel_err = max_rel_err
        self.calibration = calibration
        self.posterior = posterior
        self.lr_warmup_tokens = float(lr_warmup_tokens)  # no calibration evidence before
        # a batch move on the current layout may shrink the batch (None: under "auto", where
        # the posterior can find an early growth was wrong; the batch margin is the hysteresis)
        self.shrink_batch = (posterior is not None) if shrink_batch is None else bool(shrink_batch)
        # deliberate calibration excursions (core.control.excursion): at most this many, to
        # excursion_factor·B, while the posterior's 90 % interval spans > this many-fold
        self.max_excursions, self.excursion_factor = int(max_excursions), float(excursion_factor)
        self.excursion_min_interval = float(excursion_min_interval)
        self.num_excursions = 0
        self._excursion_end: int | None = None
        # the run's planned length in tokens (train.max_tokens; 0: unknown): a layout change is
        # repaid over the time the rest of the run takes at the current plan's speed
        self.horizon_tokens = float(horizon_tokens)
        # batch-only moves on the current layout need only this gain in goodput expected under
        # the posterior (core.control.batch_move); None or >= margin: COPUS's one margin
        self.batch_margin = margin if batch_margin is None else float(batch_margin)
        self.margin = margin
        if posterior is not None:
            self._follow_posterior()
        self.confidence, self.recovery_steps = float(confidence), int(recovery_steps)
        self.step_confidence = float(step_confidence)
        self.step_misses: list[float] = []  # realised/predicted − 1 of checked predictions
        self._batch_change_step: int | None = None
        self.prior_reconfig_cost_s = reconfig_cost_s
        self.refit_interval_steps = refit_interval_steps
        self.refit_tolerance = refit_tolerance
        self.plan = initial_plan
        self.elapsed_s = 0.0
        self.switch_costs: list[float] = []
        self.history: list[dict] = []
        self.last_decision_step: int | None = None
        self.seen_plan: ParallelPlan | None = None
        self.last_explanation: dict = {"action": "wait", "why": "no step observed yet"}
        self._predicted: tuple[object, np.ndarray] | None = None  # (model, step_s of every cand.)
        explore = explore or ExploreSettings(max_probes=0)
        self.explorer = Explorer(explore, margin=margin, memory_capacity_bytes=memory_capacity_bytes)
        self.auditor = Auditor(audit_steps, margin=margin)
        self.events: list[dict] = []  # decisions.jsonl rows (probe results, audits)
        self.measure_first = fitter is not None and (explore.max_probes > 0 or audit_steps > 0)

    # ---- what the decision uses ----------------------------------------------------------------

    @property
    def model(self) -> StepTimePredictor:
        """The step-time model in use: the online fit when there is a fitter, else the fixed one."""
        return self.fitter.model if self.fitter is not None else self._fixed_model

    def decision_model(self) -> StepTimePredictor:
        """What decisions rank by: measured medians where known (with exploration or audits
        on), else the model."""
        return self.fitter.profiled() if self.measure_first else self.model

    def measured_step_s(self, plan: ParallelPlan, last: int | None = None) -> float:
        """Median measured step time of `plan` over its `last` measured steps (None: all kept);
        NaN if never measured. Probes and audits compare with the steps just before the switch,
        so that a slow drift of the machine's load does not decide for them."""
        times = self.fitter.times.get(plan) if self.fitter is not None else None
        return float(np.median(times[-last:] if last else times)) if times else float("nan")

    def step_uncertainty(self, current: ParallelPlan) -> tuple[np.ndarray | None, float]:
        """(relative standard error of every candidate's step time, the current plan's):
        measured plans from their kept times, the rest the model's checked out-of-sample
        error (`core.step_uncertainty`); (None, 0) without a fitter or with z = 0."""
        if self.fitter is None or self.step_confidence == 0:
            return None, 0.0
        times = self.fitter.times
        floor = relative_spread(times.get(current, ()))
        floor = floor if math.isfinite(floor) else 0.0
        unmeasured = model_error(self.step_misses)
        u = np.full(len(self.candidates), unmeasured)
        for plan, t in times.items():
            i = self.candidates.index_of(plan)
            if i is not None:
                u[i] = median_error(t, noise_floor=floor)
        u_cur = median_error(times.get(current, ()), noise_floor=floor)
        return u, (u_cur if math.isfinite(u_cur) else unmeasured)

    def start_plan(self, micro_batch_size: int | None = None) -> ParallelPlan:
        """The plan to start the run on: the candidate with the shortest predicted step at the
        current global batch (the step-time model in use; memory-feasible candidates only;
        `micro_batch_size`: only plans with this one, e.g. fixed by the user), or the current
        plan when it is as fast or no candidate qualifies. A run starts with no
        elapsed time to amortise a switch over (`core.plan.search.amortisation` is then ~0), so
        a slow first layout would otherwise be kept until the run is long enough to pay for a
        switch; the runtime asks this before it builds the engine (`controller.start`)."""
        if not self.search_options["allow_reconfigure"]:
            return self.plan
        c = self.candidates
        keep = c.global_batch_size == self.plan.global_batch_size
        if micro_batch_size:
            keep &= c.micro_batch_size == micro_batch_size
        idx = np.flatnonzero(keep)
        if not len(idx):
            return self.plan
        all_s = self.predicted_step_s()
        step_s = all_s[idx]
        ok = np.isfinite(step_s) & (step_s > 0)
        if not ok.any():
            return self.plan
        best = int(idx[ok][np.argmin(step_s[ok])])
        cur = c.index_of(self.plan)
        if cur is not None and np.isfinite(all_s[cur]) and all_s[cur] <= all_s[best]:
            return self.plan
        return c.plan(best)

    def drain_events(self) -> list[dict]:
        """Probe results and audits since the last call (rows for decisions.jsonl)."""
        out, self.events = self.events, []
        return out

    def predicted_step_s(self) -> np.ndarray:
        """The model's step time for every candidate, recomputed only when the model changes."""
        model = self.decision_model()
        if self._predicted is None or self._predicted[0] is not model:
            self._predicted = (model, self.candidates.predict_step_s(model))
        return self._predicted[1]

    def remaining_s(self, record: StepRecord) -> float | None:
        """Seconds the run has left at the current plan's speed, from `horizon_tokens`:
        (horizon − tokens so far) / tokens per second; None when the horizon is unknown (0),
        spent, or the step time is not a positive number (COPUS's elapsed-time rule then)."""
        left = self.horizon_tokens - record.tokens
        if (
            self.horizon_tokens <= 0
            or left <= 0
            or record.samples <= 0
            or not (math.isfinite(record.step_s) and record.step_s > 0)
        ):
            return None
        tokens_per_step = record.tokens / record.samples * record.plan.global_batch_size
        return left / tokens_per_step * record.step_s

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

    # ---- the loop ------------------------------------------------------------------------------

    def observe(self, record: StepRecord) -> Decision | None:
        """Account one optimizer step; maybe return the plan to switch to at the next step."""
        if math.isfinite(record.step_s) and record.step_s > 0:
            self.elapsed_s += record.step_s
        self._measure(record)
        self._learn_calibration(record)
        if record.plan.global_batch_size != self.plan.global_batch_size:
            self._batch_change_step = record.step
        self.plan = record.plan
        follow = self._follow_up(record)
        if follow is not None or self.explorer.busy or self.auditor.busy:
            return follow
        if self._excursion_end is not None:
            if record.step < self._excursion_end:
                self.last_explanation = {
                    "step": record.step,
                    "action": "wait",
                    "why": f"calibration excursion until step {self._excursion_end}",
                }
                return None
            self._excursion_end = None
        why = self._gate(record)
        if why is not None:
            self.last_explanation = {"step": record.step, "action": "wait", "why": why}
            return self._maybe_probe(record)
        self._maybe_refit()
        b_used = self.calibration * lower_bound(record.b_noise, record.b_noise_rel_err, self.confidence)
        u, u_cur = self.step_uncertainty(record.plan)
        result = evaluate(
            self.candidates,
            self.decision_model(),
            b_used,
            record.plan,
            reconfig_cost_s=self.reconfig_cost_s,
            elapsed_s=self.elapsed_s,
            useful_s=self.useful_s,
            horizon_s=self.remaining_s(record),
            step=record.step,
            step_s=self.predicted_step_s(),
            uncertainty=u,
            current_uncertainty=u_cur,
            step_confidence=self.step_confidence,
            **self.search_options,
        )
        self.last_decision_step = record.step
        self.last_explanation = {
            **result.explanation,
            "b_noise_raw": record.b_noise,
            "b_noise_rel_err": record.b_noise_rel_err,
            "calibration": self.calibration,
        }
        if self.posterior is not None:
            self.last_explanation["calibration_posterior"] = self.posterior.summary()
        decision = result.decision
        if decision is None and self.batch_margin < self.margin:
            decision = self._batch_move(record, u, u_cur)
        if decision is None:
            decision = self._maybe_excursion(record)
        if decision is None:
            return self._maybe_probe(record)
        if self.posterior is not None:
            decision = replace(decision, calibration=self.posterior.summary())
        self.history.append(decision.to_dict())
        before_s = self.measured_step_s(record.plan, last=max(self.auditor.steps, 1))
        measured = math.isfinite(before_s)
        self.auditor.start(
            decision, record.plan, before_s if measured else result.explanation["current"]["step_s"], measured
        )
        return decision

    def _batch_move(self, record: StepRecord, u: np.ndarray | None, u_cur: float) -> Decision | None:
        """A batch change on the current layout that beats it by `batch_margin` in goodput
        expected under the posterior over c (`core.control.batch_move`)."""
        phi = lower_bound(record.b_noise, record.b_noise_rel_err, self.confidence)
        o = self.search_options
        if self.posterior is not None:
            post = self.posterior
            joint = post.joint()  # (γ, c)
            c_values = np.broadcast_to(2.0**post.log2_grid, joint.shape)
            flags = (
                [g > 0 for g in post.lr_exponents] if len(post.lr_exponents) > 1 else [o["lr_aware"]]
            )  # one exponent: the configured factor
            lr_flags = np.broadcast_to(np.array(flags)[:, None], joint.shape)
            weights = joint
        else:
            c_values, weights, lr_flags = (np.array([self.calibration]), np.array([1.0]), np.array([o["lr_aware"]]))
        step_s = self.predicted_step_s()
        found = best_batch_move(
            self.candidates,
            step_s,
            record.plan,
            phi,
            c_values,
            weights,
            batch_margin=self.batch_margin,
            max_growth=o["max_growth"],
            min_batch=o["min_batch"],
            max_batch=o["max_batch"],
            allow_shrink=o["allow_shrink"] or self.shrink_batch,
            lr_aware=lr_flags,
            lr_ref_batch=o["lr_ref_batch"],
            uncertainty=u,
            current_uncertainty=u_cur,
            step_confidence=self.step_confidence,
        )
        if found is None:
            return None
        i, gain, required = found
        plan = self.candidates.plan(i)
        reason = (
            f"batch {record.plan.global_batch_size} -> {plan.global_batch_size} on "
            f"{record.plan.describe()}: expected goodput under the posterior over c "
            f"+{100 * gain:.1f}% > {100 * required:.1f}% (batch margin)"
        )
        self.last_explanation = {**self.last_explanation, "action": "batch", "why": reason}
        return Decision(
            kind="batch",
            plan=plan,
            reason=reason,
            step=record.step,
            b_noise=self.calibration * phi,
            calibration=self.posterior.summary() if self.posterior else None,
        )

    def _maybe_excursion(self, record: StepRecord) -> Decision | None:
        """A deliberate step to excursion_factor·B on this layout for one experiment's length,
        when its expected value exceeds its cost (`core.control.excursion`); then ordinary
        decisions resume (under "auto" a batch move may come back down)."""
        post = self.posterior
        since = record.step - (self._batch_change_step or 0)
        if (
            post is None
            or self.num_excursions >= self.max_excursions
            or post.window_open
            or record.tokens < self.lr_warmup_tokens
            or since < post.window_steps
            or post.interval_ratio() <= self.excursion_min_interval
        ):
            return None
        o = self.search_options
        steps = post.skip_steps + post.window_steps
        phi = lower_bound(record.b_noise, record.b_noise_rel_err, self.confidence)
        found = excursion_value(
            self.candidates,
            self.predicted_step_s(),
            record.plan,
            phi,
            2.0**post.log2_grid,
            post.probabilities(),
            factor=self.excursion_factor,
            steps=steps,
            horizon_steps=float(record.step),
            max_batch=o["max_batch"],
            lr_aware=o["lr_aware"],
            lr_ref_batch=o["lr_ref_batch"],
        )
        if found is None or not found[1] > found[2]:
            return None
        i, value, cost = found
        plan = self.candidates.plan(i)
        self.num_excursions += 1
        self._excursion_end = record.step + 1 + steps
        reason = (
            f"calibration excursion {self.num_excursions}/{self.max_excursions}: B "
            f"{record.plan.global_batch_size} -> {plan.global_batch_size} for {steps} steps "
            f"(c 5-95 % {post.quantile_c(0.05):.2g}-{post.quantile_c(0.95):.2g}; value "
            f"{value:.1f} > cost {cost:.1f} steps of goodput)"
        )
        self.last_explanation = {**self.last_explanation, "action": "excursion", "why": reason}
        return Decision(
            kind="batch",
            plan=plan,
            reason=reason,
            step=record.step,
            b_noise=self.calibration * phi,
            purpose="probe",
            calibration=post.summary(),
        )

    def _follow_posterior(self) -> None:
        """c = the posterior median given the most probable LR exponent; when the posterior
        weighs several exponents, the LR-aware factor is on when the most probable is > 0
        (layout decisions through `core.plan.search.evaluate`); else as configured."""
        self.calibration = self.posterior.value()
        if len(self.posterior.lr_exponents) > 1:
            self.search_options["lr_aware"] = self.posterior.lr_exponent() > 0

    def _learn_calibration(self, record: StepRecord) -> None:
        """gns.calibration = "auto": one step into the posterior over c; follow its median.
        A closed window (an experiment) is logged to decisions.jsonl as a "calibration" row."""
        if self.posterior is None or record.skipped:
            return
        row = self.posterior.observe(
            record.loss, record.plan.global_batch_size, record.b_noise, usable=record.tokens >= self.lr_warmup_tokens
        )
        if row is not None:
            self._follow_posterior()
            self.events.append({"event": "calibration", "step": record.step, **row})

    # ---- exploration and audits (core.explore, core.audit) -------------------------------------

    def _goodput_of(self, b_noise: float):
        """goodput(step_s, B) at the calibrated noise scale, as the search scores it."""
        b = self.calibration * b_noise if math.isfinite(b_noise) and b_noise > 0 else math.inf
        opts = self.search_options

        def of(step_s: float, batch: int) -> float:
            return float(
                goodput(
                    np.array([step_s]),
                    np.array([batch]),
                    b,
                    lr_aware=opts["lr_aware"],
                    lr_ref_batch=opts["lr_ref_batch"],
                )[0]
            )

        return of

    def _follow_up(self, record: StepRecord) -> Decision | None:
        """Advance the active probe or audit (never both: each waits for the other)."""
        if self.explorer.busy:
            last = self.explorer.settings.probe_steps
            return self._settle(
                *self.explorer.follow(
                    record.step, record.plan, record.step_s, lambda plan: self.measured_step_s(plan, last=last)
                )
            )
        if self.auditor.busy:
            return self._settle(
                *self.auditor.follow(
                    record.step, record.plan, record.step_s, self._goodput_of(record.b_noise), record.b_noise
                )
            )
        return None

    def _settle(self, row: dict | None, decision: Decision | None) -> Decision | None:
        """A finished probe or audit: refit on what was measured, log its row, maybe switch."""
        if row is None:
            return None
        if self.fitter is not None and row.get("verdict") != "not applied":
            self.fitter.refit()
        realised = row.get("realised_step_s", row.get("measured_step_s"))
        predicted = row.get("predicted_step_s")
        if realised and predicted and predicted > 0 and row.get("verdict") != "not applied":
            self.step_misses.append(float(realised) / float(predicted) - 1.0)
        self.events.append(row)
        self.last_explanation = {**row, "action": decision.purpose if decision else "none"}
        if decision is not None:
            self.history.append(decision.to_dict())
        return decision

    def _maybe_probe(self, record: StepRecord) -> Decision | None:
        """A probe of an unmeasured layout at the current batch, within the explore bounds."""
        allow = self.search_options["allow_reconfigure"]
        if (
            not allow
            or self.fitter is None
            or record.skipped
            or record.step < self.warmup_steps
            or len(self.fitter.times.get(record.plan, ())) < self.explorer.settings.probe_steps
        ):
            return None
        measured = {(p.layout, p.global_batch_size) for p in self.fitter.times}
        decision = self.explorer.propose(record.step, record.plan, self.candidates, self.decision_model(), measured)
        if decision is not None:
            self.history.append(decision.to_dict())
            self.last_explanation = {"step": record.step, "action": "probe", "why": decision.reason}
        return decision

    def _measure(self, record: StepRecord) -> None:
        """Feed the step time to the fitter, skipping the first step under each plan."""
        first = record.plan != self.seen_plan
        self.seen_plan = record.plan
        if self.fitter is None or first or record.skipped:
            return
        self.fitter.observe(record.plan, record.step_s)

    def model_error(self) -> float:
        """Largest relative miss of the model on the median measured step time of any plan."""
        obs = self.fitter.observations() if self.fitter is not None else []
        if not obs:
            return 0.0
        pred = self.model.predict_plans([p for p, _ in obs])
        return float(np.max(np.abs(pred / np.array([s for _, s in obs]) - 1.0)))

    def _maybe_refit(self) -> bool:
        f = self.fitter
        if f is not None and self.measure_first and f.num_fits == 0 and f.times:
            f.refit()  # measured medians and the model are compared: same scale first
            return True
        if f is None or f.since_fit < self.refit_interval_steps:
            return False
        if self.model_error() <= self.refit_tolerance:
            return False
        f.refit()
        return True

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
        if self._batch_change_step is not None and record.step - self._batch_change_step < self.recovery_steps:
            return f"recovery: batch changed at step {self._batch_change_step}, hold {self.recovery_steps} steps"
        if self.confidence > 0:
            if not lower_bound(record.b_noise, record.b_noise_rel_err, self.confidence) > 0:
                return f"gns lower bound is 0 (rel. error {record.b_noise_rel_err})"
        elif not record.b_noise_rel_err <= self.max_rel_err:
            return f"gns not ready: rel. error {record.b_noise_rel_err:.3g} > max_rel_err {self.max_rel_err}"
        return None

    def forbid(self, rule: Callable[[ParallelPlan], bool]) -> int:
        """Drop every candidate plan for which `rule(plan)` holds (e.g. one that ran out of
        device memory in this run): it is never chosen again. Returns how many were dropped."""
        c = self.candidates
        keep = np.array(
            [
                not rule(
                    ParallelPlan(
                        dp=int(c.dp[i]),
                        tp=int(c.tp[i]),
                        pp=int(c.pp[i]),
                        micro_batch_size=int(c.micro_batch_size[i]),
                        num_microbatches=int(c.num_microbatches[i]),
                    )
                )
                for i in range(len(c))
            ],
            dtype=bool,
        )
        if keep.all():
            return 0
        self.candidates, self._predicted = c.subset(keep), None
        return int((~keep).sum())

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
            "explorer": self.explorer.state_dict(),
            "auditor": self.auditor.state_dict(),
            "step_misses": list(self.step_misses),
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
        if state.get("explorer") is not None:
            self.explorer.load_state_dict(state["explorer"])
        if state.get("auditor") is not None:
            self.auditor.load_state_dict(state["auditor"])
        self.step_misses = [float(x) for x in state.get("step_misses", [])]
        if self.posterior is not None and state.get("posterior") is not None:
            self.posterior.load_state_dict(state["posterior"])
            self._follow_posterior()


def _plan_list(plan: ParallelPlan | None) -> list[int] | None:
    if plan is None:
        return None
    return [plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches]


def _plan_of(values: Sequence[int] | None) -> ParallelPlan | None:
    if values is None:
        return None
    dp, tp, pp, mbs, nmb = (int(v) for v in values)
    return ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=nmb)


def default_micro_batch_sizes(initial_plan: ParallelPlan, max_batch: int) -> list[int]:
    """Powers of two up to min(max_batch, 64), plus the initial plan's micro-batch size."""
    sizes = {2**k for k in range(7) if 2**k <= max(max_batch, 1)}
    return sorted(sizes | {initial_plan.micro_batch_size})


def make_controller(
    settings: Any,
    initial_plan: ParallelPlan,
    world_size: int,
    shape: ModelShape,
    *,
    step_time_model: StepTimePredictor | None = None,
    memory_capacity_bytes: float | None = None,
    hardware: HardwareProfile | str | None = None,
    micro_batch_sizes: Iterable[int] | None = None,
    margin: float = 0.10,
    lr_aware: bool = True,
    reconfig_cost_s: float = 2.0,
    allow_reconfigure: bool = True,
    profile_observations: Iterable[tuple[ParallelPlan, float]] | None = None,
    refit_interval_steps: int = 20,
    memory_model: MemoryModel | None = None,
    batch_grid: str = "multiples",
    online_fit: bool = True,
    allow_shrink: bool = False,
    explore: ExploreSettings | None = None,
    audit_steps: int = 0,
    cores: int | None = None,
    step_confidence: float = 0.0,
    plan_options: dict | None = None,
    batch_margin: float | None = None,
    lr_warmup_tokens: float = 0.0,
    shrink_batch: bool | None = None,
    max_excursions: int = 0,
    horizon_tokens: float = 0.0,
    posterior_options: dict | None = None,
) -> Controller:
    """The goodput policy for `make_policy("goodput", ...)`.

    `settings` has the `PolicySettings` fields initial, min, max, max_growth, interval_steps,
    warmup_steps, max_rel_err, calibration. Step-time prior, first match wins:
    `step_time_model` (a `StepTimeModel` is refitted online; any other predictor, e.g. a
    profiled table, is used as is), then a fit to `profile_observations` ((plan, step_s) pairs
    from `copus profile`), then the analytic model of `hardware` (None: the "cpu" profile).
    Plans over `memory_capacity_bytes` per rank (memory model of `shape`) are never chosen.
    The global batch never shrinks unless `allow_shrink` (Lau et al.'s schedules only grow;
    COPUS leaves it open; with a noisy b_noise, shrinking makes B oscillate) or an audit undoes
    a growth. `explore` bounds the in-run probes (None: none); `audit_steps` measured steps
    check each decision (0: no audits).  `cores`: CPU cores the ranks share (CPU prior only,
    `core.cpu_model`; None: one core per rank). `plan_options` (`ParallelPlan.options` keys: the
    run's activation checkpointing, pipeline schedule, ...) price every candidate's memory and
    the analytic prior's step time under those options (issue 25); None: the defaults.
    `lr_warmup_tokens`: the LR schedule's warm-up; gns.calibration = "auto" takes no evidence
    before it (core.stats.calibration_posterior).
    """
    initial_plan.validate(world_size, shape)
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    min_b, max_b = int(settings.min), int(settings.max)
    mbs = list(micro_batch_sizes) if micro_batch_sizes is not None else default_micro_batch_sizes(initial_plan, max_b)
    if memory_capacity_bytes is not None and memory_model is None:
        memory_model = MemoryModel(shape=shape, mixed_precision=(hw is None or hw.dtype_bytes == 2))
    if plan_options and memory_model is not None:
        memory_model = memory_model.with_plan_options(**plan_options)
    cands = build_candidates(
        world_size,
        shape,
        min_batch=min_b,
        max_batch=max_b,
        micro_batch_sizes=mbs,
        batch_grid=batch_grid,
        memory_model=memory_model,
        memory_capacity_bytes=memory_capacity_bytes,
    )
    if not len(cands):
        raise ValueError(
            f"no plan fits: world_size={world_size}, batch [{min_b}, {max_b}], "
            f"micro_batch_sizes={mbs}, memory_capacity_bytes={memory_capacity_bytes}"
        )
    fitter, fixed = None, None
    if step_time_model is not None and not isinstance(step_time_model, StepTimeModel):
        fixed = step_time_model
    else:
        prior = step_time_model or prior_model(shape, hw, world_size, cores=cores, **(plan_options or {}))
        if step_time_model is None and profile_observations is not None:
            prior = fit_model(list(profile_observations), prior)
        if online_fit:
            # refits are triggered by the controller at decision points (`_maybe_refit`)
            fitter = OnlineFitter(shape, hw, world_size, refit_every=2**62)
            fitter.prior = fitter.model = prior
        else:
            fixed = prior
    return Controller(
        candidates=cands,
        initial_plan=initial_plan,
        fitter=fitter,
        model=fixed,
        min_batch=min_b,
        max_batch=max_b,
        max_growth=float(settings.max_growth),
        interval_steps=int(settings.interval_steps),
        warmup_steps=int(settings.warmup_steps),
        max_rel_err=float(settings.max_rel_err),
        calibration=float(settings.calibration),
        margin=margin,
        lr_aware=lr_aware,
        lr_ref_batch=float(settings.initial),
        reconfig_cost_s=reconfig_cost_s,
        allow_reconfigure=allow_reconfigure,
        refit_interval_steps=refit_interval_steps,
        allow_shrink=allow_shrink,
        explore=explore,
        audit_steps=audit_steps,
        memory_capacity_bytes=memory_capacity_bytes,
        confidence=float(getattr(settings, "confidence", 0.0)),
        recovery_steps=int(getattr(settings, "recovery_steps", 0)),
        step_confidence=step_confidence,
        batch_margin=batch_margin,
        lr_warmup_tokens=lr_warmup_tokens,
        shrink_batch=shrink_batch,
        max_excursions=max_excursions,
        horizon_tokens=horizon_tokens,
        posterior=(
            CalibrationPosterior(
                prior_c=float(settings.calibration),
                quantile=float(getattr(settings, "calibration_quantile", 0.5)),
                **(posterior_options or {}),
            )
            if getattr(settings, "calibration_mode", "fixed") == "auto"
            else None
        ),
    )
