"""`copus simulate`: how much would copus save on my model and cluster? (no GPUs, no torch)

Runs every chosen policy on a simulated cluster (`copus.core.sim.compare`) and prints the time to
each target loss, the speed-up of goodput over the fastest baseline at each target (COPUS
Table 1 metric), and the plan timeline. `--preset NAME|all` runs COPUS's own configurations and
prints the published numbers next to the simulated ones: Table 1's minutes (published |
simulated) for every static, CBS and COPUS row, the COPUS-faithful goodput ("goodput-copus",
`core.sim.scenario.COPUS_FAITHFUL`) and copus's default goodput (the config defaults) side by
side, and each switch beside Table 2's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from copus.commands.config_defaults import TRAIN_KEYS, add_config_argument, fill_from_config
from copus.core.sim.compare import POLICY_FAMILIES


SIMULATE_DEFAULTS = {
    "model": "llama-3.2-3b",
    "seq_len": 0,
    "gpus": 8,
    "tokens": 1e9,
    "initial_batch": 16,
    "max_batch": 1024,
    "seed": 0,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, "simulate")
    p.add_argument(
        "--model",
        default=None,
        help="model shape name (core.models) or a Hugging Face config.json path (default llama-3.2-3b)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="sequence length in tokens (default: the model's; 2048 for a config.json)",
    )
    p.add_argument("--gpus", type=int, default=None, help="world size (default 8)")
    p.add_argument("--hardware", default="h100-nvlink-pairs", help="hardware profile name")
    p.add_argument("--target-loss", default="4.0,3.5,3.0", help="comma-separated target training losses")
    p.add_argument(
        "--policies", default=",".join(POLICY_FAMILIES), help=f"comma-separated subset of {','.join(POLICY_FAMILIES)}"
    )
    p.add_argument("--tokens", type=float, default=None, help="token budget of each run (default 1e9)")
    p.add_argument("--initial-batch", type=int, default=None, help="first global batch (samples; default 16)")
    p.add_argument("--max-batch", type=int, default=None, help="largest global batch (samples; default 1024)")
    p.add_argument(
        "--reconfig",
        choices=("online", "restart"),
        default="online",
        help="cost of a parallelism change: online resharding or checkpoint-restart",
    )
    p.add_argument(
        "--no-lr-aware", action="store_true", help="goodput without COPUS's sqrt(B) learning-rate factor (Eq. 8)"
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the simulated noise (default 0)")
    p.add_argument(
        "--preset",
        default=None,
        help="a COPUS configuration (core.sim.presets), 'olmo-long' (a long pre-training "
        "truth) or 'all' (COPUS's four)",
    )
    p.add_argument(
        "--truth",
        default="fitted",
        choices=("fitted", "lr-tuned", "sqrt-lr"),
        help="--preset: the ground truth (default: each preset's best-fitting one)",
    )
    p.add_argument(
        "--crit-ratio",
        type=float,
        default=None,
        metavar="R",
        help="--preset: the truth's B_crit / b_noise (default: the preset's fit)",
    )
    p.add_argument(
        "--truth-grid",
        action="store_true",
        help="every preset x truth (lr-tuned, sqrt-lr) x --crit-ratios; prints capture "
        "= goodput's speed-up to the final target / the honest ceiling per cell "
        "(docs/yardstick.md)",
    )
    p.add_argument("--crit-ratios", default="0.5,1,2,4,8", help="--truth-grid: comma-separated B_crit / b_noise values")
    p.add_argument(
        "--seeds", default=None, help="comma-separated noise seeds (--truth-grid: default 0; else overrides --seed)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", default=None, metavar="PNG", help="write loss/batch curves here")


def run(args: argparse.Namespace) -> int:
    from copus.core.sim.presets import COPUS_PRESETS, get_preset
    from copus.core.sim.compare import compare_policies
    from copus.core.sim.scenario import Planner

    fill_from_config(args, TRAIN_KEYS, SIMULATE_DEFAULTS)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    bad = [p for p in policies if p not in POLICY_FAMILIES]
    if bad or not policies:
        raise ValueError(
            f"--policies={args.policies!r} is invalid; allowed: a comma-separated subset of {','.join(POLICY_FAMILIES)}"
        )
    if args.crit_ratio is not None and not (math.isfinite(args.crit_ratio) and args.crit_ratio > 0):
        raise ValueError(f"--crit-ratio={args.crit_ratio!r} is invalid; allowed: a number > 0")
    if args.truth_grid:
        return _run_grid(args, policies)
    if args.seeds is not None:
        args.seed = _numbers(args.seeds, "--seeds", int)[0]
    if args.preset is not None:
        names = list(COPUS_PRESETS) if args.preset == "all" else [get_preset(args.preset).name]
        scenarios = [(get_preset(n), _preset(get_preset(n), args)) for n in names]
    else:
        scenarios = [(None, _custom(args))]
    out = []
    for preset, scenario in scenarios:
        planner = Planner(scenario)
        cmp_ = compare_policies(scenario, policies, planner=planner)
        if preset is not None:
            cmp_.yardstick = yardstick_score(preset, cmp_, planner)
        out.append((preset, cmp_))
        if not args.json:
            _print_comparison(preset, cmp_)
    if args.preset == "all" and not args.json:
        _print_summary(out)
    if args.json:
        json.dump([_json(p, c) for p, c in out] if len(out) > 1 else _json(*out[0]), sys.stdout, indent=1)
        print()
    if args.plot:
        _plot(out, args.plot)
        if not args.json:
            print(f"plot: {args.plot}")
    return 0


def default_variant(no_lr_aware: bool = False):
    """copus's own goodput controller: the defaults of the [batch], [gns] and [controller]
    keys (copus.config), as `copus train --policy goodput` runs it."""
    from copus.config import load_config
    from copus.core.control.policies import PolicySettings
    from copus.core.sim.scenario import GoodputVariant

    cfg = load_config()
    s, c = PolicySettings.from_config(cfg), cfg.controller
    return GoodputVariant(
        name="goodput",
        start="planner" if c.start == "planned" else "scenario",
        settings=tuple(
            (k, getattr(s, k))
            for k in ("max_growth", "interval_steps", "warmup_steps", "calibration", "calibration_mode", "max_rel_err")
        ),
        controller=(("lr_aware", c.lr_aware and not no_lr_aware),),
    )


def _preset(preset, args, truth: str | None = None, crit_ratio: float | None = None, seed: int | None = None):
    from copus.core.sim.scenario import COPUS_FAITHFUL, preset_scenario

    traj = preset.truth(truth or args.truth)
    ratio = crit_ratio if crit_ratio is not None else args.crit_ratio
    if ratio is not None:
        traj = traj.with_(gns_calibration=float(ratio))  # B_crit kept: only what GNS reads moves
    return preset_scenario(
        preset,
        seed=args.seed if seed is None else seed,
        reconfig_mode=args.reconfig,
        variants=(COPUS_FAITHFUL, default_variant(args.no_lr_aware)),
        trajectory=traj,
    )


def _numbers(text: str, flag: str, kind=float) -> list:
    """Comma-separated numbers of `flag`; ValueError naming the bad value."""
    try:
        out = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or (kind is float and not all(math.isfinite(x) and x > 0 for x in out)):
        allowed = "comma-separated integers" if kind is int else "comma-separated numbers > 0"
        raise ValueError(f"{flag}={text!r} is invalid; allowed: {allowed}")
    return out


def _custom(args):
    from copus.core.specs.resolve import get_model_shape
    from copus.core.sim.scenario import Scenario
    from copus.core.sim.simulator import SimSettings
    from copus.core.sim.trajectory import TrajectoryParams

    shape = get_model_shape(args.model, args.seq_len)
    try:
        targets = tuple(float(x) for x in args.target_loss.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--target-loss={args.target_loss!r} is invalid; allowed: comma-separated numbers") from None
    if args.gpus < 1:
        raise ValueError(f"--gpus={args.gpus} is invalid; allowed: an integer >= 1")
    traj = TrajectoryParams(initial_loss=max(math.log(shape.vocab_size), max(targets) + 0.5))
    low = [t for t in targets if t <= traj.final_loss]
    if low:
        raise ValueError(
            f"--target-loss {low[0]} is invalid; allowed: above the model's irreducible loss {traj.final_loss}"
        )
    sim = SimSettings(
        target_losses=targets,
        token_budget=int(args.tokens),
        trajectory=traj,
        seed=args.seed,
        reconfig_mode=args.reconfig,
    )
    return Scenario(
        shape=shape,
        hardware=args.hardware,
        world_size=args.gpus,
        sim=sim,
        initial_batch=args.initial_batch,
        max_batch=args.max_batch,
        batch_grid="geometric" if args.gpus > 64 else "multiples",
        lr_aware=not args.no_lr_aware,
    )


def _minutes(s: float | None) -> str:
    return "–" if s is None else f"{s / 60:.1f}"


def _print_comparison(preset, cmp_) -> None:
    if preset is not None:
        _print_preset(preset, cmp_)
        _print_yardstick(cmp_.yardstick)
        return
    sc = cmp_.scenario
    targets = sorted(sc.sim.target_losses, reverse=True)
    print(f"\n== {sc.shape.name} on {sc.world_size} x {sc.hardware}: minutes to target loss (seed {sc.sim.seed}) ==")
    width = max(len(r.name) for r in cmp_.results) + 2
    print("method".ljust(width) + "".join(f"{t:>8g}" for t in targets))
    for r in cmp_.results:
        print(r.name.ljust(width) + "".join(f"{_minutes(r.time_to_target_s[t]):>8}" for t in targets))
    rows = cmp_.speedups()
    print(
        "speed-up".ljust(width)
        + "".join(f"{'–' if r['speedup_pct'] is None else format(r['speedup_pct'], '+.1f') + '%':>8}" for r in rows)
        + f"   avg {_pct(cmp_.average_speedup_pct())}"
    )
    for name in cmp_.goodput_runs():
        r = cmp_.run(name)
        print(f"{name} plan timeline:")
        last = None
        for s in r.timeline:
            if s.plan.layout != last:
                print(
                    f"  {s.start_s / 60:7.1f} min  step {s.start_step:6d}  "
                    f"{s.plan.describe()}  loss {s.loss:.2f}  b_noise est "
                    f"{s.b_noise:.0f} (true {s.true_b_noise:.0f})"
                )
                last = s.plan.layout
        print(
            f"  {len(r.decisions)} decisions, {len(r.switch_costs_s)} parallelism changes "
            f"({sum(r.switch_costs_s):.0f} s), final B={r.timeline[-1].plan.global_batch_size}"
        )


def _print_yardstick(yard: dict | None) -> None:
    """The honest yardstick (docs/yardstick.md): time to the final target."""
    if yard is None:
        return
    best = yard["best_baseline"]
    print(
        f"honest yardstick ({yard['metric']} {yard['final_target']:g}): best baseline "
        f"{best['name']} {_cell(best['minutes'])} min; honest ceiling "
        f"{_pct(yard['honest_ceiling_pct'])} ({'counts' if yard['ceiling_ge_2pct'] else '< 2 %'})"
    )
    for name, v in yard["variants"].items():
        untuned = ", ".join(f"{k} {_pct(x)}" for k, x in v["vs_untuned_pct"].items())
        print(
            f"  {name}: {_pct(v['speedup_pct'])} (capture {_capture(v['capture'])}); over the untuned choice: {untuned}"
        )


def _cell(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def _print_preset(preset, cmp_) -> None:
    """Table 1 (published | simulated minutes per target), speed-ups, Table 2 timeline."""
    from copus.core.sim.table1 import table1_rows, timeline_rows

    sc = cmp_.scenario
    targets = sorted(sc.sim.target_losses, reverse=True)
    print(
        f"\n== {preset.description}: minutes to target loss, published | simulated "
        f"(seed {sc.sim.seed}, truth {_truth_label(preset, sc.sim.trajectory)}) =="
    )
    rows = table1_rows(preset, cmp_)
    width = max(len(r.label) for r in rows) + 2
    print("method".ljust(width) + "".join(f"{t:>14g}" for t in targets))
    for r in rows:
        pub = r.published or (None,) * len(targets)
        sim = r.simulated or (None,) * len(targets)
        print(
            r.label.ljust(width)
            + "".join(
                f"{(_cell(p) if r.published else '·'):>7}|{(_cell(q) if r.simulated else '·'):<6}"
                for p, q in zip(pub, sim)
            )
        )
    print("speed-up over the fastest baseline, published | simulated:")
    print(
        "  COPUS".ljust(width)
        + "".join(
            f"{p:>+6.1f}%|{_pct(q['speedup_pct']):<6}"
            for p, q in zip(preset.published_speedup_pct, cmp_.speedups(run="goodput-copus"))
        )
        + f"   avg {preset.published_avg_speedup_pct:+.1f}% | "
        f"{_pct(cmp_.average_speedup_pct('goodput-copus'))}"
    )
    for name in cmp_.goodput_runs():
        if name != "goodput-copus":
            print(
                f"  {name}".ljust(width)
                + "".join(f"{'':>7}|{_pct(q['speedup_pct']):<6}" for q in cmp_.speedups(run=name))
                + f"   avg {_pct(cmp_.average_speedup_pct(name))}"
            )
    ceiling = oracle_speedups(cmp_)
    print(
        "  oracle ceiling".ljust(width)
        + "".join(f"{'':>7}|{_pct(q):<6}" for q in ceiling)
        + f"   avg {_pct(_mean(ceiling))}"
        + "   (truth known, switches free: no policy can beat it)"
    )
    for name in cmp_.goodput_runs():
        run = cmp_.run(name)
        label = "COPUS" if name == "goodput-copus" else name
        print(
            f"layout timeline, Table 2 (COPUS) | simulated {label} "
            f"({len(run.switch_costs_s)} switches, {sum(run.switch_costs_s):.0f} s):"
        )
        for pub, sim in timeline_rows(preset, run):
            print(f"  {pub:32s}| {sim}")


def _truth_label(preset, params) -> str:
    name = next((n for n, t in preset.truths.items() if t == params), None)
    if name is not None:
        return name
    return next(
        (
            f"{n} (B_crit/b_noise {params.gns_calibration:g})"
            for n, t in preset.truths.items()
            if t.with_(gns_calibration=params.gns_calibration) == params
        ),
        "custom",
    )


def oracle_speedups(cmp_, minutes: list[float | None] | None = None) -> list[float | None]:
    """Per target (descending): the oracle's speed-up over the fastest simulated baseline
    (`minutes`: another ceiling's minutes per target, in `target_losses` order)."""
    from copus.core.sim.oracle import scenario_oracle_minutes, speedup_pct

    sc = cmp_.scenario
    minutes = dict(zip(sc.sim.target_losses, minutes if minutes is not None else scenario_oracle_minutes(sc)))
    out = []
    for target in sorted(sc.sim.target_losses, reverse=True):
        base = cmp_.best(target, ("static", "cbs"))[1]
        out.append(speedup_pct(None if base is None else base / 60.0, minutes[target]))
    return out


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.1f}%"


