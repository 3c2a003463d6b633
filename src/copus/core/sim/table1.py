"""COPUS Table 1 and Table 2 next to a simulation of the same preset (pure; no torch).

`table1_rows` pairs every published row of a preset (`core.presets.Preset.published_minutes`)
with the simulated run of the same method: "COPUS" ↔ the goodput variant "goodput-copus",
"CBS (DPd,TPt,PPp)" ↔ the CBS run on that layout, "Static GBS=B" ↔ the static run at B; the
simulated goodput variants with no published row (copus's defaults) follow with published None.
`timeline_rows` lists each parallelism switch of a goodput run beside Table 2's.
"""

from __future__ import annotations

from dataclasses import dataclass

from copus.core.sim.compare import Comparison
from copus.core.sim.simulator import SimResult
from copus.core.plan.layout_names import parse_layout


@dataclass(frozen=True, slots=True, kw_only=True)
class Table1Row:
    """One method: published and simulated minutes to each target (None: not reached)."""

    label: str
    published: tuple[float | None, ...] | None  # None: no such row in the paper
    simulated: tuple[float | None, ...] | None  # None: not simulated


def _minutes(run: SimResult | None, targets: list[float]) -> tuple[float | None, ...] | None:
    if run is None:
        return None
    return tuple(None if run.time_to_target_s[t] is None else run.time_to_target_s[t] / 60.0 for t in targets)


def _layout_of(name: str) -> tuple[int, int, int] | None:
    """The (dp, tp, pp) of a simulated run named "cbs <layout>" (any spelling parse_layout reads)."""
    return tuple(parse_layout(name.split()[1])) if name.startswith("cbs ") else None


def simulated_run_for(label: str, cmp_: Comparison, copus_run: str = "goodput-copus") -> SimResult | None:
    """The simulated run that stands for the published row `label` (module docstring)."""
    fams = cmp_.families
    if label == "COPUS":
        names = cmp_.goodput_runs()
        name = copus_run if copus_run in names else (names[0] if names else None)
        return cmp_.run(name) if name else None
    if label.startswith("CBS ("):
        layout = tuple(parse_layout(label[len("CBS (") : -1]))
        return next((r for r in cmp_.results if fams[r.name] == "cbs" and _layout_of(r.name) == layout), None)
    if label.startswith("Static GBS="):
        batch = int(label.split("=")[1])
        return next(
            (r for r in cmp_.results if fams[r.name] == "static" and r.timeline[0].plan.global_batch_size == batch),
            None,
        )
    return None


def table1_rows(preset, cmp_: Comparison) -> list[Table1Row]:
    """Published rows with their simulated twins, then the unpublished goodput variants."""
    targets = sorted(preset.target_losses, reverse=True)
    rows = [
        Table1Row(label=label, published=tuple(minutes), simulated=_minutes(simulated_run_for(label, cmp_), targets))
        for label, minutes in preset.published_minutes.items()
    ]
    for name in cmp_.goodput_runs():
        if name != "goodput-copus":
            rows.append(Table1Row(label=name, published=None, simulated=_minutes(cmp_.run(name), targets)))
    return rows


def timeline_rows(preset, run: SimResult) -> list[tuple[str, str]]:
    """(published, simulated) switch descriptions "t min: DPd,TPt,PPp → ...", row by row."""

    def fmt(layout) -> str:
        return f"DP{layout[0]},TP{layout[1]},PP{layout[2]}"

    pub = [f"start {fmt(preset.published_layouts[0])}"] if preset.published_layouts else []
    for i, minutes in enumerate(preset.published_switch_min):
        pub.append(f"{minutes:g} min -> {fmt(preset.published_layouts[i + 1])}")
    sim, last = [], None
    for span in run.timeline:
        if span.plan.layout != last:
            where = "start" if last is None else f"{span.start_s / 60:.1f} min ->"
            sim.append(f"{where} {fmt(span.plan.layout)} (B={span.plan.global_batch_size})")
            last = span.plan.layout
    n = max(len(pub), len(sim))
    return [(pub[i] if i < len(pub) else "", sim[i] if i < len(sim) else "") for i in range(n)]
