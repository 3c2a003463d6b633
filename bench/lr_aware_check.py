"""Does a k·B run with sqrt(k)·LR make more progress per sample than E(B) predicts? (issue 14 part 3)

    python bench/lr_aware_check.py --from runs/ttt_static [--base 8] [--out bench/results/lr_aware_check.json]

Reads the static-B runs of bench/time_to_target.py (same seed, data order, token schedule; LR
= lr·sqrt(B/B0)): branches from the same start (step 0) at k·B0 with the square-root LR rule.
For each target loss (the base run's loss at 10 %, 20 %, ... of its tokens) it compares the
measured token ratio T(k·B0)/T(B0) with two predictions:

    E(B) model (McCandlish 2018 Eq. 2.11, AdaptDL):  T_k/T_1 = (φ + k·B0)/(φ + B0)
    COPUS LR-aware (goodput × sqrt(B), Eqs. 7-8):    T_k/T_1 = (φ + k·B0)/(φ + B0) / sqrt(k)

with φ = c·b̄_noise, b̄_noise the base run's mean online estimate on its way to the target, for
c = 0.5, 1, 2; and it fits φ from the measured ratio, φ̂ = (k·B0 − r·B0)/(r − 1) (the McCandlish
branch fit of cbs-notes §5.3). A ratio r < 1 (the larger batch needs FEWER tokens) is progress
per sample above anything E(B) allows: the signature of a real LR benefit beyond E(B); r ≥ 1
everywhere with φ̂ near c·b̄_noise says E(B) already accounts for the LR rule and the sqrt(B)
factor double-counts.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttt_replay import first_crossing as tokens_to  # noqa: E402
from ttt_replay import read_jsonl  # noqa: E402  (skips rows a resume superseded)

RESULTS = Path(__file__).resolve().parent / "results"


def smoothed(losses: list[float], alpha: float = 0.5) -> list[float]:
    """EMA(α) of the evaluation losses (Merrill et al. 2025 §3.1 smooth with α = 0.5)."""
    out, m = [], None
    for v in losses:
        m = v if m is None else alpha * m + (1 - alpha) * v
        out.append(m)
    return out


def run_curves(roots: list[Path], seed: int) -> dict[int, dict]:
    out = {}
    for root in roots:
        for run in sorted((root / f"seed{seed}").glob("static-*")):
            b = int(run.name.split("-")[1])
            ev = [e for e in read_jsonl(run / "eval.jsonl") if e.get("val_loss") is not None]
            steps = read_jsonl(run / "metrics.jsonl")
            if len(ev) < 3 or b in out:
                continue
            out[b] = {
                "tokens": [float(e["tokens"]) for e in ev],
                "loss": smoothed([float(e["val_loss"]) for e in ev]),
                "b_noise": [(float(r["tokens"]), r.get("b_noise")) for r in steps],
            }
    return out


def b_noise_at(curve: dict, tokens: float, window: int = 25) -> float:
    """Geometric mean of the online b_noise over the `window` steps up to `tokens` (the
    temperature check: McCandlish App. C predicts B_simple ∝ B/ε, i.e. √k higher at k·B with
    √k·LR at the same loss)."""
    vals = [b for t, b in curve["b_noise"] if t <= tokens and b is not None and math.isfinite(b) and b > 0][-window:]
    return math.exp(statistics.fmean(math.log(b) for b in vals)) if vals else math.nan


def analyse(curves: dict[int, dict], base: int, fractions: list[float]) -> dict:
    ref = curves[base]
    rows = []
    for f in fractions:
        k = max(1, min(len(ref["tokens"]) - 1, round(f * len(ref["tokens"]))))
        target = ref["loss"][k]
        t_base = tokens_to(ref["tokens"], ref["loss"], target)
        path = [b for t, b in ref["b_noise"] if t <= t_base and b is not None and math.isfinite(b)]
        bn = statistics.fmean(path) if path else math.nan
        for b in sorted(curves):
            if b == base:
                continue
            t_b = tokens_to(curves[b]["tokens"], curves[b]["loss"], target)
            r = t_b / t_base if t_base > 0 else math.nan
            kk = b / base
            pred = {f"E_c{c:g}": (c * bn + b) / (c * bn + base) for c in (0.5, 1.0, 2.0)}
            pred.update({f"lra_c{c:g}": pred[f"E_c{c:g}"] / math.sqrt(kk) for c in (0.5, 1.0, 2.0)})
            fit = (b - r * base) / (r - 1) if r > 1 else math.nan
            rows.append(
                {
                    "fraction": f,
                    "target": target,
                    "batch": b,
                    "k": kk,
                    "tokens_base": t_base,
                    "tokens_batch": t_b,
                    "ratio": r,
                    "b_noise_base_at_target": b_noise_at(ref, t_base),
                    "b_noise_batch_at_target": b_noise_at(curves[b], t_b),
                    "b_noise_base_mean": bn,
                    "phi_fit": fit,
                    **pred,
                }
            )
    return {"base": base, "rows": rows}


def replay_b_noise(steps: list[dict], base: int) -> list[float]:
    """The tracking estimator (core.gns_tracking) replayed on a run's logged gradient
    statistics: b_noise after every step."""
    from copus.core.stats.gns_tracking import TrackingGnsEstimator

    est, out = TrackingGnsEstimator(base), []
    for r in steps:
        est.update(r["small_sqnorm"], r["small_batch"], r["big_sqnorm"], r["global_batch_size"])
        out.append(est.b_noise)
    return out


def schedule_ceiling(
    phis: list[float], rate_at: dict[int, float], base: int, c: float, fractions: tuple[float, ...] = (0.5, 0.8, 1.0)
) -> dict:
    """Seconds to make the base run's progress (B0 samples × E(B0) per base step, E(B) =
    (φ+1)/(φ+B), φ = c·b_noise) at static B vs at the per-step best B (an oracle with free
    switches), with `rate_at[B]` samples/s; the first 20 steps (estimator warm-up) left out."""
    out = {}
    for f in fractions:
        t_static, t_oracle = dict.fromkeys(rate_at, 0.0), 0.0
        for phi in phis[20 : int(len(phis) * f)]:
            phi = c * (phi if math.isfinite(phi) else 1e12)
            prog = base * (phi + 1) / (phi + base)
            rate = {b: s * (phi + 1) / (phi + b) for b, s in rate_at.items()}
            t_oracle += prog / max(rate.values())
            for b in rate_at:
                t_static[b] += prog / rate[b]
        bs = min(t_static, key=t_static.get)
        out[f"{f:g}"] = {
            "best_static": bs,
            "best_static_saves_vs_base": 1 - t_static[bs] / t_static[base],
            "oracle_saves_vs_base": 1 - t_oracle / t_static[base],
            "oracle_saves_vs_best_static": 1 - t_oracle / t_static[bs],
        }
    return out


def ceiling(
    steps: list[dict], profile: list[dict], base: int, c: float, fractions: tuple[float, ...] = (0.5, 0.8, 1.0)
) -> dict:
    """The most ANY batch schedule could save over static B0 per the E(B) model
    (`schedule_ceiling`) at this machine's throughput: T(B) = the fastest profiled plan's
    samples/s at B."""
    best: dict[int, float] = {}
    for r in profile:
        b = int(r["global_batch_size"])
        best[b] = max(best.get(b, 0.0), float(r["samples_per_s"]))
    return schedule_ceiling(replay_b_noise(steps, base), best, base, c, fractions)


def throughput_scan(
    steps: list[dict],
    base: int,
    c: float,
    halves: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512),
    batches: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512),
) -> dict:
    """The same ceiling on other hardware: a step of B samples takes t0 + B·t1 (a fixed
    per-step cost t0: launches, the gradient sync, the optimizer, pipeline fill), so
    T(B) ∝ B/(B_half + B) with B_half = t0/t1 — flat at B_half ≪ B0, linear in B at
    B_half ≫ B. Whatever B_half, the schedule can only exploit how far b_noise moves."""
    phis = replay_b_noise(steps, base)
    return {f"{h}": schedule_ceiling(phis, {b: b / (h + b) for b in batches}, base, c, (1.0,))["1"] for h in halves}


def extrapolated_scan(
    steps: list[dict],
    base: int,
    c: float,
    factors: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    halves: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512, 1024),
    batches: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024, 2048),
) -> dict:
    """An EXTRAPOLATION, labelled as such: b_noise as a line through the origin (least squares
    over the replayed estimate; it rises about linearly in tokens here), floored at 1, continued
    for `factor` × the run's steps; per factor the largest oracle-vs-best-static saving over the
    t0 + B·t1 throughput family (`throughput_scan`) and the B_half where it occurs."""
    phis = replay_b_noise(steps, base)
    pts = [(i, p) for i, p in enumerate(phis) if i >= 20 and math.isfinite(p)]
    slope = sum(i * p for i, p in pts) / sum(i * i for i, _ in pts)
    n = len(phis)
    out = {}
    for f in factors:
        line = [max(slope * i, 1.0) for i in range(n * f)]
        scan = {
            h: schedule_ceiling(line, {b: b / (h + b) for b in batches}, base, c, (1.0,))["1"][
                "oracle_saves_vs_best_static"
            ]
            for h in halves
        }
        h = max(scan, key=scan.get)
        out[f"{f}"] = {"b_noise_end": line[-1], "max_oracle_saves_vs_best_static": scan[h], "at_b_half": h}
    return {"slope_per_step": slope, "by_factor": out}


def markdown(res: dict) -> str:
    lines = [
        f"Token ratio T(B)/T({res['base']}) to the base run's smoothed loss, measured vs "
        "predicted (E: (φ+B)/(φ+B0); LR-aware: E/sqrt(B/B0)), φ = c·mean b_noise.",
        "",
        "| target | B | measured | E c=0.5 | E c=1 | E c=2 | LR-aware c=1 | LR-aware c=2 "
        "| b_noise | φ fit | b_noise at target: base / B |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        cells = [
            f"{r['target']:.3f}",
            str(r["batch"]),
            f"{r['ratio']:.2f}",
            *(f"{r[k]:.2f}" for k in ("E_c0.5", "E_c1", "E_c2", "lra_c1", "lra_c2")),
            f"{r['b_noise_base_mean']:.1f}",
            "–" if math.isnan(r["phi_fit"]) else f"{r['phi_fit']:.0f}",
            f"{r['b_noise_base_at_target']:.1f} / {r['b_noise_batch_at_target']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    ok = [r for r in res["rows"] if not math.isnan(r["ratio"])]
    for key in ("E_c0.5", "E_c1", "E_c2", "lra_c1", "lra_c2"):
        errs = [abs(math.log(r["ratio"] / r[key])) for r in ok]
        if errs:
            lines.append(
                f"- {key}: median |log(measured/predicted)| = "
                f"{statistics.median(errs):.2f} over {len(errs)} (target, B) pairs"
            )
    temp = [
        r["b_noise_batch_at_target"] / r["b_noise_base_at_target"] / math.sqrt(r["k"])
        for r in ok
        if r["b_noise_base_at_target"] > 0
    ]
    if temp:
        lines.append(
            f"- b_noise(k·B)/b_noise(B) at the same loss, divided by sqrt(k) (1 = the "
            f"temperature feedback of McCandlish App. C): median "
            f"{statistics.median(temp):.2f}"
        )
    below = sum(r["ratio"] < 1 for r in ok)
    lines.append(f"- measured ratio < 1 (the larger batch needed fewer tokens) in {below} of {len(ok)} pairs")
    for c, by_f in (res.get("ceiling") or {}).items():
        parts = "; ".join(
            f"first {float(f):.0%}: oracle {100 * v['oracle_saves_vs_base']:.1f}% "
            f"vs static-{res['base']}, {100 * v['oracle_saves_vs_best_static']:.1f}% "
            f"vs best static ({v['best_static']})"
            for f, v in by_f.items()
        )
        lines.append(f"- ceiling of any batch schedule, E(B) with c={c}: {parts}")
    for c, by_h in (res.get("throughput_scan") or {}).items():
        parts = ", ".join(
            f"B_half={h}: {100 * v['oracle_saves_vs_best_static']:.1f}% (best static {v['best_static']})"
            for h, v in by_h.items()
        )
        lines.append(
            f"- the same ceiling vs the best static batch if a step took t0 + B·t1 "
            f"(T(B) ∝ B/(B_half+B), B = 8…512), E(B) with c={c}: {parts}"
        )
    for c, ex in (res.get("extrapolated") or {}).items():
        parts = ", ".join(
            f"{f}× ({v['b_noise_end']:.0f}): {100 * v['max_oracle_saves_vs_best_static']:.1f}%"
            for f, v in ex["by_factor"].items()
        )
        lines.append(
            f"- EXTRAPOLATED (b_noise = max(1, slope·step), fitted through the origin: "
            f"{ex['slope_per_step']:.3f}/step): the best ceiling over B_half vs the "
            f"best static for runs k× as long (b_noise at the end), c={c}: {parts}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="from_", required=True, help="runs root(s), comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base", type=int, default=8)
    ap.add_argument("--fractions", default="0.1,0.25,0.5,0.75,0.95")
    ap.add_argument("--out", default=str(RESULTS / "lr_aware_check.json"))
    ap.add_argument("--profile", default="", help="copus profile.json(s), comma-separated: adds the adaptation ceiling")
    args = ap.parse_args(argv)
    curves = run_curves([Path(r) for r in args.from_.split(",")], args.seed)
    if args.base not in curves:
        raise SystemExit(f"--base {args.base}: no static-{args.base} run under {args.from_}")
    res = analyse(curves, args.base, [float(x) for x in args.fractions.split(",")])
    if args.profile:
        prof = [r for f in args.profile.split(",") for r in json.loads(Path(f).read_text())]
        base_steps = next(
            read_jsonl(Path(r) / f"seed{args.seed}" / f"static-{args.base}" / "metrics.jsonl")
            for r in args.from_.split(",")
            if (Path(r) / f"seed{args.seed}" / f"static-{args.base}").exists()
        )
        res["ceiling"] = {f"{c:g}": ceiling(base_steps, prof, args.base, c) for c in (0.5, 1.0, 2.0)}
        res["throughput_scan"] = {f"{c:g}": throughput_scan(base_steps, args.base, c) for c in (1.0, 2.0)}
        res["extrapolated"] = {f"{c:g}": extrapolated_scan(base_steps, args.base, c) for c in (1.0, 2.0)}
    res["command"] = "python bench/lr_aware_check.py " + " ".join(argv or [])
    out = Path(args.out)
    out.write_text(json.dumps(res, indent=1, default=lambda x: None))
    table = markdown(res)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
