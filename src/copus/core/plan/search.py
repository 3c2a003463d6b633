"""One planning decision: rank every candidate, then switch only when it clearly pays.

COPUS Algorithm 2 (arXiv 2604.26687, §4.5) and design §5:
- score every allowed candidate by (LR-aware) goodput, `core.goodput.goodput`;
- a parallelism change (new dp, tp, pp) is scaled by the amortisation factor
  `T_useful / (T_elapsed + c_reconfig)` (COPUS) or, when `horizon_s` is given,
  `horizon_s / (horizon_s + c_reconfig)` (the change is repaid over the next `horizon_s`);
- growth cap: `B ≤ max_growth · B_current`, never below `min_batch` (COPUS: 2×);
- hysteresis: switch only if `(G* − G_current) / G_current > margin` (COPUS: 10%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from copus.core.plan.goodput import CandidateSet, StepTimePredictor, efficiency, goodput, rank
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Candidate, Decision, decision_kind
from copus.core.stats.step_uncertainty import required_gain


@dataclass(frozen=True, slots=True, kw_only=True)
class RankedPlan:
    """One row of `copus plan`: a plan with its predictions."""

    plan: ParallelPlan
    step_s: float
    samples_per_s: float
    efficiency: float
    goodput: float
    memory_bytes: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    """The decision (None: stay) and a JSON-able explanation of why."""

    decision: Decision | None
    explanation: dict


def amortisation(
    reconfig_cost_s: float, elapsed_s: float, useful_s: float | None = None, horizon_s: float | None = None
) -> float:
    """Factor applied to a parallelism change's goodput (COPUS Alg. 2, line 5).

    COPUS: `T_useful / (T_elapsed + c_reconfig)`, T_useful = T_elapsed minus past switch
    overheads (defaults to `elapsed_s`). With `horizon_s`: `horizon_s / (horizon_s + c)`.
    A zero cost gives 1.
    """
    if reconfig_cost_s < 0 or elapsed_s < 0:
        raise ValueError(f"reconfig_cost_s={reconfig_cost_s}, elapsed_s={elapsed_s} are invalid; allowed: >= 0")
    if reconfig_cost_s == 0:
        return 1.0
    if horizon_s is not None:
        return float(horizon_s / (horizon_s + reconfig_cost_s))
    useful = elapsed_s if useful_s is None else useful_s
    return float(max(useful, 0.0) / (elapsed_s + reconfig_cost_s))


def plan_dict(plan: ParallelPlan) -> dict:
    """The plan's degrees and batch (+ its options when not the defaults)."""
    out = {
        "dp": plan.dp,
        "tp": plan.tp,
        "pp": plan.pp,
        "micro_batch_size": plan.micro_batch_size,
        "num_microbatches": plan.num_microbatches,
        "global_batch_size": plan.global_batch_size,
    }
    if _option_args(plan):
        out.update(plan.options)
    return out


def ranked(
    candidates: CandidateSet,
    model: StepTimePredictor,
    b_noise: float = float("inf"),
    *,
    lr_aware: bool = True,
    ref_batch: float = 1.0,
    lr_ref_batch: float | None = None,
    top: int | None = None,
) -> list[RankedPlan]:
    """Every candidate (or the best `top`) sorted by goodput, best first."""
    step_s = candidates.predict_step_s(model)
    gbs = candidates.global_batch_size
    scores = goodput(step_s, gbs, b_noise, lr_aware=lr_aware, ref_batch=ref_batch, lr_ref_batch=lr_ref_batch)
    eff = efficiency(b_noise, gbs, ref_batch)
    order = rank(scores, step_s, top=top)
    return [
        RankedPlan(
            plan=candidates.plan(i),
            step_s=float(step_s[i]),
            samples_per_s=float(gbs[i] / step_s[i]) if step_s[i] > 0 else 0.0,
            efficiency=float(eff[i]),
            goodput=float(scores[i]),
            memory_bytes=float(candidates.memory_bytes[i]),
        )
        for i in order
    ]


