"""`copus simulate --truth-grid`: every preset × ground truth × B_crit/b_noise × noise seed.

A controller that is right in one ground truth can be wrong in another (issue 26): the ratio
c = B_crit / b_noise of the truth decides when a larger batch pays, and the published runs do
not pin it down (docs/cost-model.md). The grid runs each preset (`core.sim.presets`) under both
LR truths (lr-tuned, sqrt-lr), with the truth's B_crit kept and its b_noise = B_crit / R for
every R in `ratios`, so that baselines, oracle and progress law stay those of the fitted truth
and only what the noise-scale estimator reads moves. Per cell:

    capture = (policy's average speed-up over the fastest baseline)
              / (the oracle's average speed-up over the same baselines)

averaged over the noise seeds first (numerator and denominator separately). The oracle
(`core.sim.oracle`) knows the truth and switches for free; a capture of 1 is the ceiling.
`capture_switch_aware` divides by the ceiling of a controller that knows the truth but pays the
scenario's switch cost per layout change (`oracle.scenario_switch_aware_minutes`).
Goals (issue 26): capture ≥ 0.6 in every cell whose ceiling is ≥ 2 %, ≥ 0.75 at the median,
and the policy's average never more than 1 % behind the best baseline.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

GRID_TRUTHS = ("lr-tuned", "sqrt-lr")
GRID_RATIOS = (0.5, 1.0, 2.0, 4.0, 8.0)
CEILING_FLOOR_PCT = 2.0  # cells below this ceiling do not count for the capture goals
MIN_CAPTURE, MEDIAN_CAPTURE, MAX_BEHIND_PCT = 0.6, 0.75, -1.0


@dataclass(frozen=True, slots=True)
class Cell:
    preset: str
    truth: str
    crit_ratio: float


def grid_cells(
    presets: Iterable[str], truths: Iterable[str] = GRID_TRUTHS, ratios: Iterable[float] = GRID_RATIOS
) -> list[Cell]:
    return [Cell(p, t, float(r)) for p in presets for t in truths for r in ratios]


def summarise_cell(cell: Cell, runs: list[dict]) -> dict:
    """One cell over its seeds. `runs`: per seed {"oracle_avg": %, "variants": {name: %}}."""
    oracle = _mean([r["oracle_avg"] for r in runs])
    aware = _mean([r.get("switch_aware_avg") for r in runs])
    names = list(runs[0]["variants"]) if runs else []
    out = {
        "preset": cell.preset,
        "truth": cell.truth,
        "crit_ratio": cell.crit_ratio,
        "seeds": [r["seed"] for r in runs],
        "oracle_avg_pct": oracle,
        "switch_aware_oracle_avg_pct": aware,
        "variants": {},
    }
    for name in names:
        avg = _mean([r["variants"][name] for r in runs])
        out["variants"][name] = {
            "average_speedup_pct": avg,
            "capture": _ratio(avg, oracle),
            "capture_switch_aware": _ratio(avg, aware),
            "per_seed_pct": [r["variants"][name] for r in runs],
        }
    return out


def _ratio(avg: float | None, ceiling: float | None) -> float | None:
    return avg / ceiling if avg is not None and ceiling is not None and ceiling > 0 else None


def goals(cells: list[dict], name: str) -> dict:
    """The issue's three goals for variant `name` over summarised cells (met / not met, and
    the cells that miss)."""
    counted = [c for c in cells if c["oracle_avg_pct"] is not None and c["oracle_avg_pct"] >= CEILING_FLOOR_PCT]
    caps = [c["variants"][name]["capture"] for c in counted]
    caps = [x if x is not None else float("-inf") for x in caps]
    low = [_label(c) for c, x in zip(counted, caps) if x < MIN_CAPTURE]
    behind = [_label(c) for c in cells if _behind(c["variants"][name]["average_speedup_pct"])]
    median = statistics.median(caps) if caps else None
    median = None if median is None else float(median)
    aware = [c["variants"][name].get("capture_switch_aware") for c in counted]
    aware = [x if x is not None else float("-inf") for x in aware]
    return {
        "variant": name,
        "cells_counted": len(counted),
        "median_capture": median,
        "min_capture": float(min(caps)) if caps else None,
        "every_cell_capture_ge_0.6": not low,
        "cells_below_0.6": low,
        "median_capture_ge_0.75": bool(median is not None and median >= MEDIAN_CAPTURE),
        # against the ceiling a run that pays for its switches can reach (core.sim.oracle)
        "median_capture_switch_aware": float(statistics.median(aware)) if aware else None,
        "never_more_than_1pct_behind": not behind,
        "cells_behind_1pct": behind,
    }


def run_grid(
    cells: list[Cell],
    seeds: list[int],
    run_one: Callable[[Cell, int], dict],
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Summarised cells; `run_one(cell, seed)` -> {"seed", "oracle_avg", "variants"}."""
    out = []
    for cell in cells:
        summary = summarise_cell(cell, [run_one(cell, s) for s in seeds])
        out.append(summary)
        if progress is not None:
            progress(summary)
    return out


