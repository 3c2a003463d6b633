"""Honest-yardstick grid files side by side: one markdown row per cell, then the goals per column.

Each argument is `PATH[:VARIANT][=LABEL]`: a `bench/planner_grid.py` JSON-lines file or a
`copus simulate --truth-grid --json` file, or several grid files joined by `+` whose seeds are
pooled per cell (`seeds012.jsonl+seeds34.jsonl`: five seeds), the variant to read (default
"goodput"), a label.
Cells present in every file are compared. Summary per column: median capture over the cells
with an honest ceiling ≥ 2 %, the minimum, cells more than 1 % behind the best baseline, the
seed spread (max − min of the seeds' speed-ups, percentage points), and the speed-up over the
untuned median static batch.

    python bench/grid_compare.py runs/grid.jsonl=planner bench/results/truth_grid.json=thresholds \
        runs/grid.jsonl:goodput-copus=goodput-copus --json bench/results/robust_goodput/grid_compare.json \
        > bench/results/robust_goodput/grid_compare.md
"""

from __future__ import annotations

import json
import statistics
import sys

UNTUNED = "median static B=128"


def load(path: str) -> dict[tuple, dict]:
    """Cells by (preset, truth, R); `A+B`: the files' seeds pooled per cell (`pool`)."""
    if "+" in path:
        parts = [load(p) for p in path.split("+")]
        return {k: pool([p[k] for p in parts]) for k in set.intersection(*(set(p) for p in parts))}
    if path.endswith(".jsonl"):
        cells = [json.loads(line) for line in open(path) if line.strip()]
    else:
        cells = json.load(open(path))["cells"]
    return {(c["preset"], c["truth"], float(c["crit_ratio"])): c for c in cells}


def pool(cells: list[dict]) -> dict:
    """One cell from the same cell's runs on disjoint seeds: every variant's speed-up is the mean
    over all seeds, its capture that over the mean ceiling, its spread max − min over all seeds;
    the speed-ups over the untuned choices are seed-weighted means."""
    per_seed_ceiling = [x for c in cells for x in c["honest_ceiling_per_seed_pct"]]
    ceiling = statistics.fmean(per_seed_ceiling)
    out = dict(cells[0]) | {
        "seeds": [s for c in cells for s in c["seeds"]],
        "honest_ceiling_pct": ceiling,
        "honest_ceiling_per_seed_pct": per_seed_ceiling,
        "ceiling_ge_2pct": ceiling >= 2.0,
        "variants": {},
    }
    for name in set.intersection(*(set(c["variants"]) for c in cells)):
        vs = [c["variants"][name] for c in cells]
        per_seed = [x for v in vs for x in v["per_seed_pct"]]
        n = [len(v["per_seed_pct"]) for v in vs]
        untuned = set.intersection(*(set(v.get("vs_untuned_pct", {})) for v in vs))
        speedup = statistics.fmean(per_seed)
        out["variants"][name] = {
            "speedup_pct": speedup,
            "capture": speedup / ceiling if ceiling else float("nan"),
            "per_seed_pct": per_seed,
            "seed_spread_pct": max(per_seed) - min(per_seed),
            "vs_untuned_pct": {
                u: sum(k * v["vs_untuned_pct"][u] for k, v in zip(n, vs)) / sum(n) for u in sorted(untuned)
            },
        }
    return out


def summary(cells: list[dict], variant: str) -> dict:
    """The goals of one column over `cells`."""
    v = [c["variants"][variant] for c in cells]
    counted = [x["capture"] for c, x in zip(cells, v) if c["honest_ceiling_pct"] >= 2.0]
    spreads = [x.get("seed_spread_pct", 0.0) for x in v]
    untuned = [x["vs_untuned_pct"][UNTUNED] for x in v if UNTUNED in x.get("vs_untuned_pct", {})]
    return {
        "cells": len(cells),
        "cells_counted": len(counted),
        "median_capture": statistics.median(counted) if counted else None,
        "min_capture": min(counted) if counted else None,
        "cells_below_0.5": sum(x < 0.5 for x in counted),
        "cells_behind_1pct": sum(x["speedup_pct"] < -1.0 for x in v),
        "median_seed_spread_pct": statistics.median(spreads),
        "max_seed_spread_pct": max(spreads),
        "median_vs_untuned_pct": statistics.median(untuned) if untuned else None,
    }


def main(argv: list[str]) -> int:
    json_path = None
    if "--json" in argv:  # also write the per-column goals as a JSON file
        i = argv.index("--json")
        json_path, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    cols = []
    for spec in argv:
        spec, _, label = spec.partition("=")
        path, _, variant = spec.partition(":")
        cols.append((label or spec, variant or "goodput", load(path)))
    keys = sorted(set.intersection(*(set(c[2]) for c in cols)))
    print("| preset | truth | R | ceiling % | " + " | ".join(f"{lab} % (capture; spread)" for lab, _, _ in cols) + " |")
    print("|---|---|---|---|" + "---|" * len(cols))
    for k in keys:
        row = f"| {k[0]} | {k[1]} | {k[2]:g} | {cols[0][2][k]['honest_ceiling_pct']:.1f} |"
        for _, var, cells in cols:
            x = cells[k]["variants"][var]
            row += f" {x['speedup_pct']:+.1f} ({x['capture']:+.2f}; {x.get('seed_spread_pct', 0.0):.1f}) |"
        print(row)
    print()
    out = {}
    for lab, var, cells in cols:
        out[lab] = summary([cells[k] for k in keys], var)
        s = out[lab]
        print(
            f"- **{lab}**: median capture {s['median_capture']:+.2f} over {s['cells_counted']} cells with ceiling ≥ 2 %"
            f" (min {s['min_capture']:+.2f}, {s['cells_below_0.5']} below 0.5); {s['cells_behind_1pct']} of"
            f" {s['cells']} cells > 1 % behind the best baseline; seed spread median {s['median_seed_spread_pct']:.1f},"
            f" max {s['max_seed_spread_pct']:.1f} points; vs the untuned {UNTUNED}: median"
            f" {s['median_vs_untuned_pct']:+.1f} %"
        )
    print()
    print("```json")
    print(json.dumps(out, indent=1))
    print("```")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"columns": out, "cells": [list(k) for k in keys]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
