"""The markdown table of a `copus simulate --truth-grid --json` result (the honest yardstick).

    PYTHONPATH=src nice copus simulate --truth-grid --seeds 0,1,2 \
        --policies cbs,doubling,goodput --json > bench/results/truth_grid.json
    python bench/truth_grid_table.py bench/results/truth_grid.json > bench/results/truth_grid_table.md

Per cell (docs/yardstick.md): the honest ceiling (speed-up in time to the final target of the
one-run, switch-paying programme over the best baseline) and whether it is ≥ 2 %, the best
baseline, the default goodput's speed-up per seed, its mean, seed spread and capture, the
speed-up over the untuned choices (median static batch; the published schedules as published),
and goodput-copus; then the goals block of each variant.
"""

from __future__ import annotations

import json
import sys


def _f(x: float | None, fmt: str = "+.1f") -> str:
    return "–" if x is None else format(x, fmt)


def _short(name: str) -> str:
    return name.replace(" (best of full menu)", "*").replace("schedule ", "").replace(" tuned", " (tuned)")


def table(result: dict, name: str = "goodput", paper: str = "goodput-copus") -> str:
    rows = [
        f"Metric: {result.get('metric', 'time to the final target loss')}; seeds "
        f"{', '.join(map(str, result['seeds']))}. * = best static of the full menu "
        "(deterministic).",
        "",
        "| preset | truth | R | honest ceiling | ≥ 2 % | best baseline | goodput (default) per "
        "seed | mean | spread | capture | vs median static | vs best published schedule "
        "as published | goodput-copus | capture |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        g, p = c["variants"][name], c["variants"].get(paper, {})
        untuned = g.get("vs_untuned_pct", {})
        median = next((v for k, v in untuned.items() if k.startswith("median static")), None)
        sched = [v for k, v in untuned.items() if k.startswith("schedule") and v is not None]
        rows.append(
            f"| {c['preset']} | {c['truth']} | {c['crit_ratio']:g} | "
            f"{_f(c['honest_ceiling_pct'])} | {'yes' if c['ceiling_ge_2pct'] else 'no'} | "
            f"{_short(c['best_baseline'][0] or '–')} | "
            + " / ".join(_f(x) for x in g["per_seed_pct"])
            + f" | {_f(g['speedup_pct'])} | {_f(g.get('seed_spread_pct'), '.1f')} | "
            f"{_f(g['capture'], '.2f')} | {_f(median)} | "
            f"{_f(min(sched) if sched else None)} | "
            f"{_f(p.get('speedup_pct'))} | {_f(p.get('capture'), '.2f')} |"
        )
    rows.append("")
    for variant, goals in result["goals"].items():
        rows.append(
            f"- {variant}: median capture {_f(goals['median_capture'], '.2f')} over "
            f"{goals['cells_counted']} of {goals['cells']} cells with honest ceiling ≥ 2 %, "
            f"min {_f(goals['min_capture'], '.2f')}, "
            f"{goals['cells_counted'] - len(goals['cells_below_0.5'])} of "
            f"{goals['cells_counted']} counted cells ≥ 0.5; "
            f"{len(goals['cells_behind_1pct'])} of {goals['cells']} cells more than 1 % "
            f"behind the best baseline: {', '.join(goals['cells_behind_1pct']) or 'none'}"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python bench/truth_grid_table.py RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        sys.stdout.write(table(json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