def _behind(avg: float | None) -> bool:
    """More than 1 % behind the best baseline (a missed target counts as behind)."""
    return avg is None or avg < MAX_BEHIND_PCT


def _label(cell: dict) -> str:
    return f"{cell['preset']}/{cell['truth']}/R={cell['crit_ratio']:g}"


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if len(vals) == len(values) and vals else None


# ------------------------------------------------------------------ the honest yardstick (core.sim.yardstick)


def summarise_yardstick(cell: Cell, scores: list[dict]) -> dict:
    """One cell over its seeds from `core.sim.yardstick.score` results (each with "seed").

    capture = mean over seeds of the variant's speed-up / mean of the honest ceiling (both on
    time to the final target, against the same best baseline); the seed spread is max − min of
    the per-seed speed-ups."""
    ceilings = [s["honest_ceiling_pct"] for s in scores]
    ceiling = _mean(ceilings)
    names = list(scores[0]["variants"]) if scores else []
    first = scores[0] if scores else {}
    out = {
        "preset": cell.preset,
        "truth": cell.truth,
        "crit_ratio": cell.crit_ratio,
        "seeds": [s["seed"] for s in scores],
        "metric": first.get("metric"),
        "honest_ceiling_pct": ceiling,
        "honest_ceiling_per_seed_pct": ceilings,
        "ceiling_ge_2pct": bool(ceiling is not None and ceiling >= CEILING_FLOOR_PCT),
        "free_switch_ceiling_pct": _mean([s["free_switch_ceiling_pct"] for s in scores]),
        "best_baseline": [s["best_baseline"]["name"] for s in scores],
        "best_baseline_minutes": _mean([s["best_baseline"]["minutes"] for s in scores]),
        "variants": {},
    }
    for name in names:
        per = [s["variants"][name]["speedup_pct"] for s in scores]
        avg = _mean(per)
        vals = [v for v in per if v is not None]
        untuned_keys = list(scores[0]["variants"][name]["vs_untuned_pct"])
        out["variants"][name] = {
            "speedup_pct": avg,
            "capture": _ratio(avg, ceiling),
            "per_seed_pct": per,
            "seed_spread_pct": (max(vals) - min(vals)) if len(vals) == len(per) and vals else None,
            "per_seed_capture": [_ratio(v, c) for v, c in zip(per, ceilings)],
            "weighted_speedup_pct": _mean([s["variants"][name]["weighted_speedup_pct"] for s in scores]),
            "average_speedup_pct": _mean([s["variants"][name]["average_speedup_pct"] for s in scores]),
            "vs_untuned_pct": {
                k: _mean([s["variants"][name]["vs_untuned_pct"][k] for s in scores]) for k in untuned_keys
            },
        }
    return out


def yardstick_goals(cells: list[dict], name: str) -> dict:
    """The goals on the honest yardstick: over cells whose honest ceiling is ≥ 2 %, median
    capture ≥ 0.75 and every cell ≥ 0.5; in every cell at most 1 % behind the best baseline."""
    counted = [c for c in cells if c["ceiling_ge_2pct"]]
    caps = [c["variants"][name]["capture"] for c in counted]
    caps = [x if x is not None else float("-inf") for x in caps]
    low = [_label(c) for c, x in zip(counted, caps) if x < YARD_MIN_CAPTURE]
    behind = [_label(c) for c in cells if _behind(c["variants"][name]["speedup_pct"])]
    median = float(statistics.median(caps)) if caps else None
    return {
        "variant": name,
        "cells": len(cells),
        "cells_counted": len(counted),
        "median_capture": median,
        "min_capture": float(min(caps)) if caps else None,
        "median_capture_ge_0.75": bool(median is not None and median >= MEDIAN_CAPTURE),
        "every_cell_capture_ge_0.5": not low,
        "cells_below_0.5": low,
        "never_more_than_1pct_behind": not behind,
        "cells_behind_1pct": behind,
    }


YARD_MIN_CAPTURE = 0.5


def run_yardstick_grid(
    cells: list[Cell],
    seeds: list[int],
    run_one: Callable[[Cell, int], dict],
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Summarised cells; `run_one(cell, seed)` -> a `core.sim.yardstick.score` dict + "seed"."""
    out = []
    for cell in cells:
        summary = summarise_yardstick(cell, [run_one(cell, s) for s in seeds])
        out.append(summary)
        if progress is not None:
            progress(summary)
    return out