def _print_summary(out) -> None:
    print("\n== COPUS Table 1 summary: average time-to-target speed-up over the fastest baseline ==")
    names = [n for n in out[0][1].goodput_runs()]
    print(
        f"{'config':16s}{'truth':>10s}{'published':>11s}"
        + "".join(f"{'sim ' + n:>20s}" for n in names)
        + f"{'oracle ceiling':>16s}"
    )
    for preset, cmp_ in out:
        print(
            f"{preset.name:16s}{_truth_label(preset, cmp_.scenario.sim.trajectory):>10s}"
            f"{_pct(preset.published_avg_speedup_pct):>11s}"
            + "".join(f"{_pct(cmp_.average_speedup_pct(n)):>20s}" for n in names)
            + f"{_pct(_mean(oracle_speedups(cmp_))):>16s}"
        )


def yardstick_score(preset, cmp_, planner=None, yard=None) -> dict:
    """The honest yardstick of a preset's comparison (`core.sim.yardstick.score`): the best
    baseline, the honest ceiling and every goodput run's speed-ups on time to the final target."""
    from copus.core.sim import yardstick as ys
    from copus.core.sim.compare import BASELINE_FAMILIES
    from copus.core.sim.scenario import Planner

    sc = cmp_.scenario
    if yard is None:
        yard = ys.build(sc, planner or Planner(sc), horizon_tokens=preset.token_budget)
    targets = yard.targets
    simulated = {
        r.name: ys.seconds_to_minutes(r.time_to_target_s, targets)
        for r in cmp_.results
        if cmp_.families[r.name] in BASELINE_FAMILIES
    }
    variants = {n: ys.seconds_to_minutes(cmp_.run(n).time_to_target_s, targets) for n in cmp_.goodput_runs()}
    return ys.score(yard, simulated, variants) | {"seed": sc.sim.seed}


