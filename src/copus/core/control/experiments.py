"""Batch experiments priced by their value of information, for the planning controller
(`core.control.planner`; docs/robust-goodput.md §6.9, §6.28, §6.29, §6.32, §6.33).

However narrow the posterior over c (a narrow one can be wrong: §6.32), while no calibration
window is open and the window's pre-change steps lie past the noise-scale EMA's and the LR's
warm-up, a larger batch on the chosen layout's ladder (at most 2× the current) is taken when its
value of information exceeds its cost (`core.control.experiment_value`: the expected time the
batch choice would save over the rest of the run if the posterior were updated by the bend the
move would show, against the expected time lost over the window at that batch).

- **A square wave** (`DITHER_HALF_STEPS`, §6.33): the larger batch and the batch before it in
  turn every 30 steps while the window lasts, its last half-period held until the window is read
  (priced over its steps at the larger batch).
- **Read, then free to return** (`RETURN_AFTER_EXPERIMENT`, §6.28): the batch does not fall
  until the window has been read, and may then fall back to the batch before the experiment
  without further evidence: an experiment is a measurement, not a commitment.
- **Only readable windows** (`MIN_SEPARATION`, §6.29): no experiment is taken whose window
  would tell the plan's most distant hypotheses of c apart by less than 2 standard deviations
  of its loss noise; such a reading is the fit's misspecification, and many of them bias the
  posterior.

`BatchExperiments` is a mixin of `PlanningController`: it reads the planner's posterior,
candidates, chunks of φ and decision step, and keeps the experiment's own state.
"""

from __future__ import annotations

import numpy as np

from copus.core.control import experiment_value
from copus.core.plan.records import Decision, StepRecord

# "VoI experiments" (docs/robust-goodput.md §6.9): an upward batch experiment when its value of
# information exceeds its cost. On by default since §6.29, with the return below, the separation
# floor, the outcome drawn and the window fit's loss offsets (7 seeds: mean speed-up +0.80 -> +1.06 %,
# worst cell -5.1 -> -2.2 %, minimum capture 0.32 -> 0.52, median 0.755 -> 0.749, cells > 1 % behind
# 8 -> 11; the long pre-training truth unchanged, 669.5 / 669.6 / 667.3 min; §6.28 looped there
# before the floor); `bench/planner_grid.py --no-voi-experiments` turns it off
EXPERIMENTS = True
# after an experiment's window has closed the batch may fall back to the batch before the
# experiment without evidence about c (docs/robust-goodput.md §6.28): without it an experiment's
# batch became the floor and VoI experiments cost every low-c cell (§6.25)
RETURN_AFTER_EXPERIMENT = True
# the same experiment (B_now → B_x) is taken again only once φ has grown this many-fold since it
# was; 0: any time (docs/robust-goodput.md §6.28: 2 broke the variant's loop on the long
# pre-training truth but grew its batch far too early there, 826–893 min against 681–726 at 0)
REPEAT_PHI_GROWTH = 0.0
# an experiment is taken only where its window can tell the plan's two most distant hypotheses
# of c apart by this many standard deviations of its loss noise (max |d_jk|, `experiment_value`);
# below it a window's reading is the fit's misspecification, not c (docs/robust-goodput.md §6.29:
# on the long pre-training truth 300 windows at z ≈ 0.04–0.8 drew the posterior's median from 4 to
# 2.2 and the batch grew 95k steps late; on the grid the experiments taken have z ≈ 2.4–16)
MIN_SEPARATION = 2.0
# experiments are priced only while the posterior's 90 % interval of c spans more than this many-fold;
# 1.0: whenever no window is open, however narrow the posterior (docs/robust-goodput.md §6.32: one
# misread first window left the held-out runs 3-fold sure of a c 3–5x off and never priced another
# experiment; 7 seeds: median capture 0.749 -> 0.787, minimum 0.52 -> 0.54, the long truth unchanged).
# WIDE_RATIO (8) before §6.32
EXPERIMENT_WIDE_RATIO = 1.0
# a VoI experiment as a square wave (docs/robust-goodput.md §6.33; default since then): while the
# posterior's window lasts (skip + window steps after the first change) the batch alternates between
# the experiment's batch and the batch before it every DITHER_HALF_STEPS steps, and the changes
# inside the window do not extend it (`CalibrationPosterior.hold_window`); the last half-period is
# held until the window is read, then the plan decides. At 30: 32 of the window's 70 steps at the
# batch before it. 7 seeds: cells > 1 % behind 11 -> 6 (every 7B lr-tuned cell within 1 %), median
# capture 0.787 -> 0.81, mean +1.09 -> +1.12 %, but 32B sqrt-lr deeper (worst -2.15 -> -3.02 %);
# the long truth unchanged. 0: the batch held over the window (§6.9–§6.32)
DITHER_HALF_STEPS = 30


