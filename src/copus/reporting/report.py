"""`copus report`: PNG plots and a Markdown summary of one or more run folders."""

from __future__ import annotations

import math
from pathlib import Path

from copus.reporting.checks import audit_table, decision_rows, probe_table
from copus.reporting.calibration import calibration_section
from copus.reporting.runs import Run, first_time_below, plan_label, plan_segments


def _smooth(values: list[float], window: int = 9) -> list[float]:
    """Trailing mean over `window` finite values (train loss is noisy per step)."""
    out, buf = [], []
    for v in values:
        if not math.isnan(v):
            buf.append(v)
            buf = buf[-window:]
        out.append(sum(buf) / len(buf) if buf else float("nan"))
    return out


def _fmt(v: float, spec: str = ".3f") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def run_wall_s(run: Run) -> float:
    """The run's wall time as summary.txt gives it (summary.json, which also counts the final
    evaluation and checkpoint) when that summary is of the run's last step, else the last row's."""
    last = run.steps[-1]
    if run.summary.get("steps") == last.get("step") and run.summary.get("wall_s") is not None:
        return float(run.summary["wall_s"])
    return float(last.get("wall_s") or 0.0)


def summary_rows(runs: list[Run], targets: list[float]) -> list[dict]:
    """One row per run: totals, final losses, batches, plans, and wall time to each target.
    `final_loss` and `wall_s` are summary.txt's: the last step's loss, the run's wall time."""
    rows = []
    for run in runs:
        last = run.steps[-1]
        val = run.series("val_loss", run.evals) if run.evals else []
        val_t = run.series("wall_s", run.evals) if run.evals else []
        row = {
            "run": run.name,
            "policy": run.policy,
            "steps": int(last.get("step", len(run.steps))),
            "tokens": int(last.get("tokens") or 0),
            "wall_s": run_wall_s(run),
            "final_loss": run.series("loss")[-1],
            "final_val_loss": val[-1] if val else float("nan"),
            "batch_start": int(run.steps[0].get("global_batch_size") or 0),
            "batch_end": int(last.get("global_batch_size") or 0),
            "plans": " -> ".join(s[2] for s in plan_segments(run)),
            "num_decisions": len(decision_rows(run)),
            "mfu": _median(run.series("mfu")),
            "peak_memory_gib": _max(run.series("peak_memory_bytes")) / 2**30,
        }
        for target in targets:
            row[f"time_to_{target:g}"] = first_time_below(val_t, val, target)
        rows.append(row)
    return rows


def _median(values: list[float]) -> float:
    """Median of the finite values (NaN if none): a run's typical MFU."""
    xs = sorted(v for v in values if math.isfinite(v))
    if not xs:
        return float("nan")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _max(values: list[float]) -> float:
    xs = [v for v in values if math.isfinite(v)]
    return max(xs) if xs else float("nan")


def markdown_table(rows: list[dict], targets: list[float]) -> str:
    """The summary table; MFU is the median over steps, peak memory the largest of any rank."""
    head = [
        "run",
        "policy",
        "steps",
        "tokens",
        "wall s",
        "final loss",
        "val loss",
        "batch",
        "plans",
        "MFU",
        "peak GiB",
    ] + [f"t→{t:g} (s)" for t in targets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["run"],
            r["policy"],
            str(r["steps"]),
            f"{r['tokens']:,}",
            _fmt(r["wall_s"], ".1f"),
            _fmt(r["final_loss"]),
            _fmt(r["final_val_loss"]),
            f"{r['batch_start']}→{r['batch_end']}",
            r["plans"],
            _fmt(r["mfu"] * 100, ".1f") + "%" if math.isfinite(r["mfu"]) else "–",
            _fmt(r["peak_memory_gib"], ".2f"),
        ]
        cells += [_fmt(r[f"time_to_{t:g}"], ".1f") for t in targets]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot_lines(ax, runs: list[Run], x_key: str, y_key: str, smooth: bool = False) -> None:
    for run in runs:
        ys = run.series(y_key)
        ax.plot(run.series(x_key), _smooth(ys) if smooth else ys, label=f"{run.name} ({run.policy})")


