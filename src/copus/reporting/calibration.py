"""The calibration part of `copus report`: the posterior over c (gns.calibration = "auto":
decisions.jsonl lines with "event": "calibration", core/stats/calibration_posterior.py), branch
probes (gns.calibration = "probe": lines with a "probe" entry, runtime/train/probe.py) and
`copus calibrate` results (`<run>/calibration/calibration.json`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from copus.reporting.runs import Run


def _g(x, spec: str = ".3g") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def probe_lines(run: Run) -> list[str]:
    """One table row per probe: when, online b_noise, B_noise fit, measured c, chosen batch, cost."""
    probes = [d["probe"] for d in run.decisions if isinstance(d.get("probe"), dict)]
    if not probes:
        return []
    lines = [
        "| step | tokens | B | branches | online b_noise | B_noise fit | measured c | c used "
        "| chosen B | cost s | extra tokens |",
        "|" + "---|" * 11,
    ]
    for p in probes:
        branches = ",".join(str(b.get("global_batch_size")) for b in p.get("branches", []))
        lines.append(
            f"| {p.get('step')} | {p.get('tokens')} | {p.get('base_batch')} | {branches} "
            f"| {_g(p.get('b_noise_online'))} | {_g(p.get('b_noise_fit'))} "
            f"| {_g(p.get('measured_c'))} | {_g(p.get('c_used'))} "
            f"| {p.get('chosen_batch')} | {_g(p.get('cost_s'), '.1f')} "
            f"| {p.get('cost_tokens')} |"
        )
    return lines


def posterior_lines(run: Run) -> list[str]:
    """One row per natural experiment (a window around batch changes): the batches, the c that
    window alone fits best, and the posterior after it (median, mean, 5-95 % interval)."""
    rows = [d for d in run.decisions if d.get("event") == "calibration"]
    if not rows:
        return []
    lines = [
        "| step | batches | median b_noise | c (window ML) | c median | c mean | 5-95 % | experiments |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        batches = ",".join(_g(b, "g") for b in r.get("batches", []))
        lines.append(
            f"| {r.get('step')} | {batches} | {_g(r.get('b_noise'))} "
            f"| {_g(r.get('c_ml'))} | {_g(r.get('median'))} | {_g(r.get('mean'))} "
            f"| {_g(r.get('p05'))}–{_g(r.get('p95'))} | {r.get('experiments')} |"
        )
    return lines


def calibrate_lines(run_dir: Path) -> list[str]:
    """`copus calibrate`'s table for this run folder, if it was calibrated."""
    path = run_dir / "calibration" / "calibration.md"
    if not (run_dir / "calibration" / "calibration.json").is_file() or not path.is_file():
        return []
    data = json.loads((run_dir / "calibration" / "calibration.json").read_text())
    return [f"`{data.get('command', 'copus calibrate')}`", "", *path.read_text().splitlines()]


def calibration_section(run: Run) -> list[str]:
    """Markdown lines for `copus report` ([] when the run has neither probes nor calibration)."""
    probes, table, posterior = probe_lines(run), calibrate_lines(run.path), posterior_lines(run)
    if not probes and not table and not posterior:
        return []
    md = [f"## Calibration of {run.name}", ""]
    if posterior:
        md += [
            "Posterior over c = B_crit / b_noise learnt from the loss around the run's own "
            'batch changes (gns.calibration = "auto", docs/robust-goodput.md):',
            "",
            *posterior,
            "",
        ]
    if probes:
        md += [
            'Branch probes (gns.calibration = "probe"): the run continued from the chosen '
            "branch; c = B_noise fit / online b_noise.",
            "",
            *probes,
            "",
        ]
    if table:
        md += ["Branching calibration (copus calibrate):", "", *table, ""]
    return md