def _pair(b_now: float, b_x: float) -> str:
    """The key "B_now>B_x" of an experiment pair (`experiment_phi`, saved in the checkpoint)."""
    return f"{float(b_now):g}>{float(b_x):g}"


class BatchExperiments:
    """The planner's VoI batch experiments (module docstring): pricing, the square wave, state."""

    def _init_experiments(self) -> None:
        """The experiment's state: none under way, none taken."""
        self.experiment_batch: float | None = None  # the batch of the experiment being read
        # the batch before the first of a chain of experiments: the plan may return to it once the
        # experiment's window has closed (an experiment is a measurement, not a commitment)
        self.experiment_from: float | None = None
        self.experiment_phi: dict[str, float] = {}  # "B_now>B_x" -> φ when that experiment was taken
        # a square-wave experiment under way (`DITHER_HALF_STEPS`): (the batch before it, the
        # experiment's batch) as candidate indices, its first step, the step it ends
        self.dither: tuple[int, int, int, int] | None = None

    def _note_batch_move(self, record: StepRecord, plan: dict, target) -> None:
        """The plan moves the batch to `target`: as an experiment (`plan["experiment"]`), note it
        and start its square wave; as the plan's own move, no return to an earlier batch is owed."""
        if plan.get("experiment") is not None:
            self.experiment_batch = float(target.global_batch_size)
            if self.experiment_from is None:
                self.experiment_from = float(record.plan.global_batch_size)
            self.experiment_phi[_pair(record.plan.global_batch_size, target.global_batch_size)] = self._phi_last()
            lo = self.candidates.index_of(record.plan)
            if DITHER_HALF_STEPS > 0 and lo is not None:
                self.dither = (int(lo), int(plan["index"]), record.step, record.step + self.posterior.window_span)
                self.posterior.hold_window = True
        elif target.global_batch_size != record.plan.global_batch_size:
            self.experiment_from = None  # the plan's own batch move: no return is owed

    def _experiments(self) -> bool:
        """Whether batch experiments are priced: with the posterior over c, no window open (and the
        interval wider than `EXPERIMENT_WIDE_RATIO`-fold, which 1.0 never refuses)."""
        post = self.posterior
        if not EXPERIMENTS or post is None or post.window_open or post.interval_ratio() <= EXPERIMENT_WIDE_RATIO:
            return False
        # the window's pre-change steps must lie past the noise-scale EMA's warm-up (the first
        # `fit_after_steps`) and the LR warm-up (which the posterior does not read)
        return self.last_decision_step >= max(self.fit_after_steps, self.readable_from) + post.window_steps

    def _experiment(self, on, i, r, bc_now, w, grid, step_s) -> dict | None:
        """The larger batch of `on` (the ladder, at most one doubling) whose value of
        information most exceeds its cost (`experiment_value`; the window: the posterior's
        skip + read steps and the lag line's lag, §6.29; same layout, no switch), or None when none does."""
        post = self.posterior
        trend = post.loss_trend(2 * post.window_steps + post.skip_steps)
        if trend is None:
            return None
        b = self.candidates.global_batch_size.astype(float)
        b_now = float(self.plan.global_batch_size)
        steps = post.window_span  # the batch is held until the window closes, the lag line's too
        best = None
        for x in on[(b[on] > max(b[i], b_now)) & (b[on] <= 2.0 * b_now)]:
            if not self._may_repeat(b_now, float(b[x])):
                continue
            lr = self._lr_ratio(bc_now, b_now, float(b[x]))
            d = experiment_value.separation(bc_now, b_now, b[x], *trend[:2], post.window_steps, trend[2], lr)
            if np.abs(d).max() < MIN_SEPARATION:
                continue
            value = experiment_value.value(grid[0], grid[1], w, d)
            wave = DITHER_HALF_STEPS > 0
            held = self._wave_high_steps(steps) if wave else steps
            cost = experiment_value.window_cost(r[:, x], r[:, i], float(step_s[x]), held, w)
            if value > cost and (best is None or value - cost > best["net"]):
                best = {
                    "index": int(x),
                    "value_s": value,
                    "cost_s": cost,
                    "net": value - cost,
                    "instead_of": b[i],
                }
        return best

    def _lr_ratio(self, bc_now: np.ndarray, b_now: float, b_x: float) -> np.ndarray | float:
        """Each joint hypothesis's LR factor at B_x over B_now (`hypothesis_x0`; 1 without them:
        every hypothesis's bend is then E(B)'s alone, as before docs/robust-goodput.md §6.35)."""
        if self.hypothesis_x0 is None:
            return 1.0
        hi = np.asarray(self.lr_factor(bc_now, np.float64(b_x)), dtype=float)
        lo = np.asarray(self.lr_factor(bc_now, np.float64(b_now)), dtype=float)
        return hi / np.maximum(lo, 1e-300)

    def _phi_last(self) -> float:
        """The last stretch's mean noise-scale reading (nan before any)."""
        for c in reversed(self.chunks):
            if c[3] > 0:
                return c[2] / c[3]
        return float("nan")

    def _may_repeat(self, b_now: float, b_x: float) -> bool:
        """Whether the experiment B_now → B_x may be taken (again): never taken, or φ has grown
        `REPEAT_PHI_GROWTH`-fold since it was (docs/robust-goodput.md §6.28: at the same cφ/B the
        window would read what the last one read; on the long run the return made it a loop)."""
        last = self.experiment_phi.get(_pair(b_now, b_x))
        return last is None or not REPEAT_PHI_GROWTH or self._phi_last() >= REPEAT_PHI_GROWTH * last

    def _in_experiment(self) -> bool:
        """Whether the calibration window opened by an experiment (`_experiment`) is still open:
        its cost was priced over the whole window, so until then the batch does not fall."""
        return self.experiment_batch is not None and self.posterior is not None and self.posterior.window_open

    def _dither_step(self, record: StepRecord) -> Decision | None:
        """The square-wave experiment at this decision point (`DITHER_HALF_STEPS`): the experiment's
        batch in even half-periods, the batch before it in odd ones; once its span is over, the
        batch before it, held as an experiment's batch until the posterior's window closes."""
        lo, hi, first, last = self.dither
        if record.step >= last and not self.posterior.window_open:
            self.dither = self.experiment_batch = None  # read: the plan decides with it
            return None
        target = self.candidates.plan(hi if self._wave_phase(record.step - first) % 2 == 0 else lo)
        if target == record.plan:
            return None
        why = f"square-wave experiment: B={target.global_batch_size} (steps {first}-{last})"
        return self._decide(record, target, why, "decide")

    def _wave_phase(self, since: int) -> int:
        """The square wave's half-period `since` steps after it began: no change past the
        window's first skip + window steps (the posterior reads the window then, `hold_window`)."""
        post = self.posterior
        return min(since, post.skip_steps + post.window_steps - 1) // DITHER_HALF_STEPS

    def _wave_high_steps(self, span: int) -> int:
        """Steps of a square wave over `span` at the experiment's batch (even half-periods)."""
        return sum(self._wave_phase(t) % 2 == 0 for t in range(span))

    def _experiment_state(self) -> dict:
        """The experiment's part of the controller's checkpoint state."""
        return {
            "experiment_batch": self.experiment_batch,
            "experiment_from": self.experiment_from,
            "experiment_phi": dict(self.experiment_phi),
            "dither": None if self.dither is None else list(self.dither),
        }

    def _load_experiment_state(self, state: dict) -> None:
        """Restore `_experiment_state` (absent keys: none under way)."""
        exp = state.get("experiment_batch")
        self.experiment_batch = None if exp is None else float(exp)
        start = state.get("experiment_from")
        self.experiment_from = None if start is None else float(start)
        self.experiment_phi = {str(k): float(v) for k, v in state.get("experiment_phi", {}).items()}
        dither = state.get("dither")
        self.dither = None if dither is None else tuple(int(x) for x in dither)
