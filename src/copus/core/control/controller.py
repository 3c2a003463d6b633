"""The goodput controllers: what they share, COPUS's rule ("goodput-copus") and the factory.

`batch.policy = "goodput"` is the planning controller (`core.control.planner`): one rule,
a plan over the rest of the run. `batch.policy = "goodput-copus"` is COPUS's orchestrator as
published (arXiv 2604.26687 Alg. 2; design §5), kept to compare against: every
`interval_steps` after `warmup_steps` it ranks every candidate by goodput at c·φ
(`core.plan.search.evaluate`) and switches when the best beats the current plan by the 10 %
margin, a layout change scaled by T_useful / (T_elapsed + c_reconfig), the batch growing at most
`max_growth`× per decision and never shrinking.

Both share `ControllerBase`: every optimizer step goes to `observe(record)`; the step time
feeds an `OnlineFitter` (the first step under each plan is skipped; refits at decision points
when the model misses a measured plan by more than `refit_tolerance`); `record_switch_cost`
feeds each measured parallelism change back (c_reconfig = their mean, the prior before the
first); with `gns.calibration = "auto"` every step's loss goes to a `CalibrationPosterior`
(each batch change is a natural experiment; docs/robust-goodput.md §2) and `calibration`
follows its median. Rows for decisions.jsonl wait in `drain_events()`; every call leaves
`last_explanation` (JSON-able).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any


from copus.core.control.base import ControllerBase
from copus.core.control.planner import PlanningController
from copus.core.cost.fit import OnlineFitter, fit_model, prior_model
from copus.core.cost.memory import MemoryModel
from copus.core.cost.throughput import StepTimeModel
from copus.core.plan.goodput import StepTimePredictor, build_candidates, noise_measuring
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Decision, StepRecord
from copus.core.plan.search import evaluate
from copus.core.specs.hardware import HardwareProfile, get_hardware
from copus.core.specs.models import ModelShape
from copus.core.stats.calibration_posterior import LOSS_OFFSETS, CalibrationPosterior


class Controller(ControllerBase):
    """COPUS's rule (`goodput-copus`): the module docstring."""

    def __init__(
        self,
        *,
        margin: float = 0.10,
        max_growth: float = 2.0,
        allow_shrink: bool = False,
        max_rel_err: float = 1e9,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.search_options.update(margin=margin, max_growth=max_growth, allow_shrink=allow_shrink)
        self.max_rel_err = float(max_rel_err)
        self.margin = margin

    def observe(self, record: StepRecord) -> Decision | None:
        """Account one optimizer step; maybe return the plan to switch to at the next step."""
        self._account(record)
        why = self._gate(record)
        if why is None and not record.b_noise_rel_err <= self.max_rel_err:
            why = f"gns not ready: rel. error {record.b_noise_rel_err:.3g} > max_rel_err {self.max_rel_err:g}"
        if why is not None:
            self.last_explanation = {"step": record.step, "action": "wait", "why": why}
            return None
        self._maybe_refit()
        result = evaluate(
            self.candidates,
            self.decision_model(),
            self.calibration * record.b_noise,
            record.plan,
            reconfig_cost_s=self.reconfig_cost_s,
            elapsed_s=self.elapsed_s,
            useful_s=self.useful_s,
            step=record.step,
            step_s=self.predicted_step_s(),
            **self.search_options,
        )
        self.last_decision_step = record.step
        self.last_explanation = {**result.explanation, "b_noise_raw": record.b_noise, "calibration": self.calibration}
        decision = result.decision
        if decision is None:
            return None
        if self.posterior is not None:
            decision = replace(decision, calibration=self.posterior.summary())
        self.history.append(decision.to_dict())
        return decision


PLANNER_EXPERIMENT_RATIO = 1.3
# each calibration window's evidence counts half under the planner (a power posterior: the
# window's loss model is misspecified and its first reading ended the ladder on one noisy window;
# docs/robust-goodput.md §6.17, measured 0.3 / 0.5 / 0.7 / 1)
PLANNER_TEMPERING = 0.5
# the planner's window fit: `LOSS_OFFSETS` = with the loss curve's offset E0 = f·(the first read's
# clock), f learnt (the default since docs/robust-goodput.md §6.29, with the VoI experiments;
# §6.27: a trade alone); DEFAULT_LOSS_OFFSETS = (0.0,) = a power law from E = 0
PLANNER_LOSS_OFFSETS = LOSS_OFFSETS
# the planner's prior width over c, in octaves (the sd of log2 c): 2 (docs/robust-goodput.md
# §6.26: 3 is a trade); `bench/planner_grid.py --prior-octaves 0.05` with the median at the
# value the estimator needs is "c known" with the posterior's LR rows still priced (§6.36)
PLANNER_PRIOR_OCTAVES = 2.0
# the sqrt LR rule's overshoot in the planner's rates (docs/robust-goodput.md §6.14), off by default:
# with it on and lr_rule "sqrt", the posterior also weighs hypotheses of the base LR's fraction
# x0 = η0/ε_opt(B_ref) of its optimum (the presets' fitted truths: 0.3–0.85; half the prior mass,
# the other half on the LR re-tuned for every B) and only the overshoot (x > 1) scales the rate.
# Measured (seed 0, 40 cells): the same as without it in every cell but one (±0.1 pp): the planner
# never runs the batches where the truths' sqrt rule overshoots. The first version (2x − x² for
# every x, x0 in 0.25 … 1.0) cost 32B lr-tuned R=0.5 seed 0 −22.8 % (main +2.4 %).
# `bench/planner_grid.py --lr-rule-factor` turns it on. `LR_OVERSHOOT_ONLY = False` (with it,
# `--lr-full-factor`) prices the whole factor, the gain below the optimum too: 3 seeds, 40 cells,
# 9 cells > 1 % behind (default 10) but median capture 0.64 (0.77), 5 cells < 0.5 (2): §6.20.
# That plan mixed the rows' c; since §6.35 each hypothesis of c keeps its own row's factor
# (`planner.LR_JOINT`): better on the grid (seeds 0–2), but the long pre-training truth slower
# (seed 2: 679.9 min against 667.3, behind the tuned Megatron schedule's 678.1), so still off.
LR_RULE_FACTOR = False
LR_OVERSHOOT_ONLY = True
SQRT_LR_FRACTIONS = (0.3, 0.45, 0.6, 0.85)
SQRT_LR_PRIOR = 0.5  # the x0 rows' prior mass together (docs/robust-goodput.md §6.20; §6.33: 0.2)
# with c given (`gns.calibration_mode = "fixed"`, e.g. from `copus calibrate`) and the sqrt rule,
# the variant prices the x0 rows (the whole factor 2x − x², each c with its own row) around a c
# held FIXED_C_OCTAVES wide: given c, the rows learn x0 cheaply. Off: 3 seeds, 40 cells, c at
# 1.4 R, it lifts every sqrt-lr cell (32B −1.9 → −0.7 %, 13B +0.3 → +1.6 %) but costs every
# lr-tuned cell 0.4–1.6 points (7B −1.5 %, behind), median capture 0.91 → 0.79
# (docs/robust-goodput.md §6.36; `bench/planner_grid.py --fixed-c-rows`)
FIXED_C_LR_ROWS = False
FIXED_C_OCTAVES = 0.05


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
    policy: str = "goodput",
    step_time_model: StepTimePredictor | None = None,
    memory_capacity_bytes: float | None = None,
    hardware: HardwareProfile | str | None = None,
    micro_batch_sizes: Iterable[int] | None = None,
    margin: float = 0.10,
    lr_aware: bool = False,
    reconfig_cost_s: float = 2.0,
    allow_reconfigure: bool = True,
    profile_observations: Iterable[tuple[ParallelPlan, float]] | None = None,
    refit_interval_steps: int = 20,
    memory_model: MemoryModel | None = None,
    batch_grid: str = "multiples",
    online_fit: bool = True,
    allow_shrink: bool = False,
    cores: int | None = None,
    plan_options: dict | None = None,
    lr_warmup_tokens: float = 0.0,
    horizon_tokens: float = 0.0,
    posterior_options: dict | None = None,
    planner_options: dict | None = None,
    lr_rule: str = "none",
) -> ControllerBase:
    """`make_policy("goodput" | "goodput-copus", ...)`: the planning controller
    (`core.control.planner.PlanningController`) or COPUS's (`Controller`).

    `settings` has the `PolicySettings` fields initial, min, max, max_growth, interval_steps,
    warmup_steps, max_rel_err, calibration, calibration_mode. Step-time prior, first match wins:
    `step_time_model` (a `StepTimeModel` is refitted online; any other predictor, e.g. a
    profiled table, is used as is), then a fit to `profile_observations` ((plan, step_s) pairs
    from `copus profile`), then the analytic model of `hardware` (None: the "cpu" profile).
    Plans over `memory_capacity_bytes` per rank (memory model of `shape`) are never chosen, nor
    plans that cannot measure the noise scale where a measuring twin exists (`noise_measuring`).
    `cores`: CPU cores the ranks share (CPU prior only). `plan_options`: the run's
    `ParallelPlan.options` (activation checkpointing, ...) price every candidate.
    `lr_warmup_tokens`: the LR warm-up; the posterior over c takes no evidence before it.
    Planning controller only: `horizon_tokens` = the run's planned length (train.max_tokens;
    0: unknown, the plan assumes the run lasts as long again as it has); `planner_options`:
    keyword arguments of `PlanningController` (measured alternatives, docs/robust-goodput.md).
    `lr_rule`: the run's LR rule (train.lr_rule); with "sqrt" and `LR_RULE_FACTOR` the planning
    controller's posterior also weighs the base LR's fraction x0 of its optimum (`SQRT_LR_FRACTIONS`)
    and its rates carry the rule's overshoot factor 2x − x² (docs/robust-goodput.md §6.14).
    COPUS only: `margin`, `max_growth` (settings), `allow_shrink`, `max_rel_err` (settings).
    """
    initial_plan.validate(world_size, shape)
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    min_b, max_b = int(settings.min), int(settings.max)
    mbs = list(micro_batch_sizes) if micro_batch_sizes is not None else default_micro_batch_sizes(initial_plan, max_b)
    if memory_capacity_bytes is not None and memory_model is None:
        memory_model = MemoryModel(shape=shape, mixed_precision=(hw is None or hw.dtype_bytes == 2))
    if plan_options and memory_model is not None:
        memory_model = memory_model.with_plan_options(**plan_options)
    cands = noise_measuring(
        build_candidates(
            world_size,
            shape,
            min_batch=min_b,
            max_batch=max_b,
            micro_batch_sizes=mbs,
            batch_grid=batch_grid,
            memory_model=memory_model,
            memory_capacity_bytes=memory_capacity_bytes,
        )
    )
    if not len(cands):
        raise ValueError(
            f"no plan fits: world_size={world_size}, batch [{min_b}, {max_b}], "
            f"micro_batch_sizes={mbs}, memory_capacity_bytes={memory_capacity_bytes}"
        )
    fitter, fixed = None, None
    profile_observations = None if profile_observations is None else list(profile_observations)
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
    posterior = None
    mode = getattr(settings, "calibration_mode", "fixed")
    # c given (`copus calibrate`) under the sqrt rule, the variant `FIXED_C_LR_ROWS`: a posterior
    # FIXED_C_OCTAVES wide at that c whose x0 rows learn the base LR's fraction of its optimum
    fixed_c_rows = mode == "fixed" and policy == "goodput" and lr_rule == "sqrt" and FIXED_C_LR_ROWS
    if mode == "auto" or fixed_c_rows:
        # the planner moves the batch in small steps: only moves of >= 1.3x are experiments
        # (docs/robust-goodput.md §6)
        planner_opts = {
            "min_ratio": PLANNER_EXPERIMENT_RATIO,
            "tempering": PLANNER_TEMPERING,
            "loss_offsets": PLANNER_LOSS_OFFSETS,
            "prior_octaves": PLANNER_PRIOR_OCTAVES,
        }
        opts = planner_opts if policy == "goodput" else {}
        if policy == "goodput" and lr_rule == "sqrt" and (LR_RULE_FACTOR or fixed_c_rows):
            opts |= {
                "lr_fractions": SQRT_LR_FRACTIONS,
                "lr_ref_batch": float(settings.initial),
                "lr_overshoot_only": LR_OVERSHOOT_ONLY and not fixed_c_rows,
                "prior_lr_fractions": SQRT_LR_PRIOR,
            }
        if fixed_c_rows:
            opts["prior_octaves"] = FIXED_C_OCTAVES
        opts |= posterior_options or {}
        posterior = CalibrationPosterior(
            prior_c=float(settings.calibration), quantile=float(getattr(settings, "calibration_quantile", 0.5)), **opts
        )
    common = dict(
        candidates=cands,
        initial_plan=initial_plan,
        fitter=fitter,
        model=fixed,
        min_batch=min_b,
        max_batch=max_b,
        interval_steps=int(settings.interval_steps),
        warmup_steps=int(settings.warmup_steps),
        calibration=float(settings.calibration),
        lr_aware=lr_aware,
        lr_ref_batch=float(settings.initial),
        reconfig_cost_s=reconfig_cost_s,
        allow_reconfigure=allow_reconfigure,
        refit_interval_steps=refit_interval_steps,
        posterior=posterior,
        lr_warmup_tokens=lr_warmup_tokens,
    )
    if policy == "goodput-copus":
        return Controller(
            margin=margin,
            max_growth=float(settings.max_growth),
            allow_shrink=allow_shrink,
            max_rel_err=float(settings.max_rel_err),
            **common,
        )
    return PlanningController(
        horizon_tokens=horizon_tokens,
        seq_len=shape.seq_len,
        profile=profile_observations if step_time_model is None and profile_observations else (),
        lr_rule=lr_rule,
        **(planner_options or {}),
        **common,
    )
