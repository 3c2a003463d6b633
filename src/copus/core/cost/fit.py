"""Fitting the step-time model to measured steps (design §4), once or online.

Bounded least squares on log step time (Pollux fits its throughput model the same way, on RMSLE,
with bounds; Qiao et al. OSDI'21 §4.1, adaptdl `fit_perf_params`):

    minimise  Σ_i ρ( log ŝ_i(θ) − log s_i )²  +  λ · Σ_j ( log θ_j − log θ⁰_j )²

over log θ (every coefficient > 0) and γ ∈ [1, 10]; ρ = soft-L1 (robust to a stray slow step).
θ⁰ is the prior (the analytic model from a `HardwareProfile`, or the "cpu" profile when none is
given) rescaled so its median prediction matches the data; the weak ridge λ keeps coefficients the
data cannot identify at their prior instead of letting them drift. Coefficients of terms absent
from every observed plan (no tp > 1 seen: the tp terms, etc.) are pinned, as adaptdl does, and
so are those the model's equation does not use (`base.unused_params`, e.g. γ of the CPU model).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np
from scipy.optimize import least_squares

from copus.core.specs.hardware import HardwareProfile, get_hardware
from copus.core.specs.models import ModelShape
from copus.core.plan.plan import ParallelPlan
from copus.core.cost.throughput import StepTimeModel, StepTimeParams, plan_columns

GAMMA_BOUNDS = (1.0, 10.0)
LOG_RANGE = math.log(1e6)  # coefficients may move at most 10⁶× from the prior


def _clean(observations: Iterable[tuple[ParallelPlan, float]]) -> list[tuple[ParallelPlan, float]]:
    out = [(p, float(s)) for p, s in observations if np.isfinite(s) and s > 0]
    if not out:
        raise ValueError(
            "observations contain no finite step time > 0; allowed: (ParallelPlan, step_s) pairs with step_s > 0"
        )
    return out


def pinned_names(plans: Sequence[ParallelPlan]) -> set[str]:
    """Coefficients that no observed plan exercises (so the data cannot move them)."""
    pinned: set[str] = set()
    if all(p.tp == 1 for p in plans):
        pinned |= {"tp_latency_s", "tp_s_per_byte"}
    if all(p.dp == 1 for p in plans):
        pinned |= {"dp_latency_s", "dp_s_per_byte", "gamma"}
    if all(p.pp == 1 for p in plans):
        pinned |= {"pp_latency_s", "pp_s_per_byte"}
    if len({p.micro_batch_size for p in plans}) == 1:
        pinned |= {"layer_overhead_s"}
    return pinned


def fit_model(
    observations: Iterable[tuple[ParallelPlan, float]],
    base: StepTimeModel,
    *,
    prior_weight: float = 1e-3,
    fixed: Iterable[str] = (),
    start: StepTimeParams | None = None,
) -> StepTimeModel:
    """`base` with coefficients fitted to `observations`; base.params is the prior θ⁰.

    `start` (e.g. the previous fit) is the initial point of a single local search; without it
    the search starts from the rescaled prior at three values of γ and keeps the best.
    """
    obs = _clean(observations)
    plans = [p for p, _ in obs]
    cols = plan_columns(plans)
    log_obs = np.log([s for _, s in obs])
    names = StepTimeParams.names()
    unknown = set(fixed) - set(names)
    if unknown:
        raise ValueError(f"fixed={sorted(unknown)} are invalid; allowed: {names}")
    # rescale the prior so that its median prediction matches the data
    k = float(np.exp(np.median(log_obs - np.log(base.predict(*cols)))))
    prior = base.params.scaled_time(k)
    unused = set(getattr(base, "unused_params", ()))  # terms the model's equation has not
    free = [n for n in names if n not in pinned_names(plans) | set(fixed) | unused]
    if not free:
        return base.with_params(prior)
    x0 = np.array([_to_x(n, getattr(prior, n)) for n in free])
    lo = np.array([GAMMA_BOUNDS[0] if n == "gamma" else x - LOG_RANGE for n, x in zip(free, x0)])
    hi = np.array([GAMMA_BOUNDS[1] if n == "gamma" else x + LOG_RANGE for n, x in zip(free, x0)])
    ridge = math.sqrt(prior_weight)

    def params_of(x: np.ndarray) -> StepTimeParams:
        return replace(prior, **{n: _from_x(n, v) for n, v in zip(free, x)})

    def residuals(x: np.ndarray) -> np.ndarray:
        pred = base.with_params(params_of(x)).predict(*cols)
        return np.concatenate([np.log(np.maximum(pred, 1e-30)) - log_obs, ridge * (x - x0)])

    if start is not None:
        starts = [np.array([_to_x(n, getattr(start, n)) for n in free])]
    else:
        starts = []
        for g in sorted({prior.gamma, 1.05, 3.0}) if "gamma" in free else [prior.gamma]:
            starts.append(x0.copy())
            if "gamma" in free:
                starts[-1][free.index("gamma")] = g
    best = None
    for x in starts:
        res = least_squares(residuals, np.clip(x, lo, hi), bounds=(lo, hi), loss="soft_l1", f_scale=0.1, max_nfev=200)
        if best is None or res.cost < best.cost:
            best = res
    return base.with_params(params_of(best.x))


def _to_x(name: str, value: float) -> float:
    return value if name == "gamma" else math.log(max(value, 1e-30))


def _from_x(name: str, x: float) -> float:
    return float(x) if name == "gamma" else math.exp(x)


def fit_step_time(
    observations: Iterable[tuple[ParallelPlan, float]],
    shape: ModelShape,
    hardware: HardwareProfile | str | None = None,
    world_size: int | None = None,
    **options,
) -> StepTimeParams:
    """Fitted `StepTimeParams` from (plan, step_s) pairs; `options` go to `StepTimeModel`."""
    return fit_model(observations, prior_model(shape, hardware, world_size, **options)).params


def prior_model(
    shape: ModelShape,
    hardware: HardwareProfile | str | None,
    world_size: int | None = None,
    *,
    cores: int | None = None,
    **options,
) -> StepTimeModel:
    """The analytic model of `hardware`; with None, the "cpu" coefficients on a one-tier topology,
    and, when `world_size` ranks share fewer `cores`, `GlooCpuStepTimeModel` (core.cpu_model:
    counted gloo collectives priced per call, shared-core bound)."""
    if hardware is None:
        cpu = get_hardware("cpu")
        params = StepTimeParams.analytic(cpu)
        options.setdefault("dtype_bytes", cpu.dtype_bytes)
        if cores is not None and world_size is not None and world_size > cores:
            from copus.core.cost.cpu_model import GlooCpuStepTimeModel

            return GlooCpuStepTimeModel(params, shape, None, cores=cores, world_size=world_size, **options)
        return StepTimeModel(params, shape, None, world_size=world_size, **options)
    return StepTimeModel.analytic(shape, hardware, world_size, **options)


class OnlineFitter:
    """Accumulates measured steps per plan (median of the last `max_per_plan`) and refits.

    `observe(plan, step_s)` drops non-finite or non-positive times and refits every `refit_every`
    accepted observations; `model` is the analytic prior until the first fit. state_dict() is
    JSON-able (plans as 5-int lists, params as a dict).
    """

    def __init__(
        self,
        shape: ModelShape,
        hardware: HardwareProfile | str | None = None,
        world_size: int | None = None,
        *,
        refit_every: int = 20,
        max_per_plan: int = 32,
        prior_weight: float = 1e-3,
        **options,
    ) -> None:
        if refit_every < 1 or max_per_plan < 1:
            raise ValueError(
                f"refit_every={refit_every}, max_per_plan={max_per_plan} are invalid; allowed: integers >= 1"
            )
        self.prior = prior_model(shape, hardware, world_size, **options)
        self.model = self.prior
        self.refit_every = refit_every
        self.max_per_plan = max_per_plan
        self.prior_weight = prior_weight
        self.times: dict[ParallelPlan, list[float]] = {}
        self.since_fit = 0
        self.num_fits = 0

    @property
    def params(self) -> StepTimeParams:
        return self.model.params

    def observe(self, plan: ParallelPlan, step_s: float) -> bool:
        """Record one step; True when this call refitted the model."""
        if not (np.isfinite(step_s) and step_s > 0):
            return False
        times = self.times.setdefault(plan, [])
        times.append(float(step_s))
        del times[: -self.max_per_plan]
        self.since_fit += 1
        if self.since_fit >= self.refit_every:
            self.refit()
            return True
        return False

    def observations(self) -> list[tuple[ParallelPlan, float]]:
        """(plan, median step_s) of every plan seen."""
        return [(p, float(np.median(t))) for p, t in self.times.items() if t]

    def profiled(self) -> ProfiledStepTime:
        """Measured medians where available, the current fitted model elsewhere."""
        return ProfiledStepTime(self.model, self.observations())

    def refit(self) -> StepTimeModel:
        obs = self.observations()
        if obs:
            start = self.model.params if self.num_fits else None
            self.model = fit_model(obs, self.prior, prior_weight=self.prior_weight, start=start)
            self.num_fits += 1
        self.since_fit = 0
        return self.model

    def state_dict(self) -> dict:
        return {
            "params": self.model.params.to_dict(),
            "since_fit": self.since_fit,
            "num_fits": self.num_fits,
            "times": [
                [[p.dp, p.tp, p.pp, p.micro_batch_size, p.num_microbatches], list(t)] for p, t in self.times.items()
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        self.model = self.prior.with_params(StepTimeParams.from_dict(state["params"]))
        self.since_fit = int(state["since_fit"])
        self.num_fits = int(state["num_fits"])
        self.times = {}
        for (dp, tp, pp, mbs, nmb), t in state["times"]:
            plan = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=nmb)
            self.times[plan] = [float(x) for x in t]


_KEY_BITS = (10, 10, 10, 12, 20)  # dp, tp, pp, micro_batch_size, num_microbatches


def _plan_keys(dp, tp, pp, micro_batch_size, num_microbatches) -> tuple[np.ndarray, np.ndarray]:
    """One int64 per plan (bit-packed fields) and a mask of plans whose fields fit the packing."""
    key = np.zeros(np.broadcast(dp, tp, pp, micro_batch_size, num_microbatches).shape, dtype=np.int64)
    ok = np.ones(key.shape, dtype=bool)
    for value, bits in zip((dp, tp, pp, micro_batch_size, num_microbatches), _KEY_BITS):
        v = np.asarray(value, dtype=np.int64)
        ok &= (v >= 0) & (v < (1 << bits))
        key = (key << bits) | (v & ((1 << bits) - 1))
    return key, ok


class ProfiledStepTime:
    """COPUS's measured table (§4.4) with the model as fallback: a plan's measured median step
    time where it was measured, `model.predict` elsewhere. Same `predict` signature, vectorised
    (a sorted-key lookup)."""

    def __init__(self, model: StepTimeModel, observations: Iterable[tuple[ParallelPlan, float]]) -> None:
        self.model = model
        table: dict[ParallelPlan, float] = {p: s for p, s in observations if np.isfinite(s) and s > 0}
        cols = plan_columns(list(table))
        keys, ok = _plan_keys(*cols) if table else (np.zeros(0, np.int64), np.zeros(0, bool))
        order = np.argsort(keys[ok], kind="stable")
        self._keys = keys[ok][order]
        self._times = np.array(list(table.values()), dtype=float)[ok][order]

    def _lookup(self, cols) -> tuple[np.ndarray, np.ndarray]:
        keys, ok = _plan_keys(*cols)
        if self._keys.size == 0:
            return np.zeros(keys.shape, dtype=bool), np.zeros(keys.shape, dtype=np.int64)
        pos = np.clip(np.searchsorted(self._keys, keys), 0, self._keys.size - 1)
        return ok & (self._keys[pos] == keys), pos

    def predict(self, dp, tp, pp, micro_batch_size, num_microbatches) -> np.ndarray:
        cols = (dp, tp, pp, micro_batch_size, num_microbatches)
        hit, pos = self._lookup(cols)
        out = self.model.predict(*cols)
        return np.where(hit, self._times[pos] if self._times.size else 0.0, out)

    def measured(self, dp, tp, pp, micro_batch_size, num_microbatches) -> np.ndarray:
        """Boolean mask: which plans have a measured time."""
        return self._lookup((dp, tp, pp, micro_batch_size, num_microbatches))[0]