def _json(preset, cmp_) -> dict:
    d = cmp_.to_dict()
    yard = getattr(cmp_, "yardstick", None)
    if yard is not None:
        d["honest_ceiling_pct"] = yard["honest_ceiling_pct"]
        d["ceiling_ge_2pct"] = yard["ceiling_ge_2pct"]
        d["yardstick"] = yard
        for name, v in d["variants"].items():
            d["variants"][name] = {
                "table1_speedups": v["speedups"],
                "table1_average_speedup_pct": v["average_speedup_pct"],
            } | yard["variants"][name]
    if preset is not None:
        d["preset"] = preset.name
        d["truth"] = _truth_label(preset, cmp_.scenario.sim.trajectory)
        d["crit_ratio"] = cmp_.scenario.sim.trajectory.gns_calibration
        d["oracle_speedup_pct"] = oracle_speedups(cmp_)
        d["published"] = {
            "minutes": {k: list(v) for k, v in preset.published_minutes.items()},
            "speedup_pct": list(preset.published_speedup_pct),
            "average_speedup_pct": preset.published_avg_speedup_pct,
        }
    return d


def _plot(out, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(out), figsize=(6 * len(out), 7), squeeze=False)
    for col, (preset, cmp_) in enumerate(out):
        top, bottom = axes[0][col], axes[1][col]
        for r in cmp_.results:
            t = [p[0] / 60 for p in r.curve]
            top.plot(t, [p[1] for p in r.curve], label=r.name, lw=1.2)
            if cmp_.families[r.name] != "static":
                bottom.step(t, [p[2] for p in r.curve], where="post", label=r.name, lw=1.2)
        for target in cmp_.scenario.sim.target_losses:
            top.axhline(target, color="grey", lw=0.5, ls=":")
        sc = cmp_.scenario
        top.set_title(preset.name if preset else f"{sc.shape.name} x{sc.world_size}")
        top.set_ylabel("training loss")
        top.set_ylim(min(sc.sim.target_losses) - 0.3, max(sc.sim.target_losses) + 2.0)
        bottom.set_ylabel("global batch (samples)")
        bottom.set_yscale("log")
        bottom.set_xlabel("minutes")
        top.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_grid(args: argparse.Namespace, policies: tuple[str, ...]) -> int:
    """--truth-grid: the capture table (`core.sim.truth_grid`), as a table or JSON."""
    from copus.core.sim import truth_grid as tg
    from copus.core.sim.presets import COPUS_PRESETS, get_preset
    from copus.core.sim.compare import compare_policies

    if "goodput" not in policies or not {"static", "cbs"} & set(policies):
        raise ValueError(
            f"--policies={args.policies!r} is invalid with --truth-grid; allowed: "
            "goodput and at least one of static, cbs"
        )
    names = list(COPUS_PRESETS) if args.preset in (None, "all") else [get_preset(args.preset).name]
    ratios = _numbers(args.crit_ratios, "--crit-ratios")
    seeds = _numbers(args.seeds, "--seeds", int) if args.seeds is not None else [args.seed]
    cells = tg.grid_cells(names, tg.GRID_TRUTHS, ratios)

    yards: dict[tg.Cell, object] = {}  # the deterministic yardstick does not read the seed

    def run_one(cell: tg.Cell, seed: int) -> dict:
        from copus.core.sim import yardstick as ys
        from copus.core.sim.scenario import Planner

        preset = get_preset(cell.preset)
        sc = _preset(preset, args, cell.truth, cell.crit_ratio, seed)
        planner = Planner(sc)
        cmp_ = compare_policies(sc, policies, planner=planner)
        if cell not in yards:
            yards[cell] = ys.build(sc, planner, horizon_tokens=preset.token_budget)
        return yardstick_score(preset, cmp_, planner, yard=yards[cell])

    def show(cell: dict) -> None:
        if args.json:
            return
        parts = [
            f"{n} {_pct(v['speedup_pct'])} ({_capture(v['capture'])}, spread {_cell(v['seed_spread_pct'])})"
            for n, v in cell["variants"].items()
        ]
        print(
            f"{cell['preset']:12s} {cell['truth']:9s} R={cell['crit_ratio']:<4g} honest ceiling "
            f"{_pct(cell['honest_ceiling_pct']):>7s}{'' if cell['ceiling_ge_2pct'] else ' (<2 %)'}"
            f"  best baseline {cell['best_baseline'][0]}  " + "  ".join(parts),
            flush=True,
        )

    if not args.json:
        print(
            f"== truth grid: speed-up in time to the final target over the best baseline "
            f"(capture = / honest ceiling), mean of seeds {','.join(map(str, seeds))} =="
        )
    out = tg.run_yardstick_grid(cells, seeds, run_one, show)
    variants = list(out[0]["variants"]) if out else []
    result = {
        "seeds": seeds,
        "crit_ratios": ratios,
        "metric": out[0]["metric"] if out else None,
        "policies": list(policies),
        "cells": out,
        "goals": {n: tg.yardstick_goals(out, n) for n in variants},
    }
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        for n in variants:
            g = result["goals"][n]
            print(
                f"{n}: median capture {_capture(g['median_capture'])} over "
                f"{g['cells_counted']} of {g['cells']} cells with honest ceiling >= "
                f"{tg.CEILING_FLOOR_PCT:g} %; min {_capture(g['min_capture'])}; below 0.5: "
                f"{', '.join(g['cells_below_0.5']) or 'none'}; > 1 % behind the best "
                f"baseline: {', '.join(g['cells_behind_1pct']) or 'none'}"
            )
    return 0


def _capture(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"
