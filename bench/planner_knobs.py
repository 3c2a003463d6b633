"""Does a removed threshold help the planning controller? Each knob put back, on the honest yardstick.

The planning controller (core/control/planner.py) replaced a stack of thresholds. This bench puts
each one back on top of the planner (a subclass here, not in the library) and scores every
variant on the honest yardstick (`copus simulate`'s `yardstick_score`: speed-up in time to the
final target over the best baseline, capture = that / the honest ceiling):

  margin10   COPUS's 10 % margin: a layout change only when the plan's expected time to the end
             improves by > 10 %, a batch change only when its expected rate does
  batch2     the old 2 % margin on batch changes only
  growth2    at most 2x the batch per decision
  lcb        the noise scale at its lower confidence bound φ·exp(−1.645·rel_err)
  hold20     no decision for 20 steps after a batch change

    PYTHONPATH=src python bench/planner_knobs.py --ratios 0.5,2,8 --seeds 0 \
        --out bench/results/robust_goodput/planner_knobs_seed0.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from dataclasses import replace

import numpy as np

KNOBS = {
    "plan": {},
    "margin10": {"margin": 0.10, "batch_margin": 0.10},
    "batch2": {"batch_margin": 0.02},
    "growth2": {"growth_cap": 2.0},
    "lcb": {"z": 1.645},
    "hold20": {"hold": 20},
}


def knob_planner():
    """PlanningController with the old thresholds as options (bench only)."""
    from copus.core.control.planner import PlanningController

    class KnobPlanner(PlanningController):
        def __init__(self, *, margin=0.0, batch_margin=0.0, growth_cap=math.inf, z=0.0, hold=0, **kw):
            self.k_margin, self.k_batch_margin, self.k_growth = margin, batch_margin, growth_cap
            self.k_z, self.k_hold, self.k_changed = z, hold, -(10**9)
            super().__init__(**kw)

        def observe(self, record):
            if record.plan.global_batch_size != self.plan.global_batch_size:
                self.k_changed = record.step
            if record.step - self.k_changed < self.k_hold:
                self._account(record)
                self._add_chunk(record)
                return None
            return super().observe(record)

        def _add_chunk(self, record):
            if self.k_z > 0 and math.isfinite(record.b_noise_rel_err):
                record = replace(record, b_noise=record.b_noise * math.exp(-self.k_z * record.b_noise_rel_err))
            super()._add_chunk(record)

        def ladder(self, idx):
            idx = super().ladder(idx)
            cap = self.k_growth * self.plan.global_batch_size
            keep = idx[self.candidates.global_batch_size[idx] <= cap + 1e-9]
            return keep if len(keep) else idx

        def _choose(self, h, bc_now, w, step_s, extra):
            out = super()._choose(h, bc_now, w, step_s, extra)
            cur_lay, cur = self._key_index(self.plan), self.candidates.index_of(self.plan)
            if cur_lay is None or cur is None:
                return out
            total = out["J"]
            if out["layout"] != cur_lay and total[cur_lay] - total[out["layout"]] <= self.k_margin * total[cur_lay]:
                on = self.ladder(np.flatnonzero(self._ids == cur_lay))
                out["layout"], out["index"] = cur_lay, int(on[np.argmax(out["score"][on])])
            i = out["index"]
            if out["layout"] == cur_lay and out["score"][i] <= (1 + self.k_batch_margin) * out["score"][cur]:
                out["index"] = cur
            return out

    return KnobPlanner


def main() -> int:
    from copus.core.sim.presets import PRESETS

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ratios", default="0.5,2,8")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--presets", default=",".join(p for p in PRESETS if p != "olmo-long"))
    ap.add_argument("--truths", default="lr-tuned,sqrt-lr")
    ap.add_argument("--knobs", default=",".join(KNOBS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cells = list(
        itertools.product(
            args.presets.split(","),
            args.truths.split(","),
            [float(x) for x in args.ratios.split(",")],
            [int(s) for s in args.seeds.split(",")],
        )
    )
    knobs = args.knobs.split(",")
    rows = [_run_cell(c, knobs) for c in cells]
    for name in knobs:
        caps = [r["capture"][name] for r in rows if r["ceiling_ge_2pct"]]
        behind = [r for r in rows if r["speedup_pct"][name] < -1.0]
        print(
            f"{name}: median capture {statistics.median(caps):.2f}, min {min(caps):.2f} "
            f"({len(caps)} cells with ceiling >= 2 %), {len(behind)} cells > 1 % behind"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "command": "python bench/planner_knobs.py "
                    + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v and k != "out"),
                    "knobs": {k: KNOBS[k] for k in knobs},
                    "cells": rows,
                },
                f,
                indent=1,
            )
    return 0


def _run_cell(cell, knobs) -> dict:
    import copus.core.control.controller as ctl
    from copus.commands.simulate import default_variant, yardstick_score
    from copus.core.sim.presets import PRESETS
    from copus.core.sim.compare import compare_policies
    from copus.core.sim.scenario import Planner, preset_scenario

    ctl.PlanningController = knob_planner()
    pname, truth, ratio, seed = cell
    preset = PRESETS[pname]
    base = default_variant()
    variants = tuple(
        replace(base, name=k, controller=tuple(dict(base.controller, planner_options=KNOBS[k]).items())) for k in knobs
    )
    sc = preset_scenario(
        preset, seed=seed, variants=variants, trajectory=preset.truth(truth).with_(gns_calibration=ratio)
    )
    t0 = time.perf_counter()
    planner = Planner(sc)
    cmp_ = compare_policies(sc, ("static", "cbs", "goodput"), planner=planner)
    score = yardstick_score(preset, cmp_, planner)
    ceiling = score["honest_ceiling_pct"]
    row = {
        "preset": pname,
        "truth": truth,
        "crit_ratio": ratio,
        "seed": seed,
        "honest_ceiling_pct": ceiling,
        "ceiling_ge_2pct": score["ceiling_ge_2pct"],
        "speedup_pct": {k: score["variants"][k]["speedup_pct"] for k in knobs},
        "capture": {k: score["variants"][k]["capture"] for k in knobs},
    }
    print(
        f"{pname:12s} {truth:9s} R={ratio:<4g} s{seed} ceiling {ceiling:+5.1f}  "
        + "  ".join(f"{k} {row['speedup_pct'][k]:+.1f}" for k in knobs)
        + f"  {time.perf_counter() - t0:.0f}s",
        flush=True,
    )
    return row


if __name__ == "__main__":
    raise SystemExit(main())
