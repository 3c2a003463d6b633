"""Where a simulated run loses time against the oracle: the gap split by cause (issue 26).

The oracle (`core.sim.oracle`) takes, at every step, the plan with the highest true progress
rate r* = max_i ΔE_i / step_s_i over every candidate, and switches for free. A run that takes
plan p at a step spends step_s_p for ΔE_p = r_p · step_s_p of progress, which the oracle would
have bought in ΔE_p / r* seconds. Summed over the run's steps, the extra time is

    Σ step_s_p · (1 − r_p / r*)
      = Σ step_s_p · (1 − r_p / r_L*)            batch:  the best batch *on the layout it ran*
      + Σ step_s_p · (r_p / r_L* − r_p / r*)     layout: the best layout at that point
      + Σ switch costs                           switch: what the oracle does not pay

with r_L* = the best rate over the candidates of the run's layout (dp, tp, pp). Under a truth
whose progress depends only on the loss (lr-tuned) the oracle's time to a loss is
∫ dE / r*(E), so the three parts add up to the run's time minus the oracle's exactly (up to
the last step's overshoot of the target). Under the sqrt-LR truth the progress also depends on
the tokens seen (the LR warm-up is counted in tokens): the oracle, at the same loss, has seen
other tokens, and the rest (`residual`) is what the oracle gains from that, mostly by running
the warm-up at a large batch. Pure: numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from copus.core.plan.goodput import CandidateSet
from copus.core.plan.records import StepRecord
from copus.core.sim.oracle import layout_ids
from copus.core.sim.trajectory import Trajectory, TrajectoryParams


@dataclass(frozen=True, slots=True, kw_only=True)
class Gap:
    """Seconds a run lost against the oracle, up to the loss it reached, by cause."""

    batch_s: float  # a batch off the best for the layout it ran
    layout_s: float  # a layout off the best at that point
    switch_s: float  # parallelism changes (the oracle's are free)
    steps: int

    @property
    def total_s(self) -> float:
        return self.batch_s + self.layout_s + self.switch_s

    def to_dict(self) -> dict:
        return {
            "batch_s": self.batch_s,
            "layout_s": self.layout_s,
            "switch_s": self.switch_s,
            "total_s": self.total_s,
            "steps": self.steps,
        }


def decompose(
    records: list[StepRecord],
    switches: list[tuple[int, float]],
    params: TrajectoryParams,
    seq_len: int,
    candidates: CandidateSet,
    step_s: np.ndarray,
    stop_loss: float | None = None,
) -> Gap:
    """The module docstring's split for a run's `records` (its plans, in order) under the truth
    `params`, against `candidates` with predicted `step_s` (the oracle's menu; the run's plans
    must be among them); `switches`: (step after which it was paid, seconds) of each
    parallelism change. The true loss is replayed from the plans, so the reported (noisy)
    losses do not matter; `stop_loss`: stop at the first step that reaches it."""
    traj = Trajectory(params, seq_len)
    step_s = np.asarray(step_s, dtype=float)
    ok = np.isfinite(step_s) & (step_s > 0)
    batches = candidates.global_batch_size.astype(float)
    layouts = layout_ids(candidates)
    progress, tokens, loss = 0.0, 0.0, traj.loss(0.0)
    batch_s = layout_s = 0.0
    n = 0
    for rec in records:
        i = candidates.index_of(rec.plan)
        if i is None or not ok[i]:
            raise ValueError(
                f"plan {rec.plan.describe()} is not a feasible candidate; allowed: "
                "the plans of `candidates` with a finite step time"
            )
        gain = np.where(ok, np.asarray(traj.progress_per_step(batches, loss, tokens), float), 0.0)
        rate = gain / np.where(ok, step_s, np.inf)
        best = float(rate.max())
        best_layout = float(rate[layouts == layouts[i]].max())
        if best > 0 and best_layout > 0:
            batch_s += step_s[i] * (1.0 - rate[i] / best_layout)
            layout_s += step_s[i] * (rate[i] / best_layout - rate[i] / best)
        progress += float(gain[i])
        tokens += batches[i] * seq_len
        loss = traj.loss(progress)
        n += 1
        if stop_loss is not None and loss <= stop_loss:
            break
    switch_s = float(sum(cost for step, cost in switches if step < n))
    return Gap(batch_s=batch_s, layout_s=layout_s, switch_s=switch_s, steps=n)


def run_gap(scenario, result, planner=None, stop_loss: float | None = None) -> Gap:
    """`decompose` for a `core.sim.simulator.SimResult` simulated with `keep_records` on
    `scenario`, against the oracle's menu (every memory-feasible candidate of the scenario,
    as `core.sim.oracle.scenario_oracle_minutes`); `stop_loss` default: the last target."""
    from copus.core.sim.scenario import Planner

    if not result.records:
        raise ValueError(
            f"run {result.name!r} has no records; allowed: a run simulated with SimSettings(keep_records=True)"
        )
    cands, step_s = (planner or Planner(scenario)).menu()
    switches, costs = [], iter(result.switch_costs_s)
    for before, span in zip(result.timeline, result.timeline[1:]):
        if span.plan.layout != before.plan.layout:
            switches.append((span.start_step, next(costs)))
    stop = min(scenario.sim.target_losses) if stop_loss is None else stop_loss
    return decompose(
        result.records, switches, scenario.sim.trajectory, scenario.shape.seq_len, cands, step_s, stop_loss=stop
    )