def _allowed(
    candidates: CandidateSet,
    current: ParallelPlan,
    *,
    max_growth: float,
    min_batch: int | None,
    max_batch: int | None,
    allow_shrink: bool,
    allow_reconfigure: bool,
) -> np.ndarray:
    gbs = candidates.global_batch_size
    ok = gbs <= max_growth * current.global_batch_size + 1e-9
    if min_batch is not None:
        ok &= gbs >= min_batch
    if max_batch is not None:
        ok &= gbs <= max_batch
    if not allow_shrink:
        ok &= gbs >= current.global_batch_size
    if not allow_reconfigure:
        ok &= candidates.same_layout(current)
    return ok


def evaluate(
    candidates: CandidateSet,
    model: StepTimePredictor,
    b_noise: float,
    current_plan: ParallelPlan,
    *,
    margin: float = 0.10,
    max_growth: float = 2.0,
    min_batch: int | None = None,
    max_batch: int | None = None,
    allow_shrink: bool = True,
    reconfig_cost_s: float = 2.0,
    elapsed_s: float = 0.0,
    useful_s: float | None = None,
    horizon_s: float | None = None,
    allow_reconfigure: bool = True,
    lr_aware: bool = True,
    ref_batch: float = 1.0,
    lr_ref_batch: float | None = None,
    step: int = 0,
    top_k: int = 5,
    step_s: np.ndarray | None = None,
    uncertainty: np.ndarray | None = None,
    current_uncertainty: float = 0.0,
    step_confidence: float = 0.0,
) -> SearchResult:
    """Rank the allowed candidates and decide whether to switch (see module docstring).

    `uncertainty` (relative standard error of every candidate's step time) and
    `current_uncertainty` (the current plan's) raise the gain a switch needs to
    margin + step_confidence · sqrt(u_current² + u_best²) (`core.step_uncertainty`).

    Only the candidates allowed by the growth cap, batch range and layout lock are predicted,
    unless `step_s` (the model's prediction for every candidate, e.g. cached by the caller
    while the model does not change) is given.
    """
    if math.isnan(b_noise) or b_noise <= 0:
        raise ValueError(f"b_noise={b_noise} is invalid; allowed: a number > 0 (inf: unknown)")
    if margin < 0 or max_growth < 1:
        raise ValueError(f"margin={margin}, max_growth={max_growth} are invalid; allowed: margin >= 0, max_growth >= 1")
    allowed = _allowed(
        candidates,
        current_plan,
        max_growth=max_growth,
        min_batch=min_batch,
        max_batch=max_batch,
        allow_shrink=allow_shrink,
        allow_reconfigure=allow_reconfigure,
    )
    idx = np.flatnonzero(allowed)  # only these are predicted and scored
    if step_s is None:
        step_s = candidates.predict_step_s(model, idx)
    else:
        if np.shape(step_s) != (len(candidates),):
            raise ValueError(f"step_s has shape {np.shape(step_s)}; allowed: ({len(candidates)},)")
        step_s = np.asarray(step_s, dtype=float)[idx]
    gbs = candidates.global_batch_size[idx]
    raw = goodput(step_s, gbs, b_noise, lr_aware=lr_aware, ref_batch=ref_batch, lr_ref_batch=lr_ref_batch)
    factor = amortisation(reconfig_cost_s, elapsed_s, useful_s, horizon_s)
    adjusted = np.where(candidates.same_layout(current_plan)[idx], raw, raw * factor)
    order = rank(adjusted, step_s, top=max(top_k, 1))  # positions in idx
    cur_step = float(
        np.asarray(model.predict(*_plan_args(current_plan), **_option_args(current_plan)), float).reshape(-1)[0]
    )
    cur_good = float(
        goodput(
            np.array([cur_step]),
            np.array([current_plan.global_batch_size]),
            b_noise,
            lr_aware=lr_aware,
            ref_batch=ref_batch,
            lr_ref_batch=lr_ref_batch,
        )[0]
    )
    eff = efficiency(b_noise, gbs, ref_batch)
    top = [
        Candidate(
            plan=candidates.plan(idx[j]), step_s=float(step_s[j]), goodput=float(adjusted[j]), efficiency=float(eff[j])
        )
        for j in order[:top_k]
    ]
    expl = {
        "step": step,
        "b_noise": _num(b_noise),
        "margin": margin,
        "amortisation": factor,
        "reconfig_cost_s": reconfig_cost_s,
        "num_candidates": len(candidates),
        "num_allowed": int(idx.size),
        "current": {**plan_dict(current_plan), "step_s": cur_step, "goodput": cur_good},
        "top": [
            {
                **plan_dict(c.plan),
                "step_s": c.step_s,
                "goodput": c.goodput,
                "raw_goodput": float(raw[j]),
                "efficiency": c.efficiency,
            }
            for c, j in zip(top, order[:top_k], strict=True)
        ],
    }
    if not idx.size:
        return _stay(expl, "no allowed candidate (growth cap, batch range or layout lock)")
    best_j = int(order[0])
    best = candidates.plan(int(idx[best_j]))
    best_good = float(adjusted[best_j])
    gain = (best_good - cur_good) / cur_good if cur_good > 0 else float("inf")
    expl["gain"] = _num(gain)
    if best == current_plan:
        return _stay(expl, f"current plan {current_plan.describe()} is the best")
    u_best = float(uncertainty[idx[best_j]]) if uncertainty is not None else 0.0
    need = required_gain(margin, current_uncertainty, u_best, step_confidence)
    expl.update(required_gain=need, u_current=_num(current_uncertainty), u_best=_num(u_best))
    bar = (
        f"margin {margin:.0%}" if need == margin else f"margin {margin:.0%} + {step_confidence:g}·u {need - margin:.0%}"
    )
    if gain <= need:
        return _stay(expl, f"best {best.describe()} gains {gain:+.1%} <= {bar}")
    kind = decision_kind(current_plan, best)
    reason = (
        f"{kind}: {best.describe()} goodput {best_good:.4g} vs current "
        f"{current_plan.describe()} {cur_good:.4g} ({gain:+.1%} > {bar}); "
        f"step {step_s[best_j]:.4g}s vs {cur_step:.4g}s; b_noise={b_noise:.4g}"
    )
    if kind == "reconfigure":
        reason += f"; amortisation {factor:.3f} (c_reconfig={reconfig_cost_s:.3g}s)"
    expl.update(action=kind, why=reason)
    decision = Decision(kind=kind, plan=best, reason=reason, step=step, b_noise=float(b_noise), candidates=tuple(top))
    return SearchResult(decision=decision, explanation=expl)


def search(
    candidates: CandidateSet, model: StepTimePredictor, b_noise: float, current_plan: ParallelPlan, **kw
) -> Decision | None:
    """`evaluate(...).decision`: the switch to make now, or None to stay."""
    return evaluate(candidates, model, b_noise, current_plan, **kw).decision


def _stay(expl: dict, why: str) -> SearchResult:
    expl.update(action="none", why=why)
    return SearchResult(decision=None, explanation=expl)


def _plan_args(plan: ParallelPlan) -> tuple[np.ndarray, ...]:
    return tuple(
        np.array([v], dtype=np.int64) for v in (plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches)
    )


def _option_args(plan: ParallelPlan) -> dict:
    """The plan's non-default options as model keywords ({} for a plain plan: any predictor)."""
    default = ParallelPlan(dp=1, tp=1, pp=1, micro_batch_size=1, num_microbatches=1).options
    if plan.options == default:
        return {}
    return {k: np.array([v]) if isinstance(v, (bool, int)) else v for k, v in plan.options.items()}


def _num(x: float) -> float | None:
    """JSON-safe number: None for NaN/inf."""
    return float(x) if np.isfinite(x) else None
