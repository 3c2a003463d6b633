"""The record of a planning decision: what the planner weighed and refused (docs/robust-goodput.md
§6, "Record"); `copus report` tabulates these rows ("Moves weighed by …"). Pure numpy."""

from __future__ import annotations

import math

import numpy as np

from copus.core.plan.records import StepRecord


def considered_row(ctrl, record: StepRecord, plan: dict, probe) -> dict:
    """The `"event": "considered"` row of decisions.jsonl at a decision point of `ctrl` (a
    `PlanningController`): the plan taken (its expected seconds to the run's end), the best
    layout refused (seconds it would save over the rest of the run against the switch cost it
    had to clear), the best larger and smaller batch refused (expected rate against the chosen
    batch's under the posterior), the experiment taken and the probe, if any."""
    cands, J, h = ctrl.candidates, plan["J"], plan["h"]
    lay, i = plan["layout"], plan["index"]
    chosen = cands.plan(i)
    out = {
        "event": "considered",
        "step": record.step,
        "tokens": record.tokens,
        "current": record.plan.describe(),
        "chosen": chosen.describe(),
        "global_batch_size": chosen.global_batch_size,
        "expected_s": _f(J[lay]),
        "switch_cost_s": ctrl.reconfig_cost_s,
        "b_noise": record.b_noise,
        "c": plan["c"],
        "phi_now": plan["phi_now"],
        "slope": plan["slope"],
        "e_end": plan["e_end"].tolist(),
        "refused": [],
    }
    others = [k for k in np.argsort(J) if k != lay and np.isfinite(J[k])]
    if others:
        k = int(others[0])
        on_k = ctrl.ladder(np.flatnonzero(ctrl._ids == k))
        j = int(on_k[np.argmax(plan["score"][on_k])])
        gain, need = h[lay] - h[k], plan["switch"][k] - plan["switch"][lay]
        out["refused"].append(
            {
                "move": "layout",
                "plan": cands.plan(j).describe(),
                "global_batch_size": int(cands.global_batch_size[j]),
                "gain_s": _f(gain),
                "needs_s": _f(need),
                "why": f"saves {gain:.1f}s over the rest of the run, needs {need:.1f}s",
            }
        )
    on = ctrl.ladder(np.flatnonzero(ctrl._ids == lay))
    b = cands.global_batch_size
    for side, pick in (("larger", on[b[on] > b[i]]), ("smaller", on[b[on] < b[i]])):
        if len(pick):
            j = int(pick[np.argmax(plan["score"][pick])])
            gain = 100.0 * (plan["score"][j] / max(plan["score"][i], 1e-300) - 1.0)
            out["refused"].append(
                {
                    "move": f"batch ({side})",
                    "plan": cands.plan(j).describe(),
                    "global_batch_size": int(b[j]),
                    "gain_pct": _f(gain),
                    "needs_pct": 0.0,
                    "why": f"B={b[j]} expected rate {gain:+.1f}% vs B={b[i]} under the posterior",
                }
            )
    what = "stay on" if chosen == record.plan else "take"
    out["why"] = (
        f"plan: {what} {chosen.describe()} (expected {_f(J[lay]):.0f}s to the run's "
        f"end; c {_span(plan['c'])}, φ {_span(plan['phi_now'])}, slope "
        f"{_span(plan['slope'])})"
    )
    exp = plan.get("experiment")
    if exp is not None:
        out["experiment"] = {k: _f(v) for k, v in exp.items() if k != "index"}
        out["why"] += f"; an experiment: its value of information {exp['value_s']:.1f}s > its cost {exp['cost_s']:.1f}s"
    if probe is not None:
        out["probe"] = probe[1]
    return out


def _f(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _span(values) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.3g}" if math.isclose(lo, hi, rel_tol=1e-3) else f"{lo:.3g}-{hi:.3g}"