def _plain_log_ticks(ax, base: int) -> None:
    """A log axis ticked with plain numbers: 8, 16, 32, 64 (base 2, global batch) or 1, 10,
    100 (base 10), not 2×10^1; no minor labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.yaxis.set_major_locator(LogLocator(base=base, subs=(1.0,)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plan_timeline(plt, runs: list[Run]) -> None:
    """One bar per run along wall time, a segment per layout (labelled inside when it fits),
    legend below the axis; at least 2.6 inches tall so one run is not squeezed."""
    import matplotlib.patches

    fig, ax = plt.subplots(figsize=(8, max(2.6, 1.5 + 0.55 * len(runs))))
    labels = sorted({s[2] for run in runs for s in plan_segments(run)})
    colors = {lab: plt.cm.tab10(i % 10) for i, lab in enumerate(labels)}
    span = max((s[1] for run in runs for s in plan_segments(run)), default=1.0) or 1.0
    for i, run in enumerate(runs):
        for start, end, lab in plan_segments(run):
            ax.barh(i, max(end - start, 1e-3), left=start, height=0.6, color=colors[lab], edgecolor="k", lw=0.3)
            if (end - start) / span > 0.12:
                ax.text((start + end) / 2, i, lab, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(runs)), [r.name for r in runs])
    ax.set_ylim(-0.6, len(runs) - 0.4)
    ax.set(xlabel="wall time (s)", title="Parallel plan timeline (dp.tp.pp)")
    ax.legend(
        handles=[matplotlib.patches.Patch(color=colors[lab], label=lab) for lab in labels],
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35),
        ncol=min(4, max(1, len(labels))),
        frameon=False,
    )


def write_plots(runs: list[Run], out: Path) -> list[Path]:
    """Six PNGs: loss vs wall time and tokens, batch and b_noise vs tokens, plan timeline, tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    for x_key, xlabel, name in (
        ("wall_s", "wall time (s)", "loss_vs_time.png"),
        ("tokens", "tokens", "loss_vs_tokens.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _plot_lines(ax, runs, x_key, "loss", smooth=True)
        for run in runs:
            if run.evals:
                ax.plot(
                    run.series(x_key, run.evals),
                    run.series("val_loss", run.evals),
                    "o--",
                    ms=3,
                    label=f"{run.name} validation",
                )
        ax.set(xlabel=xlabel, ylabel="loss (nats/token)", title="Training loss (smoothed) and validation loss")
        ax.legend(fontsize=7)
        save(fig, name)
    for y_key, ylabel, name, base in (
        ("global_batch_size", "global batch (samples)", "batch_vs_tokens.png", 2),
        ("b_noise", "b_noise (samples)", "bnoise_vs_tokens.png", 10),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _plot_lines(ax, runs, "tokens", y_key)
        ax.set(xlabel="tokens", ylabel=ylabel, title=f"{ylabel} as training proceeds")
        ax.set_yscale("log", base=base)
        _plain_log_ticks(ax, base)
        ax.legend(fontsize=7)
        save(fig, name)
    plan_timeline(plt, runs)
    save(plt.gcf(), "plan_timeline.png")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _plot_lines(ax, runs, "wall_s", "tokens_per_s", smooth=True)
    ax.set(xlabel="wall time (s)", ylabel="tokens/s", title="Throughput")
    ax.legend(fontsize=7)
    save(fig, "tokens_per_s.png")
    return paths


def considered_table(run: Run, max_rows: int = 40) -> list[str]:
    """The planning controller's decision points (decisions.jsonl rows with "event":
    "considered", core/control/planner.py): the plan taken and the best layout and batch it
    refused, with their predicted gain and what they had to clear. At most `max_rows` rows,
    evenly spaced, the last one always."""
    rows = [d for d in run.decisions if d.get("event") == "considered"]
    if not rows:
        return []
    if len(rows) > max_rows:
        keep = {round(i * (len(rows) - 1) / (max_rows - 1)) for i in range(max_rows)}
        rows = [r for i, r in enumerate(rows) if i in keep]
    lines = [
        f"## Moves weighed by {run.name}",
        "",
        "At each decision point the plan over the rest of the run (expected seconds to its "
        "end) and the best moves it refused: a layout, with the seconds it would save over "
        "the rest of the run against the switch cost it had to clear; a larger batch, with "
        "its expected rate against the chosen one's.",
        "",
        "| step | plan | expected s | layout refused | saves s | needs s | larger batch | rate vs chosen |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        lay = next((x for x in r.get("refused", []) if x.get("move") == "layout"), {})
        big = next((x for x in r.get("refused", []) if x.get("move") == "batch (larger)"), {})
        rate = big.get("gain_pct")
        lines.append(
            f"| {r.get('step')} | {r.get('chosen', '')} | {_fmt(r.get('expected_s'), '.0f')} "
            f"| {lay.get('plan', '–')} | {_fmt(lay.get('gain_s'), '.1f')} "
            f"| {_fmt(lay.get('needs_s'), '.1f')} | {big.get('global_batch_size', '–')} "
            f"| {'–' if rate is None else format(rate, '+.1f') + '%'} |"
        )
    return lines + [""]


def write_report(runs: list[Run], out: Path, targets: list[float]) -> Path:
    """Plots + `summary.md` in `out`; returns the Markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(runs, out)
    rows = summary_rows(runs, targets)
    md = [
        "# copus report",
        "",
        "Each row is one training run. *val loss* is the last validation loss; *t→X* is the "
        "wall time at which the validation loss first reached X (– if never). *final loss* "
        "and *wall s* are summary.txt's (the last step's loss; the run's wall time). *plans* "
        "lists the dp.tp.pp layouts the run used, in order.",
        "",
        markdown_table(rows, targets),
        "",
    ]
    for run in runs:
        if decision_rows(run):
            md += [f"## Decisions of {run.name}", ""]
            for d in decision_rows(run):
                purpose = "" if d.get("purpose", "decide") == "decide" else f" ({d['purpose']})"
                md.append(
                    f"- step {d.get('step')}: {d.get('kind')}{purpose} -> {plan_label(d)} "
                    f"B={d.get('global_batch_size')} — {d.get('reason', '')}"
                )
            md.append("")
        md += considered_table(run) + probe_table(run) + audit_table(run)
        md += calibration_section(run)
    md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    path = out / "summary.md"
    path.write_text("\n".join(md) + "\n")
    return path
