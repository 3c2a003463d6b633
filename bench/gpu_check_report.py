"""The GPU check's reading of its legs (bench/gpu_check.py): per-plan segments of a leg's
metrics.jsonl, its switches, the per-leg rows gpu.sh left behind (JSON, or exit status and log
for a leg `timeout` stopped), the copus / torchtitan comparison, the JSON and the table."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

LEGS = ("eager", "growth", "switch", "throughput", "torchtitan")
NCCL_TIMEOUT_S = 120  # a stuck collective aborts after 2 min, not 30


def read_rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not row.get("superseded"):
            rows.append(row)
    return rows


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")


def segments(rows: list[dict], memory_model) -> list[dict]:
    """Per plan of the leg: steps, median step time, tokens/s and MFU (the first step of each
    plan left out: warm-up, allocator growth, compilation), the plan's own peaks (the runtime
    resets them at every plan change), the model's prediction, the first step's excess over
    the median (compile time on a compiled leg's first plan)."""
    from copus.core.plan.plan import ParallelPlan
    from copus.runtime.train.perf import predicted_memory_bytes

    out: list[dict] = []
    key = None
    for row in rows:
        k = (row["dp"], row["tp"], row["pp"], row["micro_batch_size"], row["num_microbatches"])
        if k != key:
            key = k
            out.append(
                {
                    "plan": dict(zip(("dp", "tp", "pp", "micro_batch_size", "num_microbatches"), k)),
                    "global_batch_size": row["global_batch_size"],
                    "first_step": row["step"],
                    "rows": [],
                }
            )
        out[-1]["rows"].append(row)
    for seg in out:
        rows_ = seg.pop("rows")
        steady = rows_[1:] or rows_
        seg["steps"] = len(rows_)
        seg["median_step_s"] = statistics.median(r["step_s"] for r in steady)
        seg["first_step_s"] = rows_[0]["step_s"]
        seg["first_step_excess_s"] = rows_[0]["step_s"] - seg["median_step_s"]
        seg["median_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steady)
        mfus = [r["mfu"] for r in steady if _finite(r.get("mfu"))]
        seg["median_mfu"] = statistics.median(mfus) if mfus else None
        seg["peak_allocated_bytes"] = max(r.get("peak_memory_bytes") or 0 for r in rows_)
        for k in ("peak_reserved_bytes", "device_used_bytes"):
            vals = [r[k] for r in rows_ if _finite(r.get(k))]
            seg[k] = max(vals) if vals else None
        seg["predicted_memory_bytes"] = predicted_memory_bytes(memory_model, ParallelPlan(**seg["plan"]))
        seg["peak_over_predicted"] = seg["peak_allocated_bytes"] / seg["predicted_memory_bytes"]
    return out


def switches(run_dir: Path) -> list[dict]:
    rows = []
    for d in read_rows(run_dir / "decisions.jsonl"):
        if d.get("applied") and "event" not in d:
            sw = d.get("switch") or {}
            rows.append(
                {
                    "step": d.get("step"),
                    "kind": d.get("kind"),
                    "global_batch_size": d.get("global_batch_size"),
                    "to": f"dp{d.get('dp')}.tp{d.get('tp')}.pp{d.get('pp')}",
                    "switch_s": d.get("switch_s"),
                    "method": sw.get("method"),
                    "groups_released": sw.get("groups_released"),
                }
            )
    return rows


def leg_from_files(leg: str, legs_dir: Path) -> dict:
    """The leg's JSON, or (killed by `timeout`, crashed before writing) an error row from the
    exit status gpu.sh recorded and the log's last line."""
    path, rc_path, log = (legs_dir / f"{leg}.{ext}" for ext in ("json", "rc", "log"))
    parts = rc_path.read_text().split() if rc_path.exists() else []
    rc = int(parts[0]) if parts else None
    limit = parts[1] if len(parts) > 1 else "?"
    if path.exists() and rc not in (124, 137):
        return json.loads(path.read_text())
    if rc is None:
        return {
            "leg": leg,
            "status": "skipped",
            "reason": "not run (not in --legs, or the check's time budget was spent)",
        }
    tail = [ln for ln in (log.read_text(errors="replace").splitlines() if log.exists() else []) if ln.strip()]
    if rc in (124, 137):
        error = f"timed out after {limit} s (timeout exit {rc}); the leg's ranks were killed"
    else:
        error = f"exit {rc}: {tail[-1][:500] if tail else 'no output'}"
    return {"leg": leg, "status": "error", "error": error, "rc": rc}


def peer_comparison(legs: dict[str, dict]) -> dict:
    """copus's throughput leg against torchtitan's on the same settings: step time and peak
    memory ratios (copus / torchtitan); the reason when either side has no figure."""
    c, t = legs.get("throughput", {}), legs.get("torchtitan", {})
    out = {"copus_leg": "throughput", "peer_leg": "torchtitan"}
    if c.get("status") != "ok" or t.get("status") != "ok":
        why = [
            f"{name}: {leg.get('status', 'absent')} ({leg.get('reason') or leg.get('error')})"
            for name, leg in (("throughput", c), ("torchtitan", t))
            if leg.get("status") != "ok"
        ]
        return {**out, "status": "n/a", "reason": "; ".join(why)}
    seg = c["segments"][-1]
    return {
        **out,
        "status": "ok",
        "copus_median_step_s": seg["median_step_s"],
        "torchtitan_median_step_s": t["median_step_s"],
        "step_time_ratio": seg["median_step_s"] / t["median_step_s"],
        "copus_peak_allocated_bytes": seg["peak_allocated_bytes"],
        "torchtitan_peak_allocated_bytes": t["peak_allocated_bytes"],
        "peak_allocated_ratio": seg["peak_allocated_bytes"] / t["peak_allocated_bytes"],
        "peak_reserved_ratio": (
            seg["peak_reserved_bytes"] / t["peak_reserved_bytes"] if seg.get("peak_reserved_bytes") else None
        ),
    }


def collect(out: Path, s: dict, wall_s: float | None, budget_s: float | None) -> dict:
    legs_dir = out / "legs"
    legs = {leg: leg_from_files(leg, legs_dir) for leg in LEGS}
    devices = json.loads((out / "devices.json").read_text()) if (out / "devices.json").exists() else {}
    first = next((r for r in legs.values() if r.get("status") == "ok" and "device" in r), {})
    return {
        "bench": "gpu_check",
        "dry_run": s["dry_run"],
        "nproc": s["nproc"],
        "device": first.get("device", devices.get("name")),
        "devices": devices,
        "hardware": first.get("hardware"),
        "peak_flops": first.get("peak_flops"),
        "model": s["config"],
        "seq_len": s["seq_len"],
        "flops_per_token": first.get("flops_per_token"),
        "num_params": first.get("num_params"),
        "nccl_timeout_s": NCCL_TIMEOUT_S,
        "wall_s": wall_s,
        "budget_s": budget_s,
        "legs": [legs[leg] for leg in LEGS],
        "peer": peer_comparison(legs),
        "host": platform.node(),
        "load_average_1min": os.getloadavg()[0],
    }


def _gib(x) -> str:
    return "–" if x is None else f"{x / 2**30:.2f}"


def markdown(res: dict) -> str:
    head = "dry run, CPU" if res["dry_run"] else (res["device"] or "GPU")
    lines = [f"# gpu_check ({head}, {res['nproc']} rank(s))", ""]
    if res.get("num_params"):
        peak = res.get("peak_flops")
        lines += [
            f"model {res['model']['hidden_size']}d x {res['model']['num_hidden_layers']} "
            f"layers, {res['num_params'] / 1e6:,.1f} M parameters, seq {res['seq_len']}, "
            f"{res['flops_per_token'] / 1e9:.3g} GFLOP/token, peak "
            + ("unknown" if peak is None else f"{peak / 1e12:.4g} TFLOP/s")
            + f" per device ({res['hardware']}); wall "
            + ("–" if res["wall_s"] is None else f"{res['wall_s']:.0f} s")
            + ("" if res["budget_s"] is None else f" of a {res['budget_s']:.0f} s budget"),
            "",
        ]
    lines += [
        "| leg | plan | B | steps | median step s | tokens/s | MFU | peak alloc GiB | "
        "reserved GiB | device used GiB | predicted GiB | alloc/predicted | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for leg in res["legs"]:
        name = leg["leg"]
        if leg["status"] != "ok":
            text = leg.get("reason") or leg.get("error")
            lines.append(f"| {name} | **{leg['status']}**: {text} |" + " |" * 11)
            continue
        if name == "torchtitan":
            lines.append(
                f"| torchtitan | dp{leg['nproc']} mb{leg['micro_batch_size']} | "
                f"{leg['nproc'] * leg['micro_batch_size']} | {len(leg['step_s'])} | "
                f"{leg['median_step_s']:.3f} | {leg['median_tokens_per_s']:,.0f} | – | "
                f"{_gib(leg['peak_allocated_bytes'])} | {_gib(leg['peak_reserved_bytes'])}"
                f" | {_gib(leg['device_used_bytes'])} | – | – | "
                f"{leg['first_step_s'] - leg['median_step_s']:.1f} |"
            )
            continue
        for i, sg in enumerate(leg["segments"]):
            p = sg["plan"]
            plan = f"dp{p['dp']}.tp{p['tp']}.pp{p['pp']} mb{p['micro_batch_size']}x{p['num_microbatches']}"
            mfu = "–" if sg["median_mfu"] is None else f"{sg['median_mfu']:.1%}"
            comp = f"{leg['compile_s']:.1f}" if i == 0 and leg.get("compile_s") is not None else "–"
            ratio = "n/a" if sg["peak_over_predicted"] is None else f"{sg['peak_over_predicted']:.2f}"
            lines.append(
                f"| {name} | {plan} | {sg['global_batch_size']} | {sg['steps']} | "
                f"{sg['median_step_s']:.3f} | {sg['median_tokens_per_s']:,.0f} | {mfu} | "
                f"{_gib(sg['peak_allocated_bytes'])} | {_gib(sg['peak_reserved_bytes'])} | "
                f"{_gib(sg['device_used_bytes'])} | {_gib(sg['predicted_memory_bytes'])} | "
                f"{ratio} | {comp} |"
            )
    lines.append("")
    for leg in res["legs"]:
        g = leg.get("gns")
        if leg["status"] == "ok" and g:
            lines.append(
                f"- GNS statistics overhead ({leg['leg']}, {g['plan']}): "
                f"{g['overhead']:+.1%} (median {g['median_step_s_with_stats']:.3f} s with "
                f"vs {g['median_step_s_without_stats']:.3f} s without, {g['pairs']} ABBA "
                "pairs)"
            )
        for sw in leg.get("switches") or ():
            lines.append(
                f"- {leg['leg']}: step {sw['step']}: {sw['kind']} -> {sw['to']} "
                f"B={sw['global_batch_size']}, {sw['switch_s']:.2f} s"
                + (f" ({sw['method']}, {sw['groups_released']} process groups released)" if sw["method"] else "")
            )
        for note in ("mfu_note", "memory_note"):
            if leg.get(note):
                lines.append(f"- {leg['leg']}: {leg[note]}")
    peer = res["peer"]
    if peer["status"] == "ok":
        lines.append(
            f"- copus / torchtitan (throughput settings): step time "
            f"{peer['step_time_ratio']:.3f}, peak allocated {peer['peak_allocated_ratio']:.3f}"
        )
    else:
        lines.append(f"- copus / torchtitan: n/a ({peer['reason']})")
    return "\n".join(lines) + "\n"
