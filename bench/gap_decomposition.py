"""Where the default goodput loses time against the oracle on the truth grid (issue 26).

For every preset × truth × B_crit/b_noise ratio R × seed, the default goodput run (as
`copus simulate --truth-grid` runs it) and the same controller with c fixed at its best value
for the estimator (R·1.3: the estimator reads about R/1.3 of the truth's B_crit/c at the
decision points, docs/robust-goodput.md §5) are split by `core.sim.gap` into minutes lost on the
batch, on the layout and in switches, up to the last target, next to the gap to the oracle
(the rest is the sqrt-LR truth's token-counted warm-up, which the oracle runs at a large batch).

    PYTHONPATH=src python bench/gap_decomposition.py --seeds 0,1,2 --jobs 2 \
        --out bench/results/gap_decomposition.json

Writes the JSON and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

PARTS = ("batch", "layout", "switch", "rest")


def _variants(ratio: float):
    from copus.commands.simulate import default_variant

    base = default_variant()
    known = replace(
        base,
        name="known-c",
        settings=tuple(dict(base.settings, calibration_mode="fixed", calibration=1.3 * ratio).items()),
    )
    return (base, known)


def run_cell(job) -> dict:
    """One cell and seed: minutes to the last target (oracle, each variant) and the split."""
    from copus.core.sim.gap import run_gap
    from copus.core.sim.oracle import scenario_oracle_minutes
    from copus.core.sim.presets import PRESETS
    from copus.core.sim.compare import compare_policies
    from copus.core.sim.scenario import Planner, preset_scenario

    pname, truth, ratio, seed = job
    preset = PRESETS[pname]
    sc = preset_scenario(
        preset, seed=seed, variants=_variants(ratio), trajectory=preset.truth(truth).with_(gns_calibration=ratio)
    )
    sc = replace(sc, sim=replace(sc.sim, keep_records=True))
    planner = Planner(sc)
    cmp_ = compare_policies(sc, ("goodput",), planner=planner)
    oracle = scenario_oracle_minutes(sc, planner=planner)[-1]
    last = min(sc.sim.target_losses)
    row = {"preset": pname, "truth": truth, "crit_ratio": ratio, "seed": seed, "oracle_min": oracle, "variants": {}}
    for name in cmp_.goodput_runs():
        res = cmp_.run(name)
        t = res.time_to_target_s[last]
        gap = run_gap(sc, res, planner)
        total = None if t is None or oracle is None else t / 60.0 - oracle
        parts = {"batch": gap.batch_s / 60.0, "layout": gap.layout_s / 60.0, "switch": gap.switch_s / 60.0}
        parts["rest"] = None if total is None else total - sum(parts.values())
        row["variants"][name] = {
            "minutes": None if t is None else t / 60.0,
            "gap_min": total,
            "parts_min": parts,
            "switches": len(res.switch_costs_s),
        }
    return row


def table(rows: list[dict]) -> str:
    """Mean over seeds per cell: gap to the oracle and its parts, minutes."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["preset"], r["truth"], r["crit_ratio"]), []).append(r)
    names = list(rows[0]["variants"])
    head = "| preset | truth | R | oracle min |" + "".join(
        f" {n}: gap | batch | layout | switch | rest |" for n in names
    )
    out = [head, "|" + "---|" * (4 + 5 * len(names))]
    totals = {n: {p: [] for p in ("gap", *PARTS)} for n in names}
    for (p, t, ratio), rs in cells.items():
        line = f"| {p} | {t} | {ratio:g} | {_mean([r['oracle_min'] for r in rs]):.1f} |"
        for n in names:
            gap = _mean([r["variants"][n]["gap_min"] for r in rs])
            parts = [_mean([r["variants"][n]["parts_min"][k] for r in rs]) for k in PARTS]
            line += f" {_f(gap)} |" + "".join(f" {_f(x)} |" for x in parts)
            for k, v in zip(("gap", *PARTS), (gap, *parts)):
                if v is not None:
                    totals[n][k].append(v)
        out.append(line)
    out.append("")
    for n in names:
        out.append(
            f"- {n}: median over cells, minutes: "
            + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in totals[n].items() if v)
        )
    return "\n".join(out) + "\n"


def main() -> int:
    from copus.core.sim.presets import PRESETS
    from copus.core.sim.truth_grid import GRID_RATIOS, GRID_TRUTHS

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--ratios", default=",".join(f"{r:g}" for r in GRID_RATIOS))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    jobs = list(
        itertools.product(
            args.presets.split(","),
            GRID_TRUTHS,
            [float(x) for x in args.ratios.split(",")],
            [int(s) for s in args.seeds.split(",")],
        )
    )
    t0 = time.perf_counter()
    if args.jobs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(args.jobs) as pool:
            rows = list(pool.imap(run_cell, jobs))
    else:
        rows = [run_cell(j) for j in jobs]
    md = table(rows)
    print(md)
    print(f"{len(rows)} runs in {time.perf_counter() - t0:.0f} s")
    if args.out:
        out = Path(args.out)
        out.write_text(
            json.dumps(
                {
                    "command": "python bench/gap_decomposition.py "
                    + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
                    "rows": rows,
                },
                indent=1,
            )
        )
        out.with_suffix(".md").write_text(md)
    return 0


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals and len(vals) == len(values) else None


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
