"""Trace the calibration posterior of one simulated goodput run, window by window.

For one preset × truth × crit-ratio × seed, runs the default goodput controller alone and prints,
per closed calibration window (`CalibrationPosterior.experiments`): its step range, batches,
the window's own best c (c_ml), the posterior's median and 5–95 % interval after it, and the
truth's c relative to what the estimator reads, c_eff = B_crit(L) / φ_measured (median over the
window: the c the posterior without the lag model should find; the truth's c = B_crit / b_noise_true
is `--crit-ratio`, but the EMA'd estimator lags a growing noise scale) and c_lag = B_crit(t) /
φ_measured(t + lag), the c of the posterior's lag-modelled clock (`lag_steps`, docs §6.13).
`--dump` writes every step (reported loss,
true loss, batch, φ, B_crit, the truth's progress) as JSON for offline refits.

    PYTHONPATH=src python bench/posterior_trace.py --preset 7b-32xmi210 --truth sqrt-lr \
        --crit-ratio 1 --seed 2 [--dump runs/post/trace.json]
"""

from __future__ import annotations

import argparse
import json
import math


def trace(preset_name: str, truth: str, ratio: float, seed: int, posterior_options: dict | None = None) -> dict:
    """Run the goodput controller on one cell; return its per-step log and the posterior rows."""
    from dataclasses import replace

    from copus.commands.simulate import _preset
    from copus.core.sim.presets import get_preset
    from copus.core.sim.scenario import Planner, default_policy_factory
    from copus.core.sim.simulator import simulate
    from copus.core.sim.trajectory import Trajectory

    args = argparse.Namespace(truth="fitted", crit_ratio=None, seed=0, reconfig="online", no_lr_aware=False)
    sc = _preset(get_preset(preset_name), args, truth, ratio, seed)
    planner = Planner(sc)
    variant = [v for v in sc.variants() if v.name == "goodput"][0]
    if posterior_options:
        variant = replace(variant, controller=tuple(variant.controller) + (("posterior_options", posterior_options),))
    factory = default_policy_factory(sc)
    start = planner.fastest_plan(sc.initial_batch, sc.start_layout)
    if variant.start == "planner":
        start = planner.fastest_plan(sc.initial_batch) or start
        ask = getattr(factory("goodput", start, planner, variant), "start_plan", None)
        start = ask() if ask is not None else start
    policy = factory("goodput", start, planner, variant)
    traj = Trajectory(sc.sim.trajectory, sc.shape.seq_len)
    steps: list[dict] = []
    state = {"progress": 0.0, "loss": traj.loss(0.0), "tokens": 0}

    def on_record(rec) -> None:
        b = rec.plan.global_batch_size
        dp = traj.progress_per_step(b, state["loss"], state["tokens"])
        bcrit = traj.critical_batch(state["loss"])
        state["progress"] += dp
        state["loss"] = traj.loss(state["progress"])
        state["tokens"] = rec.tokens
        steps.append(
            {
                "step": rec.step,
                "batch": b,
                "loss": rec.loss,
                "true_loss": state["loss"],
                "b_noise": rec.b_noise,
                "bcrit": bcrit,
                "progress": state["progress"],
                "tokens": rec.tokens,
                "dE_tuned": b * bcrit / (bcrit + b),
                "dE": dp,
            }
        )

    res = simulate(
        policy,
        start,
        sc.shape,
        planner.step_time_model,
        sc.sim,
        name="goodput",
        switch_cost_s=planner.switch_cost_s,
        on_record=on_record,
    )
    events = [e for e in getattr(policy, "events", []) if e.get("event") == "calibration"]
    lag = int(getattr(getattr(policy, "posterior", None), "lag_steps", 0) or 0)
    return {"steps": steps, "windows": events, "wall_s": res.wall_s, "reached": res.time_to_target_s, "lag": lag}


def summarise(out: dict) -> None:
    """One line per closed window. With the posterior's lag line (`lag_steps` = lag), a window
    closed at step `end` holds steps end − lag − n + 1 … end − lag, and the c it should find is
    c_lag = B_crit(t)/φ_measured(t + lag) (= the truth's R when φ(t + lag) ≈ φ_true(t));
    c_eff = B_crit(t)/φ_measured(t) is the c of the clock without the lag model."""
    steps, lag = out["steps"], int(out.get("lag", 0))
    by_step = {s["step"]: s for s in steps}
    print(f"lag_steps {lag} (a window with a modelled lag uses its own row's lag_steps)")
    print(
        f"{'end':>5} {'n':>4} {'batches':<22} {'c_ml':>7} {'median':>7} {'p05':>6} {'p95':>7} {'c_eff':>6} "
        f"{'clock':>6} {'c_lag':>6}"
    )

    def med(xs: list[float]) -> float:
        xs = sorted(x for x in xs if math.isfinite(x))
        return xs[len(xs) // 2] if xs else float("nan")

    def ok(r: dict | None) -> bool:
        return r is not None and bool(r["b_noise"]) and math.isfinite(r["b_noise"])

    for w in out["windows"]:
        lag = int(w.get("lag_steps", lag))  # the lag line's length when the window closed
        end, n = w["step"] - lag, w["steps"]
        rows = [by_step[k] for k in range(end - n + 1, end + 1) if k in by_step]
        ce = med([r["bcrit"] / r["b_noise"] for r in rows if ok(r)])
        cl = med([r["bcrit"] / by_step[r["step"] + lag]["b_noise"] for r in rows if ok(by_step.get(r["step"] + lag))])
        bs = ",".join(str(int(b)) for b in w["batches"])
        print(
            f"{end:>5} {n:>4} {bs:<22} {w['c_ml']:>7.2f} {w['median']:>7.2f} "
            f"{w['p05']:>6.2f} {w['p95']:>7.2f} {ce:>6.2f} {w['median'] / w.get('lag_ratio', 1.0):>6.2f} {cl:>6.2f}"
        )
    print(
        "wall_s", round(out["wall_s"], 1), "reached", {k: (round(v, 1) if v else v) for k, v in out["reached"].items()}
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="7b-32xmi210")
    ap.add_argument("--truth", default="sqrt-lr")
    ap.add_argument("--crit-ratio", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--posterior", default="", help="JSON CalibrationPosterior options")
    ap.add_argument("--dump", default="")
    ap.add_argument("--no-lag-model", action="store_true", help="no lag model in the clock (on since §6.18)")
    a = ap.parse_args()
    if a.no_lag_model:
        import copus.core.stats.calibration_posterior as posterior_module

        posterior_module.MODEL_ESTIMATOR_LAG = False
    out = trace(a.preset, a.truth, a.crit_ratio, a.seed, json.loads(a.posterior) if a.posterior else None)
    summarise(out)
    if a.dump:
        with open(a.dump, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
