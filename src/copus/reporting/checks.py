"""`copus report`: the goodput controller's probes and decision audits (decisions.jsonl rows
with an "event" key, `core.explore` and `core.audit`) as Markdown tables."""

from __future__ import annotations

from copus.reporting.runs import Run


def _f(v, spec: str = ".3f") -> str:
    return "–" if v is None else format(v, spec)


def decision_rows(run: Run) -> list[dict]:
    """decisions.jsonl rows that are decisions (not probe results or audits)."""
    return [d for d in run.decisions if "event" not in d]


def audit_table(run: Run) -> list[str]:
    """Each checked decision: prediction vs realised step time, goodput vs the plan it left."""
    rows = [d for d in run.decisions if d.get("event") == "audit" and "realised_step_s" in d]
    if not rows:
        return []
    out = [
        f"## Decisions of {run.name} checked against what they delivered",
        "",
        "*realised/left*: realised goodput of the new plan relative to the plan it left, at "
        "the noise scale of the check; below −margin the decision is undone.",
        "",
        "| decided at | checked at | kind | from -> to | predicted s/step | realised s/step | "
        "error | realised/left | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in rows:
        err, rel = d.get("step_error"), d.get("realised_vs_before")
        out.append(
            f"| {d.get('decision_step')} | {d.get('step')} | {d.get('kind')} | "
            f"{d.get('before')} -> {d.get('after')} | {_f(d.get('predicted_step_s'))} | "
            f"{_f(d.get('realised_step_s'))} | {_f(err, '+.0%')} | {_f(rel, '+.1%')} | "
            f"{d.get('verdict')} |"
        )
    return out + [""]


def probe_table(run: Run) -> list[str]:
    """Each in-run probe: the layout measured, against the plan it left, and the verdict."""
    rows = [d for d in run.decisions if d.get("event") == "probe_result" and "gain" in d]
    if not rows:
        return []
    out = [
        f"## Layouts {run.name} probed in the run",
        "",
        "| probed at | ended at | probed plan | predicted s/step | measured s/step | "
        "plan it left | its s/step | gain | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in rows:
        out.append(
            f"| {d.get('probe_step')} | {d.get('step')} | {d.get('plan')} | "
            f"{_f(d.get('predicted_step_s'))} | {_f(d.get('measured_step_s'))} | "
            f"{d.get('before')} | {_f(d.get('before_step_s'))} | "
            f"{_f(d.get('gain'), '+.1%')} | {d.get('verdict')} |"
        )
    return out + [""]
