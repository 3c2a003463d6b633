"""Noise-free replay time and the issue-14 goal check for bench/time_to_target.py.

Identical runs on this shared machine differ by 3-29 % in wall time, so beside the measured
training wall time every run gets a *replay time*: the same steps, each priced at the profiled
median step time of the plan it ran under (`copus profile`), plus the measured cost of each
switch (decisions.jsonl `switch_s`) and of each branch probe (probes.jsonl `cost_s`, written
by the calibration probe when it exists). A plan that the profile does not hold is priced at
the profile's linear fit in the number of micro-batches for the same (dp, tp, pp,
micro_batch_size) — a global batch of 20 or 28 is not profiled, but 8, 16, 32 of its layout
are (counted in `interpolated_steps`) — and without such rows at that run's own median
measured step time for it (counted in `unprofiled_steps`).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from copus.reporting.runs import read_jsonl  # noqa: F401 (the one run-folder reader; re-exported for the benches)

PLAN_KEYS = ("dp", "tp", "pp", "micro_batch_size", "global_batch_size")


def first_crossing(xs: list[float], losses: list[float], target: float) -> float:
    """First x (seconds or tokens) where the loss reaches `target`, linear between the
    bracketing evaluations (NaN: never)."""
    for i, (x, v) in enumerate(zip(xs, losses)):
        if v <= target:
            if i == 0:
                return x
            x0, v0 = xs[i - 1], losses[i - 1]
            return x0 + (x - x0) * (v0 - target) / (v0 - v)
    return math.nan


def plan_key(row: dict) -> tuple[int, ...]:
    return tuple(int(row.get(k) or 0) for k in PLAN_KEYS)


def profile_medians(rows: list[dict]) -> dict[tuple[int, ...], float]:
    """Plan → median step time over its timed steps (`step_s_all`, else `step_s`); with several
    rows of one plan, the fastest median (a later profile of the same plan)."""
    out: dict[tuple[int, ...], float] = {}
    for r in rows:
        times = r.get("step_s_all") or [r["step_s"]]
        med = float(statistics.median(times))
        k = plan_key(r)
        out[k] = min(out.get(k, math.inf), med)
    return out


def interpolate(medians: dict[tuple[int, ...], float], key: tuple[int, ...]) -> float:
    """Step time of an unprofiled plan from the profiled plans of its (dp, tp, pp, mbs):
    least-squares line in num_microbatches (one row: proportional); NaN without rows."""
    dp, tp, pp, mbs, batch = key
    pts = [(k[4] // (k[0] * k[3]), s) for k, s in medians.items() if k[:4] == key[:4]]
    n = batch // max(dp * mbs, 1)
    if not pts:
        return math.nan
    if len({x for x, _ in pts}) == 1:
        x0, s0 = pts[0]
        return s0 * n / x0
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return max(my + slope * (n - mx), 1e-9)


def replay_curve(run_dir: Path, medians: dict[tuple[int, ...], float]) -> dict:
    """Cumulative replay seconds after every step, and what went into it."""
    steps = read_jsonl(run_dir / "metrics.jsonl")
    own: dict[tuple[int, ...], list[float]] = {}
    for r in steps:
        own.setdefault(plan_key(r), []).append(float(r["step_s"]))
    switch_at: dict[int, float] = {}
    for d in read_jsonl(run_dir / "decisions.jsonl"):
        if d.get("applied", True) and d.get("switch_s") is not None:
            switch_at[int(d["step"])] = switch_at.get(int(d["step"]), 0.0) + float(d["switch_s"])
    probe_at: dict[int, float] = {}
    for p in read_jsonl(run_dir / "probes.jsonl"):
        probe_at[int(p.get("step", 0))] = probe_at.get(int(p.get("step", 0)), 0.0) + float(p.get("cost_s") or 0.0)
    total, cum, unprofiled, interpolated = 0.0, {}, 0, 0
    for r in steps:
        k, step = plan_key(r), int(r["step"])
        if k in medians:
            total += medians[k]
        elif math.isfinite(guess := interpolate(medians, k)):
            total += guess
            interpolated += 1
        else:
            total += statistics.median(own[k])
            unprofiled += 1
        total += switch_at.get(step, 0.0) + probe_at.get(step, 0.0)
        cum[step] = total
    return {
        "replay_s_at_step": cum,
        "replay_s": total,
        "unprofiled_steps": unprofiled,
        "interpolated_steps": interpolated,
        "switch_s": sum(switch_at.values()),
        "probe_s": sum(probe_at.values()),
        "steps": len(steps),
    }


def replay_eval_curve(run_dir: Path, medians: dict) -> tuple[list[float], list[float]]:
    """(replay seconds at each evaluation's step, val losses)."""
    cum = replay_curve(run_dir, medians)["replay_s_at_step"]
    times, losses = [], []
    for e in read_jsonl(run_dir / "eval.jsonl"):
        v = e.get("val_loss")
        if v is None or not math.isfinite(v) or int(e["step"]) not in cum:
            continue
        times.append(cum[int(e["step"])])
        losses.append(float(v))
    return times, losses


def median_speedup(tt: dict[str, dict[int, float]], seeds: list[int], policy: str, baselines: list[str]) -> dict:
    """(T_base − T_policy)/T_base per seed against the baseline with the lowest median time
    among `baselines` that reached the target in every seed; the median of those."""
    reached = {
        b: statistics.median(tt[b][s] for s in seeds)
        for b in baselines
        if b in tt and all(not math.isnan(tt[b].get(s, math.nan)) for s in seeds)
    }
    if not reached or policy not in tt:
        return {"baseline": None, "median": math.nan, "per_seed": []}
    best = min(reached, key=reached.get)
    per = [(tt[best][s] - tt[policy].get(s, math.nan)) / tt[best][s] for s in seeds]
    ok = [x for x in per if not math.isnan(x)]
    return {
        "baseline": best,
        "per_seed": per,
        "median": statistics.median(ok) if len(ok) == len(per) and ok else math.nan,
    }


def goal_check(res: dict, policy: str = "goodput") -> dict:
    """Issue 14's goal at the last target, in wall and replay time: ≥ 12 % sooner than the
    best static batch and ≥ 5 % sooner than the best CBS policy (median over seeds)."""
    seeds = res["seeds"]
    out = {}
    for clock, key in (("wall", "time_to_target_s"), ("replay", "replay_time_to_target_s")):
        table = res.get(key) or {}
        if not table:
            continue
        last = list(table)[-1]
        tt = table[last]
        static = [p for p in tt if p.startswith("static-")]
        cbs = [p for p in tt if p.startswith("gns-")]
        vs_static = median_speedup(tt, seeds, policy, static)
        vs_cbs = median_speedup(tt, seeds, policy, cbs)
        out[clock] = {
            "target": last,
            "vs_static": vs_static,
            "vs_cbs": vs_cbs,
            "met": bool(vs_static["median"] >= 0.12 and vs_cbs["median"] >= 0.05),
        }
    return out
