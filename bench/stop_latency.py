"""Stop latency of `copus train` on SIGINT / SIGTERM (runtime/train/stop.py).

Each trial starts a 2-rank `copus train` (tiny model, constant batch, no interval checkpoints),
waits until `--after` steps are logged, sends the signal to the `copus train` process and
measures, from the moment the signal was sent:

- to_checkpoint_s: until `checkpoints/step-N` (the stop's checkpoint, renamed into place last)
  exists;
- to_exit_s:       until the process has exited (after the summary, the workers' shutdown and
  the launcher's teardown);
- step_s:          the median step time of the run before the signal (the signal waits for the
  current step to end: at most one step of the latency is that wait).

It checks each trial's exit code (130 / 143) and that the checkpoint verifies. Figures depend on
the machine's load: the load average is recorded next to them (os.getloadavg at start and end).

Usage: python bench/stop_latency.py [--repeats 3] [--after 4] [--out bench/results/stop_latency.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "--nproc",
    "2",
    "--max-steps",
    "400",
    "--policy",
    "constant",
    "--set",
    "data.max_chars=200000",
    "--set",
    "eval.interval_steps=0",
    "--set",
    "checkpoint.interval_steps=0",
    "--set",
    "log.tensorboard=false",
    "--set",
    "log.progress=false",
]


def _rows(path: Path) -> list[dict]:
    from copus.reporting.runs import read_jsonl

    return read_jsonl(path)


def trial(root: Path, sig: int, after: int) -> dict:
    """One run stopped by `sig` after `after` logged steps; the measured times."""
    from copus.runtime.state import checkpoint as ckpt

    run = root / f"run-{signal.Signals(sig).name}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "copus", "train", "--run-dir", str(run), *ARGS],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while len(_rows(run / "metrics.jsonl")) < after:
        if proc.poll() is not None:
            raise RuntimeError(f"run ended early: {proc.stderr.read()[-2000:]}")
        time.sleep(0.01)
    step_s = statistics.median(r["step_s"] for r in _rows(run / "metrics.jsonl"))
    t0 = time.monotonic()
    proc.send_signal(sig)
    to_ckpt = None
    while proc.poll() is None:
        if to_ckpt is None and any(p.name.startswith("step-") for p in (run / "checkpoints").glob("step-*")):
            to_ckpt = time.monotonic() - t0
        time.sleep(0.005)
    to_exit = time.monotonic() - t0
    err = proc.stderr.read()
    latest = ckpt.find_latest(run / "checkpoints", log=lambda _: None)
    stopped_at = _rows(run / "metrics.jsonl")[-1]["step"]
    return {
        "signal": signal.Signals(sig).name,
        "exit_code": proc.returncode,
        "expected_exit_code": 128 + sig,
        "to_checkpoint_s": to_ckpt,
        "to_exit_s": to_exit,
        "step_s": step_s,
        "signalled_after_steps": after,
        "stopped_at": stopped_at,
        "checkpoint": latest.name if latest else None,
        "checkpoint_ok": latest is not None and latest.name == f"step-{stopped_at}" and ckpt.verify(latest) is None,
        "last_line": err.strip().splitlines()[-1] if err.strip() else "",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="trials per signal")
    ap.add_argument("--after", type=int, default=4, help="signal after this many logged steps")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stop_latency.json"))
    args = ap.parse_args(argv)
    load_start = os.getloadavg()
    trials = []
    with tempfile.TemporaryDirectory(prefix="copus-stop-") as tmp:
        for _ in range(args.repeats):
            for sig in (signal.SIGINT, signal.SIGTERM):  # interleaved: the same load for both
                trials.append(trial(Path(tmp), sig, args.after))
                print(
                    f"  {trials[-1]['signal']}: exit {trials[-1]['exit_code']}, checkpoint "
                    f"{trials[-1]['to_checkpoint_s']:.2f} s, exit {trials[-1]['to_exit_s']:.2f} s",
                    flush=True,
                )
    summary = {}
    for name in ("SIGINT", "SIGTERM"):
        ts = [t for t in trials if t["signal"] == name]
        summary[name] = {
            "trials": len(ts),
            "exit_codes_ok": all(t["exit_code"] == t["expected_exit_code"] for t in ts),
            "checkpoints_ok": all(t["checkpoint_ok"] for t in ts),
            "median_to_checkpoint_s": statistics.median(t["to_checkpoint_s"] or float("nan") for t in ts),
            "median_to_exit_s": statistics.median(t["to_exit_s"] for t in ts),
            "median_step_s": statistics.median(t["step_s"] for t in ts),
        }
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "note": "shared machine, loaded by other work while measured",
        },
        "args": vars(args),
        "summary": summary,
        "trials": trials,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"\nstop latency, 2-rank tiny run, median of {args.repeats} (load average "
        f"{load_start[0]:.1f} -> {report['machine']['loadavg_end'][0]:.1f} on "
        f"{os.cpu_count()} CPUs)"
    )
    print(f"{'signal':8s} {'exit ok':>7s} {'ckpt ok':>7s} {'->ckpt s':>9s} {'->exit s':>9s} {'step s':>7s}")
    for name, s in summary.items():
        print(
            f"{name:8s} {str(s['exit_codes_ok']):>7s} {str(s['checkpoints_ok']):>7s} "
            f"{s['median_to_checkpoint_s']:9.2f} {s['median_to_exit_s']:9.2f} "
            f"{s['median_step_s']:7.3f}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
