"""Issue 26 experiments: goodput variants side by side on the truth grid (docs/robust-goodput.md).

Each variant is the default goodput (`copus simulate`'s `default_variant`) with some
PolicySettings fields and controller options replaced, e.g. a fixed c (why the default lost)
or another prior / margin (how the new default was chosen). Seed 0 unless --seeds.

    PYTHONPATH=src python bench/robust_goodput_sweep.py --ratios 0.5,2,8 \
        --variants '{"c1": [{"calibration_mode": "fixed", "calibration": 1.0}]}' --out R.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import replace


def main() -> int:
    from copus.core.sim.presets import PRESETS

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ratios", default="0.5,2,8")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--variants", required=True, help="JSON {name: [settings, controller]} over the default goodput")
    ap.add_argument("--out", default=None)
    ap.add_argument("--jobs", type=int, default=1, help="cells run in this many processes")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--truths", default="lr-tuned,sqrt-lr")
    ap.add_argument(
        "--planner-start",
        action="store_true",
        help="goodput runs start on the planner's fastest plan, not the published one",
    )
    args = ap.parse_args()
    cells = list(
        itertools.product(
            args.presets.split(","),
            args.truths.split(","),
            [float(x) for x in args.ratios.split(",")],
            [int(s) for s in args.seeds.split(",")],
        )
    )
    jobs = [(c, args.variants, args.planner_start) for c in cells]
    if args.jobs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(args.jobs) as pool:
            rows = list(pool.imap(_run_cell, jobs))
    else:
        rows = [_run_cell(j) for j in jobs]
    for name in rows[0]["variants"]:
        caps = [
            (r["variants"][name] if r["variants"][name] is not None else -99.0) / r["oracle"]
            for r in rows
            if r["oracle"] >= 2.0
        ]
        print(
            f"{name}: median capture {statistics.median(caps):.2f}, min {min(caps):.2f} "
            f"({len(caps)} cells with ceiling >= 2 %)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _variants(spec: str, ratio: float, budget: float = 0.0):
    """The variants of one cell: a value "R*k" (a string) becomes the cell's ratio times k,
    "BUDGET*k" the preset's published token budget times k."""
    from copus.commands.simulate import default_variant
    from copus.core.sim.scenario import COPUS_FAITHFUL

    def value(v):
        if isinstance(v, str) and v.startswith("R*"):
            return ratio * float(v[2:])
        if isinstance(v, str) and v.startswith("BUDGET*"):
            return budget * float(v[7:])
        return v

    base = default_variant()
    out = [COPUS_FAITHFUL]
    for name, parts in json.loads(spec).items():
        sets, ctl = (parts + [{}, {}])[:2]
        sets = {k: value(v) for k, v in sets.items()}
        ctl = {k: value(v) for k, v in ctl.items()}
        out.append(
            replace(
                base,
                name=name,
                settings=tuple(dict(base.settings, **sets).items()),
                controller=tuple(dict(base.controller, **ctl).items()),
            )
        )
    return tuple(out)


def _run_cell(job) -> dict:
    from copus.commands.simulate import _mean, oracle_speedups
    from copus.core.sim.presets import PRESETS
    from copus.core.sim.compare import compare_policies
    from copus.core.sim.scenario import preset_scenario

    (pname, truth, ratio, seed), spec, planner_start = job
    preset = PRESETS[pname]
    sc = preset_scenario(
        preset,
        seed=seed,
        variants=_variants(spec, ratio, preset.token_budget),
        trajectory=preset.truth(truth).with_(gns_calibration=ratio),
    )
    if planner_start:
        sc = replace(sc, start_layout=None)
    t0 = time.perf_counter()
    cmp_ = compare_policies(sc, ("static", "cbs", "goodput"))
    row = {
        "preset": pname,
        "truth": truth,
        "crit_ratio": ratio,
        "seed": seed,
        "oracle": _mean(oracle_speedups(cmp_)),
        "variants": {n: cmp_.average_speedup_pct(n) for n in cmp_.goodput_runs()},
    }
    print(
        f"{pname:12s} {truth:9s} R={ratio:<4g} s{seed} oracle {row['oracle']:+5.1f}  "
        + "  ".join(f"{n} {_f(v)} ({_f(v, row['oracle'])})" for n, v in row["variants"].items())
        + f"  {time.perf_counter() - t0:.0f}s",
        flush=True,
    )
    return row


def _f(v, oracle=None) -> str:
    if v is None:
        return "–"
    return f"{v / oracle:.2f}" if oracle else f"{v:+.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
