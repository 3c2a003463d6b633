"""The markdown table of a `copus simulate --truth-grid --json` result.

    PYTHONPATH=src python -m copus simulate --truth-grid --seeds 0,1,2 \
        --policies static,cbs,goodput --json > bench/results/truth_grid.json
    python bench/truth_grid_table.py bench/results/truth_grid.json > bench/results/truth_grid_table.md

Per cell: the oracle's average speed-up over the fastest baseline (free switches, and paying
the scenario's switch cost), the default goodput per seed, its mean and capture (against
both ceilings), and goodput-copus; then the goals block of each variant.
"""

from __future__ import annotations

import json
import sys


def _f(x: float | None, fmt: str = "+.1f") -> str:
    return "–" if x is None else format(x, fmt)


def table(result: dict, name: str = "goodput", paper: str = "goodput-copus") -> str:
    rows = ["| preset | truth | R | oracle | oracle paying for switches | goodput (default) per "
            "seed | mean | capture | capture (paying) | goodput-copus | capture |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        g, p = c["variants"][name], c["variants"].get(paper, {})
        rows.append(
            f"| {c['preset']} | {c['truth']} | {c['crit_ratio']:g} | {_f(c['oracle_avg_pct'])} | "
            f"{_f(c.get('switch_aware_oracle_avg_pct'))} | "
            + " / ".join(_f(x) for x in g["per_seed_pct"])
            + f" | {_f(g['average_speedup_pct'])} | {_f(g['capture'], '.2f')} | "
              f"{_f(g.get('capture_switch_aware'), '.2f')} | "
              f"{_f(p.get('average_speedup_pct'))} | {_f(p.get('capture'), '.2f')} |")
    rows.append("")
    for variant, goals in result["goals"].items():
        rows.append(f"- {variant}: median capture {_f(goals['median_capture'], '.2f')} "
                    f"(paying for switches {_f(goals.get('median_capture_switch_aware'), '.2f')}), "
                    f"min {_f(goals['min_capture'], '.2f')}, "
                    f"{goals['cells_counted'] - len(goals['cells_below_0.6'])} of "
                    f"{goals['cells_counted']} cells ≥ 0.6, "
                    f"{len(goals['cells_behind_1pct'])} of {len(result['cells'])} cells more than "
                    f"1 % behind the best baseline: {', '.join(goals['cells_behind_1pct']) or 'none'}")
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
