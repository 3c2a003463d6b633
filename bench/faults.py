"""Fault injection for `copus train`: kill -9 a worker at a random moment, check nothing is lost.

Each trial launches a short 2-process `copus train` (elastic restarts on, the CLI's default
`--max-restarts`) that starts under the pipeline layout pp2 and checkpoints every few steps.
"step" and "checkpoint" trials run the goodput controller (controller.margin=0: it moves to dp2
when it predicts any gain, and may grow the batch); "reconfigure" trials run the ramp with the
layout map `pp2@8,dp2@16`, which doubles the batch and switches to dp2 in-process at a random
step known in advance, so that the kill can land inside the switch. The harness SIGKILLs one
random worker (a child of the launcher) in one of three phases:

- step:        after a random step's metrics line appears, plus a random fraction of a step;
- checkpoint:  while a `checkpoints/tmp-step-N` folder exists (a save in progress);
- reconfigure: inside the in-process switch: once the trainer has logged
               "reconfigure ... : start" and not yet the switch's result line (the direct path:
               shards move in memory, no files), or once the trial's own DCP staging folder
               `/dev/shm/copus-switch-<host>-<pid>-*` exists (the fallback; pid = one of its
               workers) or a worker holds a file open in one. The kill counts as confirmed
               inside the switch when, after every worker died, the result line is still
               missing (direct) or the staging folder still existed at the kill (DCP).

The elastic agent restarts the workers, which resume from the latest good checkpoint. Checked
per trial (from metrics.jsonl, the checkpoints and the exit status):

- survived:    `copus train` exits 0 and the final trajectory holds every step 1..max_steps;
- resumed from the last good checkpoint: the first step after the restart is one past the
  newest checkpoint that verified right after the kill;
- samples lost / repeated: the final trajectory's sample ranges [samples − B, samples) must tile
  [0, total) of the global sample stream exactly (the data position is one integer offset);
  each checkpoint's saved offset must equal the trajectory's offset at that step;
- loss continuity: steps redone after the restart, under the same plan history, must repeat the
  killed attempt's losses bit for bit;
- corrupt checkpoints: every `step-N` folder, right after the kill and at the end, verifies;
- leaked staging folders in /dev/shm (RAM) left behind by a kill mid-reconfiguration (the
  restarted trainer removes those of dead processes).

Usage: python bench/faults.py [--trials 20] [--steps 14] [--seed 0] [--out FILE]
Prints survived/total, samples lost/repeated, corrupt checkpoints; JSON to
bench/results/faults.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHM = Path("/dev/shm")
STAGE_PREFIX = "copus-switch-"
PHASES = ("step", "checkpoint", "reconfigure")
CHECKPOINT_EVERY = 3


def train_command(run_dir: Path, steps: int, seed: int, switch_step: int = 0) -> list[str]:
    """The trial's `copus train`. `switch_step` = 0: the goodput controller (pp2 → dp2 when it
    predicts a gain, so a run may or may not switch); > 0: the ramp doubles the batch after
    `switch_step` steps and the layout map `pp2@8,dp2@16` moves the run to dp2 in-process at
    that point — a switch at a known step, so that kills can be aimed inside it."""
    if switch_step:
        policy = [
            "--policy",
            "ramp",
            "--set",
            "parallel.layouts=pp2@8,dp2@16",
            "--set",
            "batch.ramp_to=16",
            "--set",
            "batch.ramp_kind=stepwise",
            "--set",
            "batch.ramp_steps=1",
            "--set",
            f"batch.ramp_samples={8 * switch_step}",
            "--set",
            "batch.warmup_steps=0",
            "--set",
            "batch.interval_steps=1",
        ]
    else:
        policy = [
            "--policy",
            "goodput",
            "--set",
            "parallel.pp=2",
            "--set",
            "batch.warmup_steps=3",
            "--set",
            "batch.interval_steps=3",
            "--set",
            "gns.max_rel_err=100.0",
            "--set",
            "controller.margin=0.0",
        ]
    return [
        sys.executable,
        "-m",
        "copus",
        "train",
        "--nproc",
        "2",
        "--max-steps",
        str(steps),
        "--run-dir",
        str(run_dir),
        "--seed",
        str(seed),
        *policy,
        "--set",
        "data.max_chars=100000",
        "--set",
        "eval.interval_steps=0",
        "--set",
        f"checkpoint.interval_steps={CHECKPOINT_EVERY}",
        "--set",
        "checkpoint.keep=2",
        "--set",
        "log.progress=false",
        "--set",
        "log.tensorboard=false",
        "--set",
        "train.warmup_tokens=0",
        # FSDP2 resharding on: under it the controller prefers dp2 to pp2 at its first
        # decisions on this model (the command's default keeps parameters gathered, under
        # which pp2 often stays best and no reconfiguration happens in a short run)
        "--set",
        "parallel.reshard_after_forward=true",
    ]


# ------------------------------------------------------------------------------- processes


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(x) for x in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def workers(launcher: int) -> list[int]:
    """The launcher's spawned worker processes (not the multiprocessing resource tracker)."""
    return sorted(p for p in children(launcher) if "spawn_main" in _cmdline(p))


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def open_paths(pid: int) -> list[str]:
    paths = []
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                paths.append(os.readlink(fd))
            except OSError:
                pass
    except OSError:
        pass
    return paths


