"""A plan for a new world size: what a resumed run trains with after hosts left or joined.

Elastic training (torchrun `--nnodes MIN:MAX`) restarts the workers with another `WORLD_SIZE`;
the checkpoint's plan then no longer fits (dp·tp·pp must equal the world). `replan` chooses the
plan for the new world from a `CandidateSet` of that world (design §5, §6):

1. only candidates that respect the fixed `[parallel]` degrees (`FixedDegrees`, 0 = free);
2. the checkpoint's global batch B is kept when some candidate has it (the LR schedule, the
   batch policy's state and the statistical efficiency E(B) carry over unchanged); otherwise
   the candidates with the B closest to it (ties: the larger B);
3. among those, the best by goodput = samples_per_s × E(B) [× sqrt(B/B_lr) when LR-aware]
   (COPUS Eqs. 6–8, `core.goodput.goodput`) with the restored noise scale. At one B, E(B) and
   the LR factor are equal for every candidate, so this is the fastest plan by the step-time
   model (ties: shorter step, then candidate order).

No hysteresis and no amortisation (COPUS Alg. 2): the old plan cannot run, so some switch is
forced and the restart has already been paid. The batch policy takes over from the next step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from copus.core.plan.goodput import CandidateSet, StepTimePredictor, efficiency, goodput, rank
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Candidate, Decision, decision_kind


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedDegrees:
    """The `[parallel]` keys a user fixed (0 = chosen by copus)."""

    dp: int = 0
    tp: int = 0
    pp: int = 0
    micro_batch_size: int = 0

    def mask(self, candidates: CandidateSet) -> np.ndarray:
        """Boolean mask of the candidates with every fixed degree."""
        ok = np.ones(len(candidates), dtype=bool)
        for name in ("dp", "tp", "pp", "micro_batch_size"):
            value = getattr(self, name)
            if value:
                ok &= getattr(candidates, name) == value
        return ok

    def admits(self, plan: ParallelPlan, *, layout_only: bool = False) -> bool:
        """Whether `plan` has every fixed degree (`layout_only`: ignore micro_batch_size)."""
        names = ("dp", "tp", "pp") if layout_only else ("dp", "tp", "pp", "micro_batch_size")
        return all(not getattr(self, k) or getattr(self, k) == getattr(plan, k) for k in names)

    def describe(self) -> str:
        fixed = [f"{k}={getattr(self, k)}" for k in ("dp", "tp", "pp", "micro_batch_size") if getattr(self, k)]
        return f"fixed {', '.join(fixed)}" if fixed else "no fixed degrees"


def batch_pool(candidates: CandidateSet, allowed: np.ndarray, global_batch_size: int) -> tuple[np.ndarray, int]:
    """(mask, B): the allowed candidates with B = `global_batch_size` if any, else with the
    allowed B closest to it (ties: the larger). An empty mask when nothing is allowed."""
    gbs = candidates.global_batch_size
    if not allowed.any():
        return allowed, global_batch_size
    values = np.unique(gbs[allowed])
    distance = np.abs(values - global_batch_size)
    best = int(values[np.flatnonzero(distance == distance.min())[-1]])
    return allowed & (gbs == best), best


def replan(
    candidates: CandidateSet,
    model: StepTimePredictor,
    *,
    saved: ParallelPlan,
    why: str,
    fixed: FixedDegrees = FixedDegrees(),
    b_noise: float = math.inf,
    lr_aware: bool = True,
    lr_ref_batch: float | None = None,
    model_name: str = "",
    step: int = 0,
    top_k: int = 5,
) -> Decision | None:
    """The plan to resume with (see the module docstring), as a Decision whose reason starts
    with `why` (e.g. "world size changed from 2 to 1") and lists the best `top_k` candidates;
    None when no candidate respects `fixed`. `b_noise` is the calibrated noise scale (inf or NaN:
    unknown, E(B) = 1)."""
    b = b_noise if math.isfinite(b_noise) and b_noise > 0 else math.inf
    pool, batch = batch_pool(candidates, fixed.mask(candidates), saved.global_batch_size)
    idx = np.flatnonzero(pool)
    if not idx.size:
        return None
    step_s = candidates.predict_step_s(model, idx)
    gbs = candidates.global_batch_size[idx]
    scores = goodput(step_s, gbs, b, lr_aware=lr_aware, lr_ref_batch=lr_ref_batch)
    eff = efficiency(b, gbs)
    order = rank(scores, step_s, top=max(top_k, 1))
    top = tuple(
        Candidate(
            plan=candidates.plan(int(idx[j])),
            step_s=float(step_s[j]),
            goodput=float(scores[j]),
            efficiency=float(eff[j]),
        )
        for j in order
    )
    best = top[0]
    kept = (
        f"global batch {batch} kept"
        if batch == saved.global_batch_size
        else f"global batch {saved.global_batch_size} impossible here, closest {batch}"
    )
    ranking = "; ".join(f"{c.plan.describe()} {c.step_s:.3g}s" for c in top)
    reason = (
        f"{why}: {kept}; {best.plan.describe()} is the fastest of {idx.size} plans "
        f"({fixed.describe()}) by the {model_name or 'step-time'} model: {ranking}"
    )
    if math.isfinite(b):
        reason += f"; b_noise={b:.4g}"
    return Decision(
        kind=decision_kind(saved, best.plan),
        plan=best.plan,
        reason=reason,
        step=step,
        b_noise=float(b_noise),
        candidates=top,
    )
