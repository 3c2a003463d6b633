"""The honest-yardstick grid, one JSON line per cell as it finishes (`copus simulate --truth-grid
--json` computes the same cells but writes only at the end): every preset × truth × ratio, the
seeds given, static + CBS + doubling baselines and the goodput variants (the default planning
controller and goodput-copus). Then the goals (`core.sim.truth_grid.yardstick_goals`).

    PYTHONPATH=src python bench/planner_grid.py --seeds 0,1,2 \
        --out bench/results/robust_goodput/planner_grid.jsonl
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> int:
    from copus.commands.simulate import _preset, yardstick_score
    from copus.core.sim import truth_grid as tg
    from copus.core.sim import yardstick as ys
    from copus.core.sim.presets import COPUS_PRESETS, get_preset
    from copus.core.sim.compare import compare_policies
    from copus.core.sim.scenario import Planner

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--ratios", default="0.5,1,2,4,8")
    ap.add_argument("--presets", default=",".join(COPUS_PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--settings",
        default="",
        help='JSON PolicySettings fields over the default goodput; "R*k" = the cell\'s '
        'ratio times k, e.g. \'{"calibration_mode": "fixed", "calibration": "R*1.3"}\'',
    )
    ap.add_argument(
        "--wide-ratio",
        type=float,
        default=None,
        help="the planner's posterior width (90 %% interval, fold) above which the batch moves by "
        "sqrt(2) rungs (default: the planner's; inf: never, the ablation of docs/robust-goodput.md §6.3)",
    )
    ap.add_argument(
        "--no-voi-experiments",
        action="store_true",
        help="the planner without its upward batch experiments priced by their value of information (the "
        "default since docs/robust-goodput.md §6.29; off before; --voi-experiments: accepted, the default)",
    )
    ap.add_argument("--voi-experiments", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--no-return",
        action="store_true",
        help="with the VoI experiments: an experiment's batch stays the floor once read (before "
        "docs/robust-goodput.md §6.28)",
    )
    ap.add_argument(
        "--repeat-growth",
        type=float,
        default=None,
        help="with the VoI experiments: the same experiment is taken again only once the noise scale has grown "
        "this many-fold (default: the planner's REPEAT_PHI_GROWTH, 0: any time; docs/robust-goodput.md §6.28)",
    )
    ap.add_argument(
        "--min-separation",
        type=float,
        default=None,
        help="with the VoI experiments: the least separation (standard deviations) an experiment's window must "
        "give the plan's most distant hypotheses of c (default: the planner's MIN_SEPARATION; 0 before "
        "docs/robust-goodput.md §6.29)",
    )
    ap.add_argument(
        "--experiment-wide-ratio",
        type=float,
        default=None,
        help="with the VoI experiments: price them only while the posterior's 90 %% interval of c spans more "
        "than this many-fold (default: experiments.EXPERIMENT_WIDE_RATIO, 1 since docs/robust-goodput.md §6.32: "
        "whenever no window is open; 8 before)",
    )
    ap.add_argument(
        "--outcome-points",
        type=int,
        default=None,
        help="with the VoI experiments: points over the window's outcome in the value of information (default: "
        "experiment_value.OUTCOME_POINTS; 1: the expected outcome only, before docs/robust-goodput.md §6.29)",
    )
    ap.add_argument(
        "--dither-half-steps",
        type=int,
        default=None,
        help="with the VoI experiments: run each as a square wave between its batch and the batch before it, "
        "this many steps per half-period (default: experiments.DITHER_HALF_STEPS, 0: the batch held; "
        "docs/robust-goodput.md §6.33)",
    )
    ap.add_argument(
        "--no-loss-offsets",
        action="store_true",
        help="the planner's window fit without the loss curve's offset E0 = f x the first read's clock "
        "(the offsets are the default since docs/robust-goodput.md §6.29; §6.27, §6.28)",
    )
    ap.add_argument("--loss-offsets", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--no-lag-model",
        action="store_true",
        help="the posterior over c does not model the noise-scale EMA's lag in its clock (the default "
        "since docs/robust-goodput.md §6.18; off before, §6.13)",
    )
    ap.add_argument(
        "--estimator",
        default="",
        help="the simulated runs' noise-scale estimator: ema | tracking (default: the simulator's)",
    )
    ap.add_argument(
        "--lr-rule-factor",
        action="store_true",
        help="the planner's off-by-default variant: the sqrt LR rule's overshoot factor in its rates, "
        "x0 learnt by the posterior (docs/robust-goodput.md §6.14)",
    )
    ap.add_argument(
        "--lr-full-factor",
        action="store_true",
        help="with --lr-rule-factor: the whole factor 2x - x^2, the gain of a scaled LR still below its "
        "optimum too, not only the overshoot (docs/robust-goodput.md §6.20)",
    )
    ap.add_argument(
        "--lr-marginal",
        action="store_true",
        help="with --lr-rule-factor: the plan over the marginal quantiles of c times the posterior-mean LR factor "
        "(docs/robust-goodput.md §6.14–§6.20) instead of joint (x0, c) hypotheses (§6.35)",
    )
    ap.add_argument(
        "--lr-prior",
        type=float,
        default=None,
        help="with --lr-rule-factor: the x0 rows' prior mass together (default: controller.SQRT_LR_PRIOR, 0.5)",
    )
    ap.add_argument(
        "--lr-x0",
        default="",
        help="with --lr-rule-factor: the x0 rows, comma-separated (default: controller.SQRT_LR_FRACTIONS); one "
        "value with --lr-prior 0.999 is the x0 known (docs/robust-goodput.md §6.36)",
    )
    ap.add_argument(
        "--prior-octaves",
        type=float,
        default=None,
        help="the planner's prior width over c, octaves (default: controller.PLANNER_PRIOR_OCTAVES, 2); 0.05 with "
        '--settings \'{"calibration": "R*1.3"}\' is c known, the posterior\'s LR rows still priced (§6.36)',
    )
    ap.add_argument(
        "--fixed-c-rows",
        action="store_true",
        help='with c given ("calibration_mode": "fixed") under the sqrt rule: the x0 rows priced around '
        "that c, the off-by-default variant controller.FIXED_C_LR_ROWS (docs/robust-goodput.md §6.36)",
    )
    ap.add_argument("--truths", default="", help="comma-separated truths (default: all of the grid's)")
    ap.add_argument(
        "--warmup-hold",
        choices=("all", "layout", "none"),
        default=None,
        help="what the planner defers to the end of the LR warm-up: layout switches and probes (the default), "
        "all decisions, or nothing (before docs/robust-goodput.md §6.19)",
    )
    args = ap.parse_args()
    if args.estimator:
        import copus.core.sim.simulator as simulator_module

        simulator_module.SIM_ESTIMATOR = args.estimator
    if args.no_lag_model:
        import copus.core.stats.calibration_posterior as posterior_module

        posterior_module.MODEL_ESTIMATOR_LAG = False
    if args.lr_rule_factor:
        import copus.core.control.controller as controller_module

        controller_module.LR_RULE_FACTOR = True
        controller_module.LR_OVERSHOOT_ONLY = not args.lr_full_factor
        if args.lr_prior is not None:
            controller_module.SQRT_LR_PRIOR = args.lr_prior
        if args.lr_x0:
            controller_module.SQRT_LR_FRACTIONS = tuple(float(x) for x in args.lr_x0.split(","))
        if args.lr_marginal:
            import copus.core.control.planner as planner_module

            planner_module.LR_JOINT = False
    import copus.core.control.experiments as experiments_module

    experiments_module.EXPERIMENTS = not args.no_voi_experiments
    if experiments_module.EXPERIMENTS:
        experiments_module.RETURN_AFTER_EXPERIMENT = not args.no_return
        if args.min_separation is not None:
            experiments_module.MIN_SEPARATION = args.min_separation
        if args.outcome_points is not None:
            from copus.core.control import experiment_value

            experiment_value.OUTCOME_POINTS = args.outcome_points
        if args.dither_half_steps is not None:
            experiments_module.DITHER_HALF_STEPS = args.dither_half_steps
        if args.experiment_wide_ratio is not None:
            experiments_module.EXPERIMENT_WIDE_RATIO = args.experiment_wide_ratio
        if args.repeat_growth is not None:
            experiments_module.REPEAT_PHI_GROWTH = args.repeat_growth
    if args.no_loss_offsets:
        import copus.core.control.controller as controller_module
        from copus.core.stats.calibration_posterior import DEFAULT_LOSS_OFFSETS

        controller_module.PLANNER_LOSS_OFFSETS = DEFAULT_LOSS_OFFSETS
    if args.fixed_c_rows:
        import copus.core.control.controller as controller_module

        controller_module.FIXED_C_LR_ROWS = True
    if args.prior_octaves is not None:
        import copus.core.control.controller as controller_module

        controller_module.PLANNER_PRIOR_OCTAVES = args.prior_octaves
    if args.warmup_hold is not None:
        import copus.core.control.planner as planner_module

        planner_module.WARMUP_HOLD = args.warmup_hold
    if args.wide_ratio is not None:
        import copus.core.control.planner as planner_module

        planner_module.WIDE_RATIO = args.wide_ratio
    seeds = [int(s) for s in args.seeds.split(",")]
    truths = args.truths.split(",") if args.truths else tg.GRID_TRUTHS
    cells = tg.grid_cells(args.presets.split(","), truths, [float(r) for r in args.ratios.split(",")])
    sim_args = argparse.Namespace(truth="fitted", crit_ratio=None, seed=0, reconfig="online", no_lr_aware=False)
    policies = ("static", "cbs", "doubling", "goodput")
    out = []
    with open(args.out, "w") as f:
        for cell in cells:
            t0, yard, runs = time.perf_counter(), None, []
            preset = get_preset(cell.preset)
            if args.settings:
                _override_default(json.loads(args.settings), cell.crit_ratio)
            for seed in seeds:
                sc = _preset(preset, sim_args, cell.truth, cell.crit_ratio, seed)
                planner = Planner(sc)
                cmp_ = compare_policies(sc, policies, planner=planner)
                yard = yard or ys.build(sc, planner, horizon_tokens=preset.token_budget)
                runs.append(yardstick_score(preset, cmp_, planner, yard=yard))
            summary = tg.summarise_yardstick(cell, runs)
            out.append(summary)
            f.write(json.dumps(summary) + "\n")
            f.flush()
            v = summary["variants"]
            print(
                f"{cell.preset:12s} {cell.truth:9s} R={cell.crit_ratio:<4g} ceiling "
                f"{summary['honest_ceiling_pct']:+.1f} "
                + "  ".join(f"{n} {v[n]['speedup_pct']:+.1f} ({v[n]['capture']:.2f})" for n in v)
                + f"  {time.perf_counter() - t0:.0f}s",
                flush=True,
            )
    for name in out[0]["variants"] if out else []:
        print(name, json.dumps(tg.yardstick_goals(out, name)))
    return 0


def _override_default(settings: dict, ratio: float) -> None:
    """`copus simulate`'s default goodput variant with `settings` on top (for this cell)."""
    from dataclasses import replace

    import copus.commands.simulate as sim

    base = getattr(sim, "_plain_default", sim.default_variant)
    sim._plain_default = base
    value = {k: ratio * float(v[2:]) if isinstance(v, str) and v.startswith("R*") else v for k, v in settings.items()}

    def patched(no_lr_aware: bool = False):
        v = base(no_lr_aware)
        return replace(v, settings=tuple(dict(v.settings, **value).items()))

    sim.default_variant = patched


if __name__ == "__main__":
    raise SystemExit(main())