def staging_dirs(pids: list[int] | None = None) -> set[str]:
    """Switch staging folders in /dev/shm (`copus-switch-<host>-<pid>-*`); with `pids`, only
    those created by one of these processes (a trial's own workers, not another job's)."""
    try:
        names = {p.name for p in SHM.iterdir() if p.name.startswith(STAGE_PREFIX)}
    except OSError:
        return set()
    if pids is None:
        return names
    owners = {f"-{pid}-" for pid in pids}
    return {n for n in names if any(o in n for o in owners)}


# ------------------------------------------------------------------------------- reading a run

_SWITCH_START = re.compile(r"^copus: reconfigure .* -> .*: start$", re.MULTILINE)
_SWITCH_DONE = re.compile(r"^copus: reconfigure .* -> .* \((?:direct|in-process|checkpoint)\): ", re.MULTILINE)


def switch_open(log: Path) -> bool:
    """True while the trainer's log shows a switch started and not finished (rank 0 prints
    both lines, flushed)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return False
    return len(_SWITCH_START.findall(text)) > len(_SWITCH_DONE.findall(text))


def read_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl lines in file order; a crash-truncated line is skipped."""
    from copus.reporting.runs import read_jsonl

    return read_jsonl(run_dir / "metrics.jsonl", include_superseded=True)


def attempts(rows: list[dict]) -> list[list[dict]]:
    """Split the rows into attempts: a new attempt starts when the step number does not grow."""
    runs: list[list[dict]] = []
    for r in rows:
        if not runs or r["step"] <= runs[-1][-1]["step"]:
            runs.append([])
        runs[-1].append(r)
    return runs


def trajectory(rows: list[dict]) -> dict[int, dict]:
    """The effective run: a later attempt's row for a step replaces every row from that step on."""
    traj: dict[int, dict] = {}
    for r in rows:
        for s in [s for s in traj if s >= r["step"]]:
            del traj[s]
        traj[r["step"]] = r
    return traj


def _plan(r: dict) -> tuple:
    return tuple(r.get(k) for k in ("dp", "tp", "pp", "micro_batch_size", "num_microbatches"))


def sample_accounting(traj: dict[int, dict]) -> tuple[int, int]:
    """(lost, repeated) positions of the global sample stream over the final trajectory."""
    covered: dict[int, int] = {}
    total = 0
    for s in sorted(traj):
        hi, B = int(traj[s]["samples"]), int(traj[s]["global_batch_size"])
        for i in range(hi - B, hi):
            covered[i] = covered.get(i, 0) + 1
        total = max(total, hi)
    lost = sum(1 for i in range(total) if i not in covered)
    repeated = sum(c - 1 for c in covered.values() if c > 1)
    return lost, repeated


def loss_continuity(rows: list[dict]) -> tuple[int, int, float]:
    """(steps compared, mismatches, max |Δloss|) between each attempt and the one before it, over
    the redone steps, as long as both ran the same plans (bit-identity holds per plan history)."""
    runs = attempts(rows)
    compared = mismatches = 0
    worst = 0.0
    for before, after in zip(runs, runs[1:]):
        old = {r["step"]: r for r in before}
        for r in after:
            o = old.get(r["step"])
            if o is None or _plan(o) != _plan(r) or o["samples"] != r["samples"]:
                break
            compared += 1
            a, b = o.get("loss"), r.get("loss")
            if a != b:
                mismatches += 1
                if a is not None and b is not None:
                    worst = max(worst, abs(a - b))
    return compared, mismatches, worst


