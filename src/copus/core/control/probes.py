"""Layout probes of the planning controller (`core.control.planner`): with measured step times
only, for each layout never measured, the value of measuring it = the expected time it would
save if its step time were the model's ± the model's measured error (three-point Gauss quadrature
of a log-normal), against its cost = two switches and the probe's slower steps. A probe is an
ordinary switch (purpose "probe"), run at the batch the plan chose (docs/robust-goodput.md
§6.21); the next plan keeps or leaves the layout on its measured step time. A profiled layout
(`controller.profile`) is never probed, nor any during the LR warm-up (§6.19).

`LayoutProbes` is a mixin of `PlanningController`.
"""

from __future__ import annotations

import math

import numpy as np

from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import StepRecord

QUADRATURE = ((-1.2247, 1 / 6), (0.0, 2 / 3), (1.2247, 1 / 6))  # ±sqrt(3/2)σ: a 3-point Gauss rule


class LayoutProbes:
    """The planner's probe of an unmeasured layout when its value exceeds its cost."""

    def _probe(self, record: StepRecord, plan: dict) -> tuple[ParallelPlan, str] | None:
        """The unmeasured layout whose measurement is worth most, when worth its cost."""
        f = self.fitter
        if not self.explore or f is None or not self.search_options["allow_reconfigure"] or self._layout_held():
            return None
        measured = {p.layout for p in f.times} | {p.layout for p in self.profile}
        sigma, c = self.model_spread(), self.reconfig_cost_s
        cs, w = self.c_hypotheses()
        e_now, phi_now, beta = self.forecast(cs)
        e_end = plan["e_end"]
        base = float(np.min(plan["J"]))
        step_s = self.predicted_step_s()
        best = None
        for lay, key in enumerate(self._keys):
            if key in measured or not plan["allowed"][lay]:
                continue
            value = 0.0
            for z, q in QUADRATURE:
                s = np.where(self._ids == lay, step_s * math.exp(sigma * z), step_s)
                h = w @ self.layout_times(e_now, e_end, phi_now, beta, cs, s)
                value += q * max(base - (h[lay] + c), 0.0)
            i = self._probe_plan(lay, plan)
            cur = self.candidates.index_of(record.plan)
            slower = max(step_s[i] - (step_s[cur] if cur is not None else step_s[i]), 0.0)
            cost = 2.0 * c + self.probe_steps * slower
            if value > cost and (best is None or value - cost > best[1]):
                best = (self.candidates.plan(i), value - cost, value, cost)
        if best is None:
            return None
        return best[0], (
            f"probe {best[0].describe()}: the value of measuring it "
            f"{best[2]:.1f}s > its cost {best[3]:.1f}s (two switches and slower "
            f"steps; model error σ={sigma:.2f})"
        )

    def _probe_plan(self, lay: int, plan: dict) -> int:
        """The plan a probe of layout `lay` runs: at the batch the plan chose (`plan["index"]`,
        which respects the ladder and the floor), or, where `lay` hosts no plan at that batch,
        the nearest batch on it (|log2 B − log2 B_plan| least, not below the floor's side);
        among those the best-scored. A probe measures a layout; it moves no batch the plan
        did not choose (docs/robust-goodput.md §6.21)."""
        on = np.flatnonzero(self._ids == lay)
        b = self.candidates.global_batch_size[on].astype(float)
        want = float(self.candidates.global_batch_size[plan["index"]])
        above = b >= want
        on, b = (on[above], b[above]) if above.any() else (on, b)
        d = np.abs(np.log2(b / want))
        near = on[d <= d.min() + 1e-9]
        return int(near[np.argmax(plan["score"][near])])
