"""The long pre-training truth (`--preset olmo-long`) over seeds: JSON summary + markdown table.

    for s in 0 1 2; do PYTHONPATH=src nice copus simulate --preset olmo-long --seed $s \
        --policies cbs,doubling,goodput --json > runs/olmo_s$s.json; done
    python bench/olmo_long_table.py bench/results/olmo_long.json runs/olmo_s{0,1,2}.json \
        > bench/results/olmo_long.md

The summary is `core.sim.truth_grid.summarise_yardstick` of the per-seed yardstick scores
(docs/yardstick.md §5, §7.3), plus every baseline's minutes to the final target per seed.
The deterministic part (statics, schedules, the true-critical-batch doubling, the ceiling) is
rebuilt with the current code; the simulated runs (CBS, measured doubling, goodput) are read
from each seed's JSON.
"""

from __future__ import annotations

import json
import sys

sys.path.insert(0, "src")

from copus.core.sim import truth_grid as tg  # noqa: E402


def _f(x, fmt="+.1f"):
    return "–" if x is None else format(x, fmt)


def _rescore(run: dict) -> dict:
    """The seed's yardstick score with the deterministic part rebuilt by the current code."""
    import argparse

    from copus.commands.simulate import _preset
    from copus.core.sim import yardstick as ys
    from copus.core.sim.presets import get_preset
    from copus.core.sim.scenario import Planner

    old = run["yardstick"]
    preset = get_preset(run["preset"])
    args = argparse.Namespace(
        truth=run["truth"], crit_ratio=run["crit_ratio"], seed=run["seed"], reconfig="online", no_lr_aware=False
    )
    sc = _preset(preset, args)
    yard = ys.build(sc, Planner(sc), horizon_tokens=preset.token_budget)
    simulated = {
        k: v
        for k, v in old["baselines"].items()
        if k.startswith(("cbs", "doubling dp", "static B=")) and "full menu" not in k
    }
    variants = {k: v["minutes"] for k, v in old["variants"].items()}
    return ys.score(yard, simulated, variants) | {"seed": run["seed"]}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python bench/olmo_long_table.py OUT.json SEED.json ...", file=sys.stderr)
        return 2
    runs = [json.load(open(p)) for p in argv[1:]]
    scores = [_rescore(r) for r in runs]
    cell = tg.Cell(runs[0]["preset"], runs[0]["truth"], float(runs[0]["crit_ratio"]))
    summary = tg.summarise_yardstick(cell, scores)
    final = scores[0]["final_target"]
    baselines = {name: [s["baselines"][name][-1] for s in scores] for name in scores[0]["baselines"]}
    summary["baseline_minutes_to_final"] = baselines
    summary["variant_minutes_to_final"] = {
        n: [s["variants"][n]["minutes"][-1] for s in scores] for n in scores[0]["variants"]
    }
    with open(argv[0], "w") as f:
        json.dump(summary, f, indent=1)
    print(
        f"# olmo-long ({cell.truth}, R = {cell.crit_ratio:g}): minutes to the final target "
        f"L = {final:g}, seeds {', '.join(str(s['seed']) for s in scores)}\n"
    )
    print(
        f"Honest ceiling {_f(summary['honest_ceiling_pct'])} % over the best baseline "
        f"({', '.join(sorted(set(summary['best_baseline'])))}; "
        f"{_f(summary['best_baseline_minutes'], '.1f')} min).\n"
    )
    print("| run | minutes per seed | speed-up over the best baseline | capture | seed spread |")
    print("|---|---|---|---|---|")
    for name, v in summary["variants"].items():
        mins = summary["variant_minutes_to_final"][name]
        print(
            f"| {name} | {' / '.join(_f(m, '.1f') for m in mins)} | {_f(v['speedup_pct'])} % | "
            f"{_f(v['capture'], '.2f')} | {_f(v['seed_spread_pct'], '.1f')} |"
        )
    for name, mins in baselines.items():
        print(f"| {name} | {' / '.join(_f(m, '.1f') for m in mins)} | | | |")
    print()
    for name, v in summary["variants"].items():
        print(
            f"- {name} over the untuned choices: " + ", ".join(f"{k} {_f(x)} %" for k, x in v["vs_untuned_pct"].items())
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