def verify_all(ckpt_root: Path) -> tuple[list[int], list[str]]:
    """(valid steps, problems) of every step-N folder."""
    from copus.runtime.state import checkpoint as ckpt

    good, bad = [], []
    for step, path in ckpt.step_dirs(ckpt_root):
        problem = ckpt.verify(path)
        if problem is None:
            good.append(step)
        else:
            bad.append(problem)
    return sorted(good), bad


def offsets_match(ckpt_root: Path, traj: dict[int, dict]) -> bool:
    """Each checkpoint's saved sample offset equals the trajectory's at that step."""
    from copus.runtime.state import checkpoint as ckpt

    for step, path in ckpt.step_dirs(ckpt_root):
        state = json.loads((path / ckpt.TRAINER_STATE).read_text())
        row = traj.get(step)
        if row is None or state["progress"]["samples"] != row["samples"]:
            return False
    return True


# ------------------------------------------------------------------------------- one trial


def _wait_for_kill_moment(
    proc: subprocess.Popen,
    run_dir: Path,
    phase: str,
    rng: random.Random,
    steps: int,
    deadline: float,
    switch_delay_s: float = 0.3,
) -> dict | None:
    """Poll until the chosen moment; return a description of it, or None if the run ended."""
    ckpts = run_dir / "checkpoints"
    target_step = rng.randint(2, steps - 3)
    target_save = rng.choice(list(range(CHECKPOINT_EVERY, steps - 1, CHECKPOINT_EVERY)))
    while time.monotonic() < deadline and proc.poll() is None:
        if phase == "step":
            rows = read_rows(run_dir)
            if rows and rows[-1]["step"] >= target_step:
                time.sleep(rng.uniform(0.0, 1.0) * max(rows[-1].get("step_s") or 0.5, 0.05))
                return {"at_step": rows[-1]["step"], "confirmed": True}
        elif phase == "checkpoint":
            tmp = ckpts / f"tmp-step-{target_save}"
            if tmp.exists():
                time.sleep(rng.uniform(0.0, 0.25))
                return {"at_step": target_save, "confirmed": tmp.exists()}
        else:  # a switch is under way: logged start (direct) or our staging folder (DCP)
            pids = workers(proc.pid)
            own = staging_dirs(pids)
            rows = read_rows(run_dir)
            if switch_open(run_dir.with_suffix(".log")):
                time.sleep(rng.uniform(0.0, switch_delay_s))
                return {
                    "at_step": rows[-1]["step"] if rows else 0,
                    "switch_path": "direct",
                    "confirmed": True,
                }  # re-checked once the workers are dead
            if own or any(STAGE_PREFIX in path for pid in pids for path in open_paths(pid)):
                time.sleep(rng.uniform(0.0, switch_delay_s))
                return {
                    "at_step": rows[-1]["step"] if rows else 0,
                    "switch_path": "dcp",
                    "confirmed": bool(staging_dirs(pids)),
                }
            if rows and rows[-1]["step"] >= steps - 2:  # no layout change in this run: kill
                return {"at_step": rows[-1]["step"], "confirmed": False}  # mid-step instead
        time.sleep(0.003)
    return None


