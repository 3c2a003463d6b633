"""Batch-size policies: one `StepRecord` in per optimizer step, maybe a `Decision` out.

Every policy here changes only the global batch: same (dp, tp, pp) and micro_batch_size, a new
num_microbatches (Decision kind "batch"). Shared rules (design.md §5, COPUS §3.4, Lau et al.):

- no decision before `warmup_steps`; then a check every `interval_steps` steps;
- GNS-based policies act on the lower confidence bound φ·exp(−z·rel_err) of b_noise
  (`core.gns.lower_bound`, z = `confidence`; issue 14): a noisy estimate makes them cautious
  instead of freezing them. With `confidence` = 0 they use the point estimate and wait until
  `record.b_noise_rel_err ≤ max_rel_err` (the check is retried on the next step) — the old rule,
  which kept gns-start at B = 8 for a whole run once rel_err stayed above the limit;
- GNS-based policies hold for `recovery_steps` steps after the batch changed (COPUS App. E:
  Adam's second moment lags the new LR and the loss bumps; Merrill et al. 2025 Assumption 3:
  a local recovery within Δ), so the transient does not feed the next decision;
- the batch only grows, at most `max_growth`× per decision, within [min, max], rounded up to a
  multiple of dp·micro_batch_size and to num_microbatches ≥ pp;
- statistical tests use the *ratio of window means*: each test's numerator and denominator
  terms (`core.batch_tests.*_terms`) are averaged over the steps since the previous check, then
  divided. Lau et al. test every step on J ≈ 4 gradients, where one noisy step can jump the batch
  to its cap; averaging k steps cuts the variance ≈ k× and avoids the bias of a mean of ratios.
  The window restarts when the plan changes and ignores skipped or non-finite steps.

`make_policy("goodput", ...)` returns COPUS's controller (`copus.core.control.controller`), which also
chooses the layout and micro-batch.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, fields
from typing import Any, Protocol

from copus.core.stats import batch_tests as bt
from copus.core.stats.gns import lower_bound
from copus.core.specs.models import ModelShape
from copus.core.plan.plan import ParallelPlan, default_micro_batch_size
from copus.core.plan.records import Decision, StepRecord
from copus.core.control.schedules import (
    STEP_SCHEDULE_UNITS,
    BatchSchedule,
    StepSchedule,
    parse_step_schedule,
    round_down,
)

POLICY_NAMES = (
    "constant",
    "ramp",
    "norm-test",
    "norm-test-lau",
    "inner-product-test",
    "gns",
    "goodput",
    "goodput-copus",
    "doubling",
    "schedule",
)
GOODPUT_POLICIES = ("goodput", "goodput-copus")  # the controller; see core.policy_presets


class Policy(Protocol):
    def observe(self, record: StepRecord) -> Decision | None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicySettings:
    """The `[batch]` keys of the configuration (docs/internals.md) plus two from `[gns]`."""

    initial: int = 8
    min: int = 8
    max: int = 256
    max_growth: float = 2.0
    interval_steps: int = 10
    warmup_steps: int = 10
    ramp_kind: str = "linear"
    ramp_to: int = 64
    ramp_samples: int = 20000
    ramp_steps: int = 4
    norm_test_eta: float = 0.5
    norm_test_form: str = "per-sample"  # per-sample | micro-batch | paper (core.stats.batch_tests)
    ip_theta: float = 0.5  # AdAdaGrad's θ (Lau, Liu, Kolar 2024, README example)
    orth_nu: float = 5.84  # Bollapragada et al. 2018's ν (≈ tan 80°, as cockpit cites)
    gns_c: float = 2.0
    max_rel_err: float = 0.5  # [gns]; only with confidence = 0
    calibration: float = 1.0  # [gns]; the goodput controller's c (GnsPolicy uses gns_c)
    # "auto": c learnt in the run (core.stats.calibration_posterior), `calibration` its prior
    # median; "fixed": `calibration` as is (a number, or "probe"'s measured value)
    calibration_mode: str = "fixed"
    calibration_quantile: float = 0.5  # "auto": the posterior quantile of c decisions use
    confidence: float = 1.645  # [gns]; z of the lower bound (one-sided 95 %); 0: point est.
    recovery_steps: int = 20  # [gns]; hold after a batch change
    # batch.policy = "schedule": "0:768,250B:1536,..." (thresholds in tokens, K/M/B/T
    # suffixes; batches in `schedule_unit`); "" = the initial batch throughout
    schedule: str = ""
    schedule_unit: str = "samples"

    def __post_init__(self) -> None:
        for name, lo in (
            ("initial", 1),
            ("min", 1),
            ("max", 1),
            ("interval_steps", 1),
            ("warmup_steps", 0),
            ("ramp_to", 1),
            ("ramp_samples", 1),
            ("ramp_steps", 1),
            ("recovery_steps", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"batch.{name}={value!r} is invalid; allowed: an integer >= {lo}")
        if self.max < self.min:
            raise ValueError(f"batch.max={self.max} is invalid; allowed: >= batch.min={self.min}")
        if not self.max_growth >= 1.0:  # inf: no growth cap (Lau et al.)
            raise ValueError(f"batch.max_growth={self.max_growth!r} is invalid; allowed: >= 1 (inf: no cap)")
        for name in ("norm_test_eta", "ip_theta", "orth_nu", "gns_c", "max_rel_err", "calibration"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value!r} is invalid; allowed: a finite number > 0")
        if not (isinstance(self.confidence, int | float) and self.confidence >= 0 and math.isfinite(self.confidence)):
            raise ValueError(f"confidence={self.confidence!r} is invalid; allowed: a finite number >= 0")
        if not 0.0 < self.calibration_quantile < 1.0:
            raise ValueError(f"calibration_quantile={self.calibration_quantile!r} is invalid; allowed: 0 < q < 1")
        if self.calibration_mode not in CALIBRATION_MODES:
            raise ValueError(
                f"calibration_mode={self.calibration_mode!r} is invalid; allowed: {', '.join(CALIBRATION_MODES)}"
            )
        if self.ramp_kind not in ("linear", "stepwise"):
            raise ValueError(f"batch.ramp_kind={self.ramp_kind!r} is invalid; allowed: linear, stepwise")
        if self.schedule_unit not in STEP_SCHEDULE_UNITS:
            raise ValueError(
                f"batch.schedule_unit={self.schedule_unit!r} is invalid; allowed: {', '.join(STEP_SCHEDULE_UNITS)}"
            )
        if self.schedule and self.schedule_unit == "samples":
            parse_step_schedule(self.schedule)  # one-line error naming the bad entry
        if self.norm_test_form not in bt.NORM_TEST_FORMS:
            raise ValueError(
                f"batch.norm_test_form={self.norm_test_form!r} is invalid; allowed: {', '.join(bt.NORM_TEST_FORMS)}"
            )

    @classmethod
    def from_config(cls, config: Any) -> PolicySettings:
        """From a `copus.config.Config` (or anything with `.batch` and `.gns` sections)."""
        kw = {f.name: getattr(config.batch, f.name) for f in fields(cls) if hasattr(config.batch, f.name)}
        for name in ("max_rel_err", "calibration", "confidence", "recovery_steps"):
            kw[name] = getattr(config.gns, name)
        if kw["calibration"] == "probe":  # measured by runtime/train/probe.py; this prior until then
            kw["calibration"] = AUTO_CALIBRATION_PRIOR
        elif kw["calibration"] == "auto":  # learnt in the run: the posterior's prior median
            kw["calibration"], kw["calibration_mode"] = POSTERIOR_PRIOR_C, "auto"
        return cls(**kw)


AUTO_CALIBRATION_PRIOR = 1.0  # gns.calibration="probe" before the first probe (runtime/train/probe.py)
POSTERIOR_PRIOR_C = 4.0  # gns.calibration="auto": prior median of c (docs/robust-goodput.md)
CALIBRATION_MODES = ("fixed", "auto")


class _Window:
    """Sums of test terms over the steps since the last check, for one plan."""

    def __init__(self) -> None:
        self.plan: ParallelPlan | None = None
        self.count = 0
        self.sums: dict[str, float] = {}
        self.last: tuple[int, float] = (0, 0.0)  # (num_small, small_batch) of the latest step

    def add(self, plan: ParallelPlan, terms: dict[str, float], small: tuple[int, float]) -> None:
        if plan != self.plan:
            self.reset()
            self.plan = plan
        for key, value in terms.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.count += 1
        self.last = small

    def mean(self, key: str) -> float:
        return self.sums[key] / self.count

    def reset(self) -> None:
        self.count, self.sums = 0, {}

    def state(self) -> dict:
        plan = (
            None
            if self.plan is None
            else {f: getattr(self.plan, f) for f in ("dp", "tp", "pp", "micro_batch_size", "num_microbatches")}
        )
        return {"plan": plan, "count": self.count, "sums": dict(self.sums), "last": list(self.last)}

    def load(self, state: dict) -> None:
        self.plan = None if state["plan"] is None else ParallelPlan(**state["plan"])
        self.count = int(state["count"])
        self.sums = {k: float(v) for k, v in state["sums"].items()}
        self.last = (int(state["last"][0]), float(state["last"][1]))


class _BatchPolicy:
    """Shared warm-up/interval/rounding logic; subclasses give a target batch and a reason."""

    name = ""
    gns_based = False

    def __init__(self, settings: PolicySettings, initial_plan: ParallelPlan) -> None:
        self.settings = settings
        self.initial_plan = initial_plan
        self.num_decisions = 0
        self._last_check_step = 0
        self._window = _Window()
        self._batch: int | None = None  # global batch of the previous record
        self._batch_change_step = -(1 << 62)  # step at which it last changed

    # --- per-step -------------------------------------------------------------------------
    def observe(self, record: StepRecord) -> Decision | None:
        s = self.settings
        if record.skipped:
            return None
        if self._batch is not None and record.plan.global_batch_size != self._batch:
            self._batch_change_step = record.step
        self._batch = record.plan.global_batch_size
        terms = self._terms(record)
        if terms is not None and record.step > s.warmup_steps - s.interval_steps:
            self._window.add(record.plan, terms, (record.num_small, record.small_batch))
        if record.step < s.warmup_steps or record.step - self._last_check_step < s.interval_steps:
            return None
        if self.gns_based and (
            record.step - self._batch_change_step < s.recovery_steps
            or (s.confidence == 0 and not record.b_noise_rel_err <= s.max_rel_err)
        ):
            return None
        self._last_check_step = record.step
        target = self._target(record)
        self._window.reset()
        if target is None:
            return None
        return self._decide(record, *target)

    def _terms(self, record: StepRecord) -> dict[str, float] | None:
        """Per-step terms to average (statistical tests only)."""
        return None

    def _target(self, record: StepRecord) -> tuple[float, str] | None:
        raise NotImplementedError

    # --- rounding and limits --------------------------------------------------------------
    def _decide(self, record: StepRecord, target: float, why: str) -> Decision | None:
        s, plan = self.settings, record.plan
        cur, m = plan.global_batch_size, plan.dp * plan.micro_batch_size
        lo = max(bt.round_up(s.min, m), m * plan.pp)  # num_microbatches >= pp
        hi = s.max // m * m
        growth_cap = math.inf if math.isinf(s.max_growth) else math.floor(s.max_growth * cur / m + 1e-9) * m
        notes = [f"target {target:.1f} rounded up to a multiple of dp*micro_batch_size={m}"]
        if target > growth_cap:
            new = growth_cap
            notes.append(f"growth capped at {s.max_growth:g}x")
        elif target >= hi:  # also an infinite target
            new = hi
            notes.append(f"capped at max={s.max}")
        else:
            new = bt.round_up(target, m)
        if new < lo:
            new = lo
            notes.append(f"raised to min={s.min} and num_microbatches >= pp={plan.pp}")
        if new > hi:
            new = hi
            notes.append(f"capped at max={s.max}")
        if new <= cur:
            return None
        self.num_decisions += 1
        reason = f"{why}: B {cur} -> {new} ({'; '.join(notes)})"
        return Decision(
            kind="batch", plan=plan.with_batch(new), reason=reason, step=record.step, b_noise=record.b_noise
        )

    # --- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "name": self.name,
            "num_decisions": self.num_decisions,
            "last_check_step": self._last_check_step,
            "window": self._window.state(),
            "batch": self._batch,
            "batch_change_step": self._batch_change_step,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"policy state for {state.get('name')!r} is invalid for policy {self.name!r}")
        self.num_decisions = int(state["num_decisions"])
        self._last_check_step = int(state["last_check_step"])
        self._window.load(state["window"])
        self._batch = state.get("batch")
        self._batch_change_step = int(state.get("batch_change_step", -(1 << 62)))


class ConstantPolicy(_BatchPolicy):
    """Never changes the plan (statistics are still logged by the trainer)."""

    name = "constant"

    def observe(self, record: StepRecord) -> Decision | None:
        return None


class RampPolicy(_BatchPolicy):
    """Megatron-style batch ramp from `initial` to `ramp_to` over `ramp_samples` samples
    (linear, or `ramp_steps` equal increments), checked every `interval_steps`."""

    name = "ramp"

    def __init__(self, settings: PolicySettings, initial_plan: ParallelPlan) -> None:
        super().__init__(settings, initial_plan)
        if settings.ramp_to < settings.initial:
            raise ValueError(
                f"batch.ramp_to={settings.ramp_to} is invalid; allowed: >= batch.initial={settings.initial}"
            )
        self.schedule = BatchSchedule(
            kind=settings.ramp_kind,
            start=settings.initial,
            end=max(settings.initial, min(settings.ramp_to, settings.max)),
            duration=settings.ramp_samples,
            num_steps=settings.ramp_steps,
            unit="samples",
        )

    def _target(self, record: StepRecord) -> tuple[float, str] | None:
        m = record.plan.dp * record.plan.micro_batch_size
        target = round_down(self.schedule.unrounded(record.samples), m)
        why = (
            f"{self.settings.ramp_kind} ramp {self.schedule.start}->{self.schedule.end} over "
            f"{self.schedule.duration:g} samples at {record.samples} samples: target {target}"
        )
        return float(target), why


def check_small_gradients(name: str, settings: PolicySettings, plan: ParallelPlan) -> None:
    """One-line error at start when a statistical test cannot be computed on `plan`: every test
    needs J ≥ 2 small gradients per step, and the norm test's "paper" form needs per-worker
    gradients, i.e. dp ≥ 2 (Lau et al. eq. 5 over J workers)."""
    if settings.norm_test_form == "paper" and name.startswith("norm-test") and plan.dp < 2:
        raise ValueError(
            f"batch.norm_test_form='paper' is invalid at dp={plan.dp}; allowed: "
            "dp >= 2 (eq. 5 is over per-worker gradients), or 'micro-batch' (the "
            "same formula over micro-batches) or 'per-sample'"
        )
    if plan.dp * plan.num_microbatches < 2:
        raise ValueError(
            f"batch.policy={name!r} is invalid with dp*num_microbatches=1 at the "
            f"initial batch {plan.global_batch_size}; allowed: an initial batch of "
            f">= 2 micro-batches (>= {2 * plan.micro_batch_size}) or dp >= 2"
        )


class NormTestPolicy(_BatchPolicy):
    """The norm test (Byrd et al. 2012) as Lau et al. 2025 use it: `norm_test_form`
    "per-sample", "micro-batch" or "paper" (eq. 5 over per-worker gradients; η means something
    different in each: `core.stats.batch_tests`), tolerance η = `norm_test_eta`."""

    name = "norm-test"

    def __init__(self, settings: PolicySettings, initial_plan: ParallelPlan) -> None:
        super().__init__(settings, initial_plan)
        check_small_gradients(self.name, settings, initial_plan)

    def _terms(self, record: StepRecord) -> dict[str, float] | None:
        if not _usable(record):
            return None
        _check_form_inputs(self.settings.norm_test_form, record)
        var, sq = bt.norm_test_terms(
            record.small_sqnorm,
            record.big_sqnorm,
            record.num_small,
            record.small_batch,
            form=self.settings.norm_test_form,
        )
        return {"var": var, "sq": sq}

    def _target(self, record: StepRecord) -> tuple[float, str] | None:
        w, s = self._window, self.settings
        if w.count == 0:
            return None
        t = bt.statistic_from_terms(w.mean("var"), w.mean("sq"), s.norm_test_eta)
        cur = record.plan.global_batch_size
        if t <= cur:
            return None
        why = (
            f"norm test ({s.norm_test_form}, eta={s.norm_test_eta:g}): T={t:.1f} > B={cur} "
            f"over {w.count} steps (J={w.last[0]}, b={w.last[1]:g})"
        )
        return t, why


class InnerProductTestPolicy(_BatchPolicy):
    """Augmented inner-product test: inner-product (θ) and orthogonality (ν); larger wins.
    Needs `record.ip_sq_mean` (opt-in in the runtime); steps without it are ignored."""

    name = "inner-product-test"

    def __init__(self, settings: PolicySettings, initial_plan: ParallelPlan) -> None:
        super().__init__(settings, initial_plan)
        check_small_gradients(self.name, settings, initial_plan)

    def _terms(self, record: StepRecord) -> dict[str, float] | None:
        if not _usable(record) or record.ip_sq_mean is None or not math.isfinite(record.ip_sq_mean):
            return None
        args = (record.small_sqnorm, record.big_sqnorm, record.num_small, record.small_batch, record.ip_sq_mean)
        ip_var, ip_den = bt.inner_product_terms(*args)
        orth_var, orth_den = bt.orthogonality_terms(*args)
        return {"ip_var": ip_var, "ip_den": ip_den, "orth_var": orth_var, "orth_den": orth_den}

    def _target(self, record: StepRecord) -> tuple[float, str] | None:
        w, s = self._window, self.settings
        if w.count == 0:
            return None
        t_ip = bt.statistic_from_terms(w.mean("ip_var"), w.mean("ip_den"), s.ip_theta)
        t_orth = bt.statistic_from_terms(w.mean("orth_var"), w.mean("orth_den"), s.orth_nu)
        t, cur = max(t_ip, t_orth), record.plan.global_batch_size
        if t <= cur:
            return None
        why = (
            f"augmented inner-product test: T_ip={t_ip:.1f} (theta={s.ip_theta:g}), "
            f"T_orth={t_orth:.1f} (nu={s.orth_nu:g}) > B={cur} over {w.count} steps "
            f"(J={w.last[0]}, b={w.last[1]:g})"
        )
        return t, why


class GnsPolicy(_BatchPolicy):
    """COPUS's CBS baseline: global batch ≈ gns_c · b_noise on a fixed layout.

    Uses the smoothed `record.b_noise` (raw estimate; `gns_c` plays COPUS's c = 2 here, and
    `calibration` is left to the goodput controller, so the two are not multiplied), at its
    lower confidence bound when `confidence` > 0.
    """

    name = "gns"
    gns_based = True

    def _target(self, record: StepRecord) -> tuple[float, str] | None:
        s = self.settings
        b = lower_bound(record.b_noise, record.b_noise_rel_err, s.confidence)
        if math.isnan(b):
            return None
        target = s.gns_c * b
        bound = f" -> lower bound (z={s.confidence:g}) {b:.1f}" if s.confidence > 0 else ""
        why = (
            f"gns: b_noise={record.b_noise:.1f} (rel. err {record.b_noise_rel_err:.2f})"
            f"{bound} x gns_c={s.gns_c:g} = {target:.1f}"
        )
        return target, why


class DoublingPolicy(_BatchPolicy):
    """Merrill et al. 2025's batch-size warm-up (§4, "Critical Batch Size Revisited"): when the
    measured critical batch passes twice the batch, double the batch (the LR × √2 rides on
    the trainer's sqrt(B) LR rule). The critical batch is read as gns_c · b_noise, at its lower
    confidence bound when `confidence` > 0 (Merrill measure it by branching; copus measures the
    noise scale, and `gns_c` converts, as COPUS's CBS baseline does)."""

    name = "doubling"
    gns_based = True

    def _target(self, record: StepRecord) -> tuple[float, str] | None:
        s = self.settings
        b = lower_bound(record.b_noise, record.b_noise_rel_err, s.confidence)
        cur = record.plan.global_batch_size
        if math.isnan(b) or not s.gns_c * b > 2 * cur:
            return None
        return 2.0 * cur, (
            f"doubling: critical batch gns_c={s.gns_c:g} x b_noise={b:.1f} = {s.gns_c * b:.1f} > 2 x B={cur}"
        )


class SchedulePolicy(_BatchPolicy):
    """A token-denominated step schedule (`batch.schedule`, `core.control.schedules
    .StepSchedule`): the batch is the schedule's value at the tokens consumed, checked every
    step (a pure function of tokens: a resumed run lands on the same batch)."""

    name = "schedule"

    def __init__(self, settings: PolicySettings, initial_plan: ParallelPlan, seq_len: int | None = None) -> None:
        super().__init__(settings, initial_plan)
        text = settings.schedule or f"0:{initial_plan.global_batch_size}"
        unit = settings.schedule_unit if settings.schedule else "samples"
        self.schedule: StepSchedule = parse_step_schedule(text, unit=unit, seq_len=seq_len)

    def check_layouts(self, layout_for=None, micro_batch_size: int = 0) -> None:
        """Every entry's batch must split over the plan it will run on: a multiple of dp ×
        `micro_batch_size` (parallel.micro_batch_size; 0 = chosen per batch, then of dp) with at
        least pp micro-batches, dp from `layout_for(batch)` (a layout map) or the initial plan.
        One-line ValueError naming the entry and what is allowed."""
        p = self.initial_plan
        for entry, (_, batch) in zip(self.schedule.describe().split(","), self.schedule.entries):
            layout = (layout_for(batch) if layout_for is not None else None) or p.layout
            dp, _, pp = layout
            m = dp * (micro_batch_size or 1)
            if batch % m or batch // m < pp:
                what = f"dp*micro_batch_size={dp}*{micro_batch_size}" if micro_batch_size else f"dp={dp}"
                raise ValueError(
                    f"batch.schedule entry '{entry}' is invalid on layout "
                    f"dp{dp}.tp{layout[1]}.pp{pp}: {batch} is not a multiple of {what} "
                    f"with >= {pp} micro-batches; allowed: multiples of {m} (>= {m * pp})"
                )

    def observe(self, record: StepRecord) -> Decision | None:
        if record.skipped:
            return None
        target = self.schedule(record.tokens)
        plan = record.plan
        if target <= plan.global_batch_size:
            return None
        if target % plan.dp:
            raise ValueError(
                f"batch.schedule batch {target} is invalid on {plan.describe()}: not a "
                f"multiple of dp={plan.dp}; allowed: multiples of {plan.dp}"
            )
        per_dp = target // plan.dp
        mbs = plan.micro_batch_size
        if per_dp % mbs or per_dp // mbs < plan.pp:
            mbs = default_micro_batch_size(per_dp, plan.pp, cap=mbs)
        self.num_decisions += 1
        reason = (
            f"schedule {self.schedule.describe()} at {record.tokens} tokens: B {plan.global_batch_size} -> {target}"
        )
        return Decision(
            kind="batch", plan=plan.with_batch(target, mbs), reason=reason, step=record.step, b_noise=record.b_noise
        )


_CLASSES: dict[str, type[_BatchPolicy]] = {
    "constant": ConstantPolicy,
    "ramp": RampPolicy,
    "norm-test": NormTestPolicy,
    "norm-test-lau": NormTestPolicy,  # its settings: core.control.policy_presets
    "inner-product-test": InnerProductTestPolicy,
    "gns": GnsPolicy,
    "doubling": DoublingPolicy,
}


def make_policy(
    name: str,
    settings: PolicySettings,
    initial_plan: ParallelPlan,
    world_size: int | None = None,
    shape: ModelShape | None = None,
    **kw: Any,
) -> Policy:
    """The policy called `name` (POLICY_NAMES). "goodput" is `copus.core.control.controller
    .make_controller(settings, initial_plan, world_size, shape, **kw)`; the other policies
    change only the batch and ignore `world_size`, `shape` and `kw`."""
    if name not in POLICY_NAMES:
        raise ValueError(f"batch.policy={name!r} is invalid; allowed: {', '.join(POLICY_NAMES)}")
    if name in GOODPUT_POLICIES:
        controller = importlib.import_module("copus.core.control.controller")
        return controller.make_controller(settings, initial_plan, world_size, shape, policy=name, **kw)
    if name == "schedule":
        return SchedulePolicy(settings, initial_plan, None if shape is None else shape.seq_len)
    return _CLASSES[name](settings, initial_plan)


def _usable(record: StepRecord) -> bool:
    values = (record.small_sqnorm, record.big_sqnorm, record.small_batch)
    return record.num_small >= 2 and all(math.isfinite(v) for v in values) and record.small_batch > 0


def _check_form_inputs(form: str, record: StepRecord) -> None:
    """The "paper" form is defined over per-worker small gradients (J = dp), "micro-batch" over
    micro-batch ones (J = dp·num_microbatches); a runtime feeding the other kind is a setup
    error (`copus.config` resolves `gns.small` from the form), never a silent reinterpretation."""
    p = record.plan
    want = {"paper": p.dp, "micro-batch": p.dp * p.num_microbatches}.get(form)
    if want is not None and record.num_small != want:
        raise ValueError(
            f"batch.norm_test_form={form!r} needs J={want} "
            f"{'per-worker' if form == 'paper' else 'micro-batch'} gradients, got "
            f"J={record.num_small}; allowed: gns.small="
            f"{bt.FORM_SMALL_GRADIENTS[form]!r} with this form"
        )
