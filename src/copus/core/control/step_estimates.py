"""How the planning controller estimates step times: its model, the run's own measurements
and, given one, `copus profile`'s table (docs/robust-goodput.md §6, §6.11).

- A measured plan: the precision-weighted mean (in log) of the model and its measured median,
  the measurements' standard error no less than the current plan's own relative spread (plans
  measured under another load of the machine are not taken at face value).
- With a profile (`controller.profile`): every step time in the profile's units. A profiled
  plan: its measured median; a plan measured only in the run: its median ÷ k, k = the median
  over plans measured both in the run and by the profile of run median / profiled median (the
  machine's load scales every plan alike); the model fitted to the profile elsewhere; the
  switch cost ÷ k too.
- The model's error on an unmeasured layout (what exploration prices): the root mean square of
  log(measured / predicted) over the layouts measured so far, 0.3 before the first.
Pure numpy; no torch.
"""

from __future__ import annotations

import math

import numpy as np

from copus.core.control.base import ControllerBase
from copus.core.cost.fit import ProfiledStepTime
from copus.core.plan.records import StepRecord
from copus.core.stats.step_uncertainty import median_error, relative_spread


class MeasuredStepTimes(ControllerBase):
    """The planner's step-time estimates (a mixin over `ControllerBase`); the subclass sets
    `profile` (plan -> profiled seconds), `step_misses` and `_shrunk`."""

    profile: dict
    step_misses: list[float]
    _shrunk: tuple | None

    def decision_model(self):
        """The step time of each measured plan estimated from its measurements and the model
        together (in log: precision-weighted, the model's weight 1/σ_model², the measurements'
        1/se², se = the median's standard error but no less than the current plan's own
        relative spread, so that plans measured under another load of the machine are not
        taken at face value); the (fitted) model elsewhere."""
        f = self.fitter
        if self.profile:
            return self._profiled_model()
        if f is None or not f.times:
            return self.model
        key = (id(f.model), sum(len(t) for t in f.times.values()), len(self.step_misses))
        if self._shrunk is not None and self._shrunk[0] == key:
            return self._shrunk[1]
        plans = list(f.times)
        pred = np.asarray(self.model.predict_plans(plans), dtype=float).reshape(-1)
        floor = relative_spread(f.times.get(self.plan, ()))
        floor = floor if math.isfinite(floor) else 0.0
        w_model = 1.0 / max(self.model_spread(), 1e-3) ** 2
        obs = []
        for plan, model_s in zip(plans, pred):
            times = f.times[plan]
            se = median_error(times, noise_floor=0.0)
            if not (math.isfinite(se) and model_s > 0):
                continue
            w = 1.0 / max(se, floor, 1e-3) ** 2
            log_s = (w_model * math.log(model_s) + w * math.log(float(np.median(times)))) / (w_model + w)
            obs.append((plan, math.exp(log_s)))
        self._shrunk = (key, ProfiledStepTime(self.model, obs))
        return self._shrunk[1]

    @property
    def reconfig_cost_s(self) -> float:
        """The measured switch cost; with a profile, in its units (÷ `load_factor`)."""
        cost = super().reconfig_cost_s
        return cost / self.load_factor() if self.profile else cost

    def load_factor(self) -> float:
        """k = exp(median over plans measured both in this run and by the profile of
        log(run median / profiled median)): how much slower this run's machine is than the one
        the profile measured (load, clocks); 1 before any such plan is measured."""
        f = self.fitter
        logs = [
            math.log(float(np.median(t)) / self.profile[p])
            for p, t in (f.times.items() if f else ())
            if t and p in self.profile
        ]
        return math.exp(float(np.median(logs))) if logs else 1.0

    def _profiled_model(self):
        """With a profile (`controller.profile`), every step time in the profile's units: a
        profiled plan's measured median; a plan measured only in this run, its median / k
        (`load_factor`); the model fitted to the profile elsewhere. Relative step times come
        from the profile, measured on a quiet machine; the run's own measurements, taken under
        whatever else shares the machine, only set k (so the plan does not chase the load)."""
        f = self.fitter
        key = ("profile", sum(len(t) for t in f.times.values()) if f else 0)
        if self._shrunk is not None and self._shrunk[0] == key:
            return self._shrunk[1]
        k = self.load_factor()
        extra = [(p, float(np.median(t)) / k) for p, t in (f.times.items() if f else ()) if t and p not in self.profile]
        base = f.prior if f is not None else self.model
        self._shrunk = (key, ProfiledStepTime(base, [*self.profile.items(), *extra]))
        return self._shrunk[1]

    def _note_new_layout(self, record: StepRecord) -> None:
        """The model's miss on a layout's first measured median (what exploration prices)."""
        f = self.fitter
        if f is None or record.skipped:
            return
        times = f.times.get(record.plan, [])
        if len(times) == 3 and not any(p.layout == record.plan.layout and p != record.plan for p in f.times):
            pred = float(np.asarray(self.model.predict_plans([record.plan])).reshape(-1)[0])
            if pred > 0:
                self.step_misses.append(float(np.median(times)) / pred - 1.0)

    def model_spread(self) -> float:
        """σ of log(measured/predicted) for an unmeasured layout: the misses measured so far
        (root mean square of log(1 + miss)); 0.3 before the first (a CPU prior's typical
        error, docs/cost-model.md)."""
        if not self.step_misses:
            return 0.3
        return float(np.sqrt(np.mean(np.log1p(np.asarray(self.step_misses)) ** 2)))