def run_trial(
    index: int,
    root: Path,
    steps: int,
    seed: int,
    timeout_s: float = 480.0,
    phases: tuple[str, ...] = PHASES,
    switch_delay_s: float = 0.3,
) -> dict:
    """One run with one kill -9; returns the trial's findings (see the module docstring).
    The first trials take each of `phases` in turn, later ones one at random. A "reconfigure"
    kill lands a random 0..`switch_delay_s` after the switch's staging folder appears."""
    rng = random.Random(seed * 1000 + index)
    phase = phases[index % len(phases)] if index < len(phases) else rng.choice(phases)
    run_dir = root / f"trial-{index:02d}"
    shutil.rmtree(run_dir, ignore_errors=True)
    shm_before = staging_dirs()
    t0 = time.monotonic()
    with open(root / f"trial-{index:02d}.log", "w") as log:
        switch_step = rng.randint(3, steps - 4) if phase == "reconfigure" else 0
        proc = subprocess.Popen(
            train_command(run_dir, steps, index % 3, switch_step),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        result: dict = {"trial": index, "phase": phase, "killed": False, "switch_step": switch_step or None}
        try:
            moment = _wait_for_kill_moment(proc, run_dir, phase, rng, steps, t0 + timeout_s / 2, switch_delay_s)
            pids = workers(proc.pid)
            if moment is not None and pids:
                victim = rng.choice(pids)
                os.kill(victim, signal.SIGKILL)
                result.update(
                    moment,
                    killed=True,
                    victim_local_index=pids.index(victim),
                    killed_at_s=round(time.monotonic() - t0, 2),
                )
                while any(alive(p) for p in pids) and time.monotonic() < t0 + timeout_s:
                    time.sleep(0.01)  # the agent stops the other worker
                if moment.get("switch_path") == "direct":  # did the switch finish first?
                    result["confirmed"] = switch_open(root / f"trial-{index:02d}.log")
                good, bad = verify_all(run_dir / "checkpoints")
                result["valid_after_kill"], result["corrupt_after_kill"] = good, bad
            try:
                proc.wait(timeout=max(t0 + timeout_s - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                result["timeout"] = True
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    result["exit_code"] = proc.returncode
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["leaked_staging"] = sorted(staging_dirs() - shm_before)
    return result | analyse(run_dir, steps, result)


def resume_points(run_dir: Path, runs: list[list[dict]]) -> list[int]:
    """Checkpoint steps the restarts resumed from: the trainer's "resumed from step-N" lines in
    the trial's log (a resume exactly at the last logged step leaves no trace in the metrics),
    else the metrics' attempts (a restart from scratch, 0, prints no such line)."""
    log = run_dir.with_suffix(".log")
    text = log.read_text(errors="replace") if log.exists() else ""
    found = [int(m) for m in re.findall(r"resumed from step-(\d+)", text)]
    return found or [r[0]["step"] - 1 for r in runs[1:]]


def analyse(run_dir: Path, steps: int, result: dict) -> dict:
    """The checks of the module docstring on a finished trial's run folder."""
    rows = read_rows(run_dir)
    traj = trajectory(rows)
    runs = attempts(rows)
    lost, repeated = sample_accounting(traj)
    compared, mismatches, worst = loss_continuity(rows)
    good, bad = verify_all(run_dir / "checkpoints")
    resumed_at = resume_points(run_dir, runs)
    if not result["killed"]:
        resume_ok = len(runs) <= 1
    else:  # the restart must begin one past the newest checkpoint valid at the kill (0: none)
        resume_ok = (resumed_at[0] if resumed_at else 0) == max(result["valid_after_kill"] or [0])
    complete = sorted(traj) == list(range(1, steps + 1))
    return {
        "survived": result["exit_code"] == 0 and complete,
        "steps_done": max(traj) if traj else 0,
        "attempts": len(runs),
        "resumed_from": resumed_at,
        "resume_ok": resume_ok,
        "samples_lost": lost,
        "samples_repeated": repeated,
        "checkpoint_offsets_ok": offsets_match(run_dir / "checkpoints", traj),
        "loss_steps_compared": compared,
        "loss_mismatches": mismatches,
        "loss_max_abs_diff": worst,
        "corrupt_checkpoints": len(bad) + len(result.get("corrupt_after_kill", [])),
        "corrupt": bad + result.get("corrupt_after_kill", []),
        "valid_checkpoints_end": good,
        "plans": sorted({str(_plan(r)) for r in traj.values()}),
    }


# ------------------------------------------------------------------------------- many trials


def run_trials(
    trials: int,
    steps: int,
    seed: int,
    root: Path,
    echo: bool = True,
    phases: tuple[str, ...] = PHASES,
    switch_delay_s: float = 0.3,
) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for i in range(trials):
        r = run_trial(i, root, steps, seed, phases=phases, switch_delay_s=switch_delay_s)
        results.append(r)
        if echo:
            print(_row(r), flush=True)
    return {"summary": summarise(results, steps, seed), "trials": results}


def summarise(results: list[dict], steps: int, seed: int) -> dict:
    trials = len(results)
    killed = [r for r in results if r["killed"]]
    return {
        "trials": trials,
        "steps": steps,
        "seed": seed,
        "survived": sum(r["survived"] for r in results),
        "killed": len(killed),
        "resumed_from_last_good": sum(r["resume_ok"] for r in results),
        "samples_lost": sum(r["samples_lost"] for r in results),
        "samples_repeated": sum(r["samples_repeated"] for r in results),
        "checkpoint_offsets_ok": sum(r["checkpoint_offsets_ok"] for r in results),
        "loss_steps_compared": sum(r["loss_steps_compared"] for r in results),
        "loss_mismatches": sum(r["loss_mismatches"] for r in results),
        "corrupt_checkpoints": sum(r["corrupt_checkpoints"] for r in results),
        "kills_by_phase": {p: sum(r["phase"] == p for r in killed) for p in PHASES},
        "kills_in_phase_confirmed": sum(bool(r.get("confirmed")) for r in killed),
        "leaked_staging_dirs": sum(len(r["leaked_staging"]) for r in results),
        "mean_trial_s": round(sum(r["wall_s"] for r in results) / max(trials, 1), 1),
    }


def _row(r: dict) -> str:
    eq = r["loss_steps_compared"] - r["loss_mismatches"]
    return (
        f"trial {r['trial']:2d} {r['phase']:<11} killed={r['killed']!s:<5} "
        f"at={r.get('at_step', '-')!s:<3} exit={r['exit_code']} survived={r['survived']!s:<5} "
        f"resumed={r['resumed_from']} lost={r['samples_lost']} "
        f"repeated={r['samples_repeated']} loss_eq={eq}/{r['loss_steps_compared']} "
        f"corrupt={r['corrupt_checkpoints']} {r['wall_s']} s"
    )


def print_summary(s: dict) -> None:
    phases = ", ".join(f"{k} {v}" for k, v in s["kills_by_phase"].items())
    print(
        f"\nsurvived {s['survived']}/{s['trials']}  (killed {s['killed']}: {phases}; "
        f"{s['kills_in_phase_confirmed']} confirmed inside the phase)"
    )
    print(f"resumed from the last good checkpoint: {s['resumed_from_last_good']}/{s['trials']}")
    print(
        f"samples lost {s['samples_lost']}, repeated {s['samples_repeated']}; "
        f"checkpoint offsets consistent {s['checkpoint_offsets_ok']}/{s['trials']}"
    )
    print(
        f"loss after resume: {s['loss_steps_compared'] - s['loss_mismatches']}/"
        f"{s['loss_steps_compared']} redone steps bit-identical"
    )
    print(
        f"corrupt checkpoints found {s['corrupt_checkpoints']}; leaked /dev/shm staging "
        f"folders {s['leaked_staging_dirs']}; mean trial {s['mean_trial_s']} s"
    )


def reanalyse(report: dict, root: Path) -> dict:
    """Recompute every trial's checks from its kept run folder (after changing a check)."""
    steps = report["summary"]["steps"]
    trials = [t | analyse(root / f"trial-{t['trial']:02d}", steps, t) for t in report["trials"]]
    out = summarise(trials, steps, report["summary"]["seed"])
    return {"summary": out, "trials": trials}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--steps", type=int, default=14, help="max_steps of each run (>= 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="run folders (default: a temp folder)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "faults.json"))
    p.add_argument("--phases", default=",".join(PHASES), help="kill phases to draw from")
    p.add_argument("--reanalyse", metavar="JSON", help="recheck a finished run (needs --workdir)")
    args = p.parse_args(argv)
    if args.trials < 1 or args.steps < 8:
        p.error("--trials must be >= 1 and --steps >= 8")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="copus-faults-"))
    if args.reanalyse:
        if not args.workdir:
            p.error("--reanalyse needs --workdir (the kept run folders)")
        report = reanalyse(json.loads(Path(args.reanalyse).read_text()), root)
    else:
        phases = tuple(x for x in args.phases.split(",") if x)
        if not phases or any(x not in PHASES for x in phases):
            p.error(f"--phases {args.phases!r}: allowed: a comma-separated subset of {','.join(PHASES)}")
        report = run_trials(args.trials, args.steps, args.seed, root, phases=phases)
    print_summary(report["summary"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    s = report["summary"]
    ok = (
        s["survived"] == s["trials"]
        and s["samples_lost"] == s["samples_repeated"] == 0
        and s["corrupt_checkpoints"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
