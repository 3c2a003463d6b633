"""The planning controller (`batch.policy = "goodput"`): one rule instead of a stack of thresholds.

**The rule.** At every decision, forecast the noise scale over the rest of the run under the
posterior over c, plan batch and layout over the rest of the run by dynamic programming with
the measured switch cost, take the first step of the plan, and plan again at the next decision;
take a larger batch as an experiment, and probe an unmeasured layout, only when the value of
what it would tell exceeds what it costs. The start layout is the same programme's choice under
the prior (`start="plan"`: Kaplan et al.'s critical batch for the tokens seen,
`core.control.start_prior`; `"fastest"`: the fastest plan at the initial batch;
docs/robust-goodput.md §6.16). The posterior over c reads no step of the first
`fit_after_steps` (the noise-scale EMA's warm-up, which the forecast leaves out too) nor of the
LR warm-up, during which the plan switches no layout and probes none (docs/robust-goodput.md
§6.19).

- **Batch moves are experiments** (docs/robust-goodput.md §6): while the posterior's 90 %
  interval of c spans more than `WIDE_RATIO` = 8-fold, the plan moves the batch only between
  rungs B0·2^(k/2) (√2 apart; every plan at a rung's batch stays a candidate): a move of a few
  per cent bends the loss curve too little for the posterior to read c from it. While the
  posterior is wide, one doubling per experiment: until the calibration window opened by a
  batch move has closed, the batch stays within 2× of the batch before that move (a plan
  deciding every `interval_steps` would otherwise climb several rungs on the prior before the
  first ≈ 70-step window is read), and the move that opens a window is itself at most a
  doubling (an uncapped first move jumped 8 → 32 on the prior: docs §6.11).
- **The batch falls only on evidence about c**: the forecast φ never falls (slope ≥ 0), so a
  smaller batch than the current one is taken only when it would be best even at the
  posterior's 95 % quantile of c and the highest φ read over the last stretches; with c fixed,
  never. A gradient spike moves the online φ for many steps (its EMA), not the evidence.

- **Effective-sample clock** (McCandlish et al. 2018, Eq. 2.11): a step at batch B adds
  ΔE = B·cφ/(cφ + B), φ = the online noise scale; the run's own clock E_c(t) = Σ ΔE for each
  hypothesis c.
- **Forecast**: log φ is linear in log E_c over the recent history (the last `fit_octaves`
  octaves of E): φ(E) = φ_now·(E/E_now)^β; β is the least-squares slope shrunk to the prior
  (normal, mean `prior_slope`, sd `slope_sd` = 0.3; precision-weighted with the fit's standard
  error), clipped to [0, 1.5]; stretches of the first `fit_after_steps` = 60 steps (three
  time constants of the noise-scale EMA, decay 0.95) and of the LR warm-up are not fitted, and
  no layout switch or probe is taken during the LR warm-up (§6.19: a φ read while the LR ramps
  forecast a critical batch far below the run's). The prior slope 0.8:
  Kaplan et al. 2020's B_crit ∝ L^(−1/0.21) with L − L_∞ ∝ E^(−0.24) gives
  d log B_crit / d log E ≈ 0.8–1.1 in the loss range of the presets).
- **Horizon**: the run ends at `horizon_tokens` (train.max_tokens); unknown or passed, it is
  assumed to last as long again as it has. E_end: where the forecast run, at the best batch
  B* of each point, has spent the samples left (ΔS = ΔE·(cφ + B*)/cφ).
- **Plan** (the same programme as `core.sim.oracle.switch_aware_minutes`, over the forecast
  instead of the truth; `core.control.plan_times`): on a geometric grid of E from E_now to E_end, r_L(E) = the best
  ΔE/step_s over the batches of layout L at cφ(E); backward,
  g_L(E_m) = min(h_L, C + min_L' h_L'), h_L = (E_m+1 − E_m)/r_L(E_m+½) + g_L(E_m+1),
  C = the measured switch cost. Under the posterior the expected time J_L = Σ_k p_k h_L(c_k)
  (+ C when L is not the current layout) over `c_points` quantiles of c; the layout with the
  least J_L is taken, on it the batch with the highest expected relative rate
  Σ_k p_k r(B; c_k)/r*(c_k) at φ_now.
- **Step times**: the model's, and for a measured plan the precision-weighted mean (in log) of
  the model and its measured median (`decision_model`). Given `copus profile`'s table
  (`controller.profile`), a profiled plan's measured median instead, every time in the
  profile's units (the run's own medians divided by the load factor k; `_profiled_model`),
  and a profiled layout is never probed.
- **Exploration** (`core.control.probes`): a layout never measured is probed when the value
  of measuring it exceeds its cost (two switches and the probe's slower steps).
- **Experiments priced by their value of information** (`core.control.experiments`): while no
  calibration window is open, a larger batch (at most 2× the current) is taken as a square-wave
  experiment when the value of what its window would tell about c exceeds its cost.
- **Record**: each decision point leaves one decisions.jsonl row (`"event": "considered"`):
  the plan taken, and the best layout and batch refused with what they were predicted to gain
  and what they had to clear (the switch cost; for a batch, the chosen batch's rate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from copus.core.control import experiments, start_prior
from copus.core.control.considered import considered_row
from copus.core.control.experiments import BatchExperiments
from copus.core.control.plan_times import PlanTimes
from copus.core.control.probes import LayoutProbes
from copus.core.control.step_estimates import MeasuredStepTimes
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Decision, StepRecord, decision_kind

PRIOR_SLOPE = 0.8  # d log φ / d log E before the run has measured it (docstring)
MAX_SLOPE = 1.5
# while the posterior's 90 % interval of c spans more than WIDE_RATIO-fold, the batch moves on
# the ladder B0·2^(k/WIDE_STEPS) (√2 rungs): each move is an experiment the posterior can read
WIDE_RATIO, WIDE_STEPS = 8.0, 2
SHRINK_QUANTILE = 0.95  # a shrink must be right even at this posterior quantile of c
# what waits for the end of the LR warm-up (docs/robust-goodput.md §6.19): "layout" switches and
# probes (the default; batch moves go on), "all" decisions, or "none" (before §6.19); with "layout"
# or "all" the forecast of φ also leaves the warm-up's stretches out
WARMUP_HOLD = "layout"
# with the sqrt rule's x0 rows in the posterior (`controller.LR_RULE_FACTOR`): plan over joint (x0, c)
# hypotheses, each c quantile paired with its own row's LR factor (docs/robust-goodput.md §6.35);
# False: the marginal quantiles of c times the posterior-mean factor (§6.14–§6.20)
LR_JOINT = True


class PlanningController(BatchExperiments, LayoutProbes, PlanTimes, MeasuredStepTimes):
    """observe(record) -> Decision | None by the module docstring's rule."""

    def __init__(
        self,
        *,
        horizon_tokens: float = 0.0,
        seq_len: int = 1,
        c_points: int = 5,
        grid_points: int = 32,
        prior_slope: float = PRIOR_SLOPE,
        fit_octaves: float = 3.0,
        explore: bool = True,
        probe_steps: int = 5,
        slope_sd: float = 0.3,
        fit_after_steps: int = 60,
        start: str = "plan",
        batch_steps: int = 0,
        profile: Sequence[tuple[ParallelPlan, float]] = (),
        lr_rule: str = "none",
        **kw: Any,
    ) -> None:
        if start not in ("plan", "fastest"):
            raise ValueError(f"start={start!r} is invalid; allowed: plan, fastest")
        super().__init__(**kw)
        self.lr_rule = str(lr_rule)  # the run's LR rule (train.lr_rule): "sqrt" prices its overshoot
        if c_points < 1 or grid_points < 2 or probe_steps < 1 or not 0 <= prior_slope <= MAX_SLOPE:
            raise ValueError(
                f"c_points={c_points}, grid_points={grid_points}, probe_steps="
                f"{probe_steps}, prior_slope={prior_slope} are invalid; allowed: "
                f">= 1, >= 2, >= 1, 0..{MAX_SLOPE}"
            )
        self.horizon_tokens, self.seq_len = float(horizon_tokens), max(int(seq_len), 1)
        self.c_points, self.grid_points = int(c_points), int(grid_points)
        self.prior_slope, self.fit_octaves = float(prior_slope), float(fit_octaves)
        self.explore, self.probe_steps = bool(explore), int(probe_steps)
        self.slope_sd = float(slope_sd)
        self.fit_after_steps, self.start = int(fit_after_steps), start
        self.read_from_step = self.fit_after_steps  # the posterior reads no step before
        self.batch_steps = int(batch_steps)  # ladder rungs per doubling (0: `WIDE_STEPS` while wide)
        self.chunks: list[list[float]] = []  # [batch, steps, Σφ, steps with φ, first step]
        self.step_misses: list[float] = []  # measured/predicted − 1 of each new layout
        self._shrunk: tuple | None = None
        self.window_base: float | None = None  # the batch before the open calibration window
        # `copus profile`'s measured medians (controller.profile): plan -> step seconds
        self.profile = {p: float(t) for p, t in profile if math.isfinite(t) and t > 0}
        self.readable_from = 0  # the first step past the LR warm-up
        self.hypothesis_x0: np.ndarray | None = None  # x0 of each joint hypothesis (`c_hypotheses`)
        self._init_experiments()
        self._layouts()

    # ---- the plan's inputs ---------------------------------------------------------------------

    def _layouts(self) -> None:
        """Each candidate's layout number (`_ids`) and the layouts (`_keys`)."""
        c = self.candidates
        keys = np.stack([c.dp, c.tp, c.pp], axis=1)
        uniq, ids = np.unique(keys, axis=0, return_inverse=True)
        self._ids = ids.reshape(-1)
        self._frontier: tuple | None = None
        self._keys = [tuple(int(v) for v in k) for k in uniq]

    def _candidates_changed(self) -> None:
        self._layouts()

    def c_hypotheses(self) -> tuple[np.ndarray, np.ndarray]:
        """(c values, weights): `c_points` equal-mass quantiles of the posterior, or the fixed c.
        With the sqrt rule's x0 rows and `LR_JOINT`: quantiles within each row (2·`c_points` in
        all, by the rows' mass), each paired with its row's x0 (`hypothesis_x0`, read by
        `lr_factor`; docs/robust-goodput.md §6.35)."""
        self.hypothesis_x0 = None
        if self.posterior is None or self.c_points == 1:
            return np.array([self.calibration]), np.array([1.0])
        if LR_JOINT and self.lr_rule == "sqrt" and self.posterior.lr_fractions:
            cs, w, self.hypothesis_x0 = self.posterior.row_hypotheses(self.c_points)
            return cs, w
        q = (np.arange(self.c_points) + 0.5) / self.c_points
        return (np.array([self.posterior.quantile_c(float(x)) for x in q]), np.full(self.c_points, 1.0 / self.c_points))

    def clock(self, cs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(E_c at the end of each stretch (K, n), mean φ of each stretch (n,), steps (n,))."""
        ch = np.array(self.chunks, dtype=float).reshape(-1, 5)
        b, n = ch[:, 0], ch[:, 1]
        phi = np.where(ch[:, 3] > 0, ch[:, 2] / np.maximum(ch[:, 3], 1), np.inf)
        bc = cs[:, None] * phi[None, :]
        de = n * np.where(np.isfinite(bc), b * bc / (bc + b), b)
        return np.cumsum(de, axis=1), phi, n, ch[:, 4]

    def forecast(self, cs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(E_now, φ_now, β) per hypothesis c: log φ = a + β log E_c fitted by least squares
        (weights: steps) over the stretches of the last `fit_octaves` octaves of E."""
        e, phi, n, step = self.clock(cs)
        ok = np.isfinite(phi) & (phi > 0)
        late = ok & (step > self.fit_after_steps) & ((step >= self.readable_from) | (WARMUP_HOLD == "none"))
        e_now = e[:, -1]
        beta = np.full(len(cs), self.prior_slope)
        phi_now = np.full(len(cs), phi[ok][-1] if ok.any() else np.nan)
        for k in range(len(cs)):
            use = late & (e[k] >= e_now[k] * 2.0**-self.fit_octaves)
            if use.sum() < 4:
                continue
            x, y, w = np.log(e[k, use]), np.log(phi[use]), n[use] / n[use].sum()
            xm, ym = float(w @ x), float(w @ y)
            sxx = float(w @ (x - xm) ** 2)
            if sxx <= 0:
                continue
            fit = float(w @ ((x - xm) * (y - ym))) / sxx
            resid = float(w @ (y - ym - fit * (x - xm)) ** 2)
            # the EMA'd φ of neighbouring stretches is correlated: a third of them count
            se2 = max(resid, 0.02) / (sxx * max(int(use.sum()) / 3.0 - 1.0, 1.0))
            prec = 1.0 / self.slope_sd**2
            post = (self.prior_slope * prec + fit / se2) / (prec + 1.0 / se2)
            beta[k] = float(np.clip(post, 0.0, MAX_SLOPE))
            phi_now[k] = math.exp(ym + beta[k] * (math.log(e_now[k]) - xm))
        return e_now, phi_now, beta

    def end_samples(self, samples: float) -> float:
        """Samples at the run's end: the horizon, or twice the samples so far."""
        planned = self.horizon_tokens / self.seq_len
        return planned if planned > 1.05 * samples else 2.0 * samples

    # ---- the plan ------------------------------------------------------------------------------

    def plan_now(self, samples: float, step_s: np.ndarray) -> dict | None:
        """The plan's first step: {"layout", "index", "J", "h", ...}; None before any φ."""
        cs, w = self.c_hypotheses()
        e_now, phi_now, beta = self.forecast(cs)
        if not (np.all(np.isfinite(phi_now)) and np.all(e_now > 0)):
            return None
        left = self.end_samples(samples) - samples
        e_end = np.maximum(self.end_clock(e_now, phi_now, beta, cs, step_s, left), e_now * 1.001)
        h = self.layout_times(e_now, e_end, phi_now, beta, cs, step_s)
        return self._choose(
            w @ np.where(np.isfinite(h), h, 1e30),
            cs * phi_now,
            w,
            step_s,
            extra={"c": cs.tolist(), "phi_now": phi_now.tolist(), "slope": beta.tolist(), "e_end": e_end},
            grid=self.grid_rates(e_now, e_end, phi_now, beta, cs, step_s) if self._experiments() else None,
        )

    def _choose(
        self,
        h: np.ndarray,
        bc_now: np.ndarray,
        w: np.ndarray,
        step_s: np.ndarray,
        extra: dict,
        grid: tuple | None = None,
    ) -> dict:
        """The layout with the least expected time (switch cost added off the current one)
        and, on it, the batch with the highest expected relative rate at φ_now — or a larger
        batch on its ladder whose value as an experiment exceeds its cost (`_experiment`)."""
        cur = self._key_index(self.plan)
        switch = np.full(len(h), self.reconfig_cost_s)
        if cur is not None:
            switch[cur] = 0.0
        allowed = (
            np.ones(len(h), bool)
            if (self.search_options["allow_reconfigure"] and not self._layout_held()) or cur is None
            else np.arange(len(h)) == cur
        )
        if self._reading():  # one doubling per experiment: only layouts that host such a batch
            near = np.abs(np.log2(self.candidates.global_batch_size / self.window_base)) <= 1.0 + 1e-9
            hosts = np.isin(np.arange(len(h)), self._ids[near])
            allowed = allowed & hosts if (allowed & hosts).any() else allowed
        total = np.where(allowed, h + switch, np.inf)
        lay = int(np.argmin(total))
        r = self.rates(bc_now, step_s)  # (K, N)
        score = w @ (r / np.maximum(r.max(axis=1, keepdims=True), 1e-300))
        on = self.ladder(np.flatnonzero(self._ids == lay))
        b = self.candidates.global_batch_size
        keep = on[b[on] >= self.floor_batch(bc_now / np.maximum(self.c_hypotheses()[0], 1e-300), step_s)]
        on = keep if len(keep) else on
        i = int(on[np.argmax(score[on])])
        exp = None if grid is None else self._experiment(on, i, r, bc_now, w, grid, step_s)
        return {
            "layout": lay,
            "index": i if exp is None else exp["index"],
            "experiment": exp,
            "J": total,
            "h": h,
            "score": score,
            "switch": switch,
            "allowed": allowed,
            **extra,
        }

    def floor_batch(self, phi_now: np.ndarray, step_s: np.ndarray) -> float:
        """The smallest batch the plan may take: the current one, unless the evidence about c
        says the current batch is past the best batch even at the posterior's
        `SHRINK_QUANTILE` of c and the highest noise-scale reading of the last `interval_steps`
        stretches (with c fixed: never). The forecast of φ never falls (slope ≥ 0), so a
        smaller batch is never planned for a reading of φ alone: a gradient spike, which
        moves the online φ for many steps, does not shrink the batch. After an experiment's
        window has been read, "the current one" is the batch before the experiment
        (`experiment_from`, with `experiments.RETURN_AFTER_EXPERIMENT`)."""
        cur = float(self.plan.global_batch_size)
        if self.posterior is None or not len(self.chunks) or self._in_experiment():
            return cur
        if self.experiment_from is not None and experiments.RETURN_AFTER_EXPERIMENT:
            cur = min(cur, self.experiment_from)  # an experiment's batch is no floor once read
        recent = [c[2] / c[3] for c in self.chunks[-self.interval_steps :] if c[3] > 0]
        phi = max([float(np.max(phi_now))] + recent)
        r = self.rates(np.array([self.posterior.quantile_c(SHRINK_QUANTILE) * phi]), step_s)[0]
        return min(cur, float(self.candidates.global_batch_size[int(np.argmax(r))]))

    def ladder_steps(self) -> int:
        """Rungs per doubling of the batch ladder: `batch_steps` when set, else `WIDE_STEPS`
        while the posterior over c is wide (90 % interval > `WIDE_RATIO`-fold), else 0 (any
        batch): small batch moves bend the loss curve too little for the posterior to read."""
        if self.batch_steps > 0:
            return self.batch_steps
        if self.posterior is not None and self.posterior.interval_ratio() > WIDE_RATIO:
            return WIDE_STEPS
        return 0

    def ladder(self, idx: np.ndarray) -> np.ndarray:
        """The candidates of `idx` on the batch ladder B0·2^(k/`ladder_steps()`) (per rung the
        batch nearest to it, with every plan at that batch), plus the current plan: the plan
        moves the batch by rungs, so each change is an experiment the posterior over c can
        read (docs/robust-goodput.md); while wide and a window is open, only batches within 2×
        of `window_base` (one doubling per experiment)."""
        steps = self.ladder_steps()
        if steps <= 0 or not len(idx):
            return idx
        b = self.candidates.global_batch_size[idx].astype(float)
        if self._reading():
            near = np.abs(np.log2(b / self.window_base)) <= 1.0 + 1e-9  # one doubling per experiment
            idx, b = (idx[near], b[near]) if near.any() else (idx, b)
        x = np.log2(b / self.search_options["lr_ref_batch"]) * steps
        rung = np.round(x)
        order = np.lexsort((b, np.abs(x - rung), rung))
        first = order[np.r_[True, np.diff(rung[order]) != 0]]
        cur = self.candidates.index_of(self.plan)
        keep = idx[np.isin(b, b[first])]  # every plan (micro-batch, layout) at a rung's batch
        return np.union1d(keep, [cur]) if cur is not None and cur in idx else keep

    def _reading(self) -> bool:
        """Whether batch moves are experiments capped at one doubling: the posterior over c is
        wide. The batch then stays within 2× of `window_base`: the batch before the move that
        opened the calibration window still being read, or the current batch when none is
        open (so the move that opens a window is itself at most a doubling)."""
        post = self.posterior
        return bool(self.window_base is not None and post is not None and post.interval_ratio() > WIDE_RATIO)

    def _key_index(self, plan: ParallelPlan) -> int | None:
        try:
            return self._keys.index(plan.layout)
        except ValueError:
            return None

    # ---- the loop ------------------------------------------------------------------------------

    def observe(self, record: StepRecord) -> Decision | None:
        """Account one optimizer step; at a decision point, re-plan and act on its first step."""
        self._account(record)
        if record.tokens < self.lr_warmup_tokens:
            self.readable_from = record.step + 1  # the posterior reads no step before
        if self.posterior is not None and not self.posterior.window_open:
            self.window_base = float(record.plan.global_batch_size)
            self.experiment_batch = None
        self._note_new_layout(record)
        self._add_chunk(record)
        why = self._gate(record)
        if why is not None:
            self.last_explanation = {"step": record.step, "action": "wait", "why": why}
            return None
        self._maybe_refit()
        self.last_decision_step = record.step
        if self.dither is not None:
            return self._dither_step(record)
        step_s = self.predicted_step_s()
        plan = self.plan_now(float(record.samples), step_s)
        if plan is None:
            self.last_explanation = {"step": record.step, "action": "wait", "why": "no forecast"}
            return None
        target = self.candidates.plan(plan["index"])
        probe = self._probe(record, plan) if target.layout == record.plan.layout else None
        self.events.append(self._considered(record, plan, probe))
        if probe is not None:
            return self._decide(record, probe[0], probe[1], "probe")
        if target == record.plan:
            self.last_explanation = {"step": record.step, "action": "stay", "why": self.events[-1]["why"]}
            return None
        self._note_batch_move(record, plan, target)
        return self._decide(record, target, self.events[-1]["why"], "decide")

    def _decide(self, record: StepRecord, plan: ParallelPlan, why: str, purpose: str) -> Decision:
        kind = decision_kind(record.plan, plan)
        decision = Decision(
            kind=kind,
            plan=plan,
            reason=why,
            step=record.step,
            b_noise=self.calibration * record.b_noise,
            purpose=purpose,
            calibration=self.posterior.summary() if self.posterior else None,
        )
        self.last_explanation = {"step": record.step, "action": kind, "why": why}
        self.history.append(decision.to_dict())
        return decision

    def _gate(self, record: StepRecord) -> str | None:
        """Why no decision is taken at this step (None: decide): the base gate, and with
        `WARMUP_HOLD` "all" no decision during the LR warm-up (its loss and noise scale are not
        the run's; docs/robust-goodput.md §6.19)."""
        why = super()._gate(record)
        if why is None and WARMUP_HOLD == "all" and record.tokens < self.lr_warmup_tokens:
            # a decision point whose decision is to wait: the grid of decision points stays the
            # one a run without the hold has (a shifted grid reads φ at other steps; §6.19)
            self.last_decision_step = record.step
            return f"LR warm-up: {record.tokens} < train.warmup_tokens {self.lr_warmup_tokens:.0f}"
        return why

    def _layout_held(self) -> bool:
        """Whether layout switches and probes wait: `WARMUP_HOLD` "layout" and the current decision
        point inside the LR warm-up (`observe` moves `readable_from` past every warm-up step)."""
        return WARMUP_HOLD == "layout" and self.readable_from > self.last_decision_step

    def _add_chunk(self, record: StepRecord) -> None:
        """The step into the φ history (stretches of one batch, at most `interval_steps` long)."""
        if record.skipped:
            return
        b = float(record.plan.global_batch_size)
        ok = math.isfinite(record.b_noise) and record.b_noise > 0
        last = self.chunks[-1] if self.chunks else None
        if last is None or last[0] != b or last[1] >= self.interval_steps:
            last = [b, 0.0, 0.0, 0.0, float(record.step)]
            self.chunks.append(last)
        last[1] += 1
        if ok:
            last[2] += record.b_noise
            last[3] += 1

    # ---- exploration ---------------------------------------------------------------------------

    # ---- the record ----------------------------------------------------------------------------

    def _considered(self, record: StepRecord, plan: dict, probe) -> dict:
        """decisions.jsonl row: the plan taken and the best layout and batch refused."""
        return considered_row(self, record, plan, probe)

    # ---- start and checkpointing ---------------------------------------------------------------

    def start_plan(self, micro_batch_size: int | None = None) -> ParallelPlan:
        """The first plan (`start="plan"`): the same programme under the prior, restricted to
        plans at the initial batch (and `micro_batch_size` when given). The prior's critical
        batch is Kaplan et al.'s at the first step's tokens, growing as D^0.45
        (`core.control.start_prior`), its level uncertain by two octaves (B_crit,k = prior ·
        m_k, `start_prior.level_hypotheses`); the least expected time over those hypotheses,
        switches later included, picks the layout. `start="fastest"`: the fastest plan at the
        initial batch (docs/robust-goodput.md §6.16)."""
        if self.start == "fastest":
            return super().start_plan(micro_batch_size)
        idx = self._start_indices(micro_batch_size)
        if idx is None:
            return self.plan
        level, weights = start_prior.level_hypotheses(self.c_points)
        self.hypothesis_x0 = None  # the prior's levels are not the posterior's joint hypotheses
        cs, w = np.array(level), np.array(weights)  # B_crit,k = prior · m_k: cφ with φ = prior
        b0 = float(self.plan.global_batch_size)
        step_s = self.predicted_step_s()
        prior = start_prior.prior_critical_batch(b0, self.seq_len)
        bc0 = prior * cs
        phi, beta = np.full(len(cs), prior), np.full(len(cs), start_prior.GROWTH_SLOPE)
        e_now = b0 * bc0 / (bc0 + b0)
        e_end = self.end_clock(e_now, phi, beta, cs, step_s, self.end_samples(b0) - b0)
        h = w @ self.layout_times(e_now, np.maximum(e_end, e_now * 1.001), phi, beta, cs, step_s)
        lay = min(set(self._ids[idx].tolist()), key=lambda k: h[k])
        on = idx[self._ids[idx] == lay]
        return self.candidates.plan(int(on[np.argmin(step_s[on])]))

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "chunks": [list(c) for c in self.chunks],
            "step_misses": list(self.step_misses),
            "window_base": self.window_base,
            "readable_from": self.readable_from,
            **self._experiment_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.chunks = [[float(x) for x in c] for c in state.get("chunks", [])]
        self.step_misses = [float(x) for x in state.get("step_misses", [])]
        base = state.get("window_base")
        self.window_base = None if base is None else float(base)
        self.readable_from = int(state.get("readable_from", 0))
        self._load_experiment_state(state)
