"""`copus simulate --truth-grid`: the capture table over presets × truths × B_crit/b_noise ×
seeds (`core.sim.truth_grid`), printed as a table or as JSON."""

from __future__ import annotations

import argparse
import json
import sys


def run_grid(args: argparse.Namespace, policies: tuple[str, ...]) -> int:
    from copus.commands.simulate import _mean, _numbers, _preset, oracle_speedups
    from copus.core.sim import truth_grid as tg
    from copus.core.sim.presets import PRESETS, get_preset
    from copus.core.sim.simulator import compare_policies

    if "goodput" not in policies or not {"static", "cbs"} & set(policies):
        raise ValueError(f"--policies={args.policies!r} is invalid with --truth-grid; allowed: "
                         "goodput and at least one of static, cbs")
    names = list(PRESETS) if args.preset in (None, "all") else [get_preset(args.preset).name]
    ratios = _numbers(args.crit_ratios, "--crit-ratios")
    seeds = _numbers(args.seeds, "--seeds", int) if args.seeds is not None else [args.seed]
    cells = tg.grid_cells(names, tg.GRID_TRUTHS, ratios)

    def run_one(cell: tg.Cell, seed: int) -> dict:
        sc = _preset(PRESETS[cell.preset], args, cell.truth, cell.crit_ratio, seed)
        cmp_ = compare_policies(sc, policies)
        return {"seed": seed, "oracle_avg": _mean(oracle_speedups(cmp_)),
                "variants": {n: cmp_.average_speedup_pct(n) for n in cmp_.goodput_runs()}}

    def show(cell: dict) -> None:
        if args.json:
            return
        parts = [f"{n} {_pct(v['average_speedup_pct'])} ({_cap(v['capture'])})"
                 for n, v in cell["variants"].items()]
        print(f"{cell['preset']:12s} {cell['truth']:9s} R={cell['crit_ratio']:<4g} oracle "
              f"{_pct(cell['oracle_avg_pct']):>7s}  " + "  ".join(parts), flush=True)

    if not args.json:
        print(f"== truth grid: average speed-up over the fastest baseline (capture = / oracle), "
              f"mean of seeds {','.join(map(str, seeds))} ==")
    out = tg.run_grid(cells, seeds, run_one, show)
    variants = list(out[0]["variants"]) if out else []
    result = {"seeds": seeds, "crit_ratios": ratios, "cells": out,
              "goals": {n: tg.goals(out, n) for n in variants}}
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        for n in variants:
            g = result["goals"][n]
            print(f"{n}: median capture {_cap(g['median_capture'])} over {g['cells_counted']} "
                  f"cells with ceiling >= {tg.CEILING_FLOOR_PCT:g} %; min {_cap(g['min_capture'])}; "
                  f"below 0.6: {', '.join(g['cells_below_0.6']) or 'none'}; "
                  f"> 1 % behind the best baseline: {', '.join(g['cells_behind_1pct']) or 'none'}")
    return 0


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.1f}%"


def _cap(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"
