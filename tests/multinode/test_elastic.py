"""Elastic world size (`torchrun --nnodes 1:2`): hosts leave and join a running copus job.

Shrink (runs by default): two namespaced hosts train with no fixed dp (the plan is chosen for
whatever world the rendezvous forms) and a checkpoint every 4 steps. Once step 6 is logged, every
process in host 2's namespace (elastic agent and worker) is killed with SIGKILL. Host 1's worker
fails in a gloo collective, its agent opens a new rendezvous round, which closes with one node,
and the restarted worker (TORCHELASTIC_RESTART_COUNT=1) resumes from the latest checkpoint under
a plan for world 1.

Grow: host 1 trains alone, host 2 joins; both agents restart their workers into a world of 2
(a membership change: TORCHELASTIC_RESTART_COUNT stays 0), which resume from the latest
checkpoint of the same run (same --rdzv-id) under a plan replanned for world 2. On a fast machine
host 1 would finish its 10 steps before host 2's agent has even imported torch, so once step 6 is
logged host 1's worker is paused (SIGSTOP) until its agent, seeing the waiting node, signals it
to stop (the signal shows as pending in /proc); then it is continued and ends -- so the join
always lands mid-run whatever the machine's speed.

Checked: the launcher exits 0; the steps before the checkpoint ran at the old world, the final
lineage after it at the new one, under the layout of the one "world size changed from X to Y"
decision in decisions.jsonl (the replan: global batch kept, the fastest plan of the new world by
the step-time model, micro-batch as configured); the steps run twice (before and after the change)
have the same loss to rel. 1e-5 (same parameters, optimizer state and samples; only the reduction
order differs); sample accounting: every step of the final lineage advanced the global sample
offset by its global batch, and the summary's samples/tokens are their sums.

The c10d store is served by host 1's agent (the rendezvous endpoint), so host 1 must survive:
that is c10d's limit, not copus's (etcd-v2 serves the store from outside the job).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import netns  # noqa: E402

SKIP = netns.skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(SKIP is not None, reason=f"no network namespaces: {SKIP}")]

STEPS, CKPT_EVERY, CHANGE_AFTER, BATCH, SEQ_LEN = 10, 4, 6, 8, 128
REL_TOL = 1e-5
TRAIN = [
    "-m",
    "copus",
    "train",
    "--max-steps",
    str(STEPS),
    "--policy",
    "constant",
    "--seed",
    "0",
    "--set",
    "parallel.micro_batch_size=2",
    "--set",
    f"batch.initial={BATCH}",
    "--set",
    "data.max_chars=100000",
    "--set",
    "train.warmup_tokens=0",
    "--set",
    "train.lr_schedule=constant",
    "--set",
    "eval.interval_steps=0",
    "--set",
    f"checkpoint.interval_steps={CKPT_EVERY}",
    "--set",
    "log.progress=false",
    "--set",
    "log.tensorboard=false",
]
# last_call_timeout: how long a round with >= min nodes waits for more (a round closes at once
# when max nodes have joined); keep-alive: how fast a dead agent is noticed.
RDZV = dict(last_call_timeout=3, keep_alive_interval=1, keep_alive_max_attempt=3)
# torch 2.13's agent-shared TCPStore deadlocks a scale-up round in which rank 0 keeps rank 0
# (the joining agent waits for MASTER_ADDR under the new round's prefix, which rank 0 never
# writes again); pytorch/pytorch#135712 documents this switch for elastic restarts.
ENV = dict(PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _start(host, hosts, run_dir: Path, log_path: Path):
    argv = netns.torchrun_argv(
        host,
        hosts[0],
        [*TRAIN, "--run-dir", str(run_dir)],
        nnodes="1:2",
        nproc_per_node=1,
        rdzv_id="elastic",
        max_restarts=3,
        rdzv_conf=RDZV,
    )
    return host.popen(argv, env=dict(os.environ, **ENV), stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def _wait_for_step(run_dir: Path, step: int, proc, timeout_s: float = 300) -> None:
    deadline = time.perf_counter() + timeout_s
    while not any(r["step"] >= step for r in _rows(run_dir)):
        assert proc.poll() is None and time.perf_counter() < deadline, (
            "run ended or stalled before the membership change"
        )
        time.sleep(0.05)


def _pause_workers(host, agent) -> list[int]:
    """SIGSTOP every process in `host`'s namespace except its elastic agent (its workers)."""
    pids = [
        int(p)
        for p in subprocess.run(["ip", "netns", "pids", host.name], text=True, capture_output=True).stdout.split()
    ]
    workers = [pid for pid in pids if pid != agent.pid]
    assert workers, "no worker to pause"
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    return workers


def _resume_when_replaced(pids: list[int], timeout_s: float) -> None:
    """SIGCONT each paused worker once its agent has signalled it to stop (the membership change
    was noticed: the signal is pending on the stopped process), or at the deadline."""
    deadline = time.perf_counter() + timeout_s
    waiting = list(pids)
    while waiting:
        for pid in list(waiting):
            if time.perf_counter() > deadline or _signal_pending(pid):
                _cont(pid)
                waiting.remove(pid)
        time.sleep(0.1)


def _signal_pending(pid: int) -> bool:
    """Whether a terminating signal (SIGTERM/SIGINT/SIGKILL) waits on `pid` (or it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    pending = int(fields.get("ShdPnd", "0"), 16) | int(fields.get("SigPnd", "0"), 16)
    return any(pending >> (sig - 1) & 1 for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL))


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _resume_decision(run_dir: Path, world_before: int, world_after: int) -> dict:
    """The one replan decision the resume logged, with its reason and candidates."""
    rows = [json.loads(x) for x in (run_dir / "decisions.jsonl").read_text().splitlines()]
    replans = [d for d in rows if d.get("resumed_from")]
    assert len(replans) == 1, rows
    d = replans[0]
    assert d["reason"].startswith(
        f"world size changed from {world_before} to {world_after}: global batch {BATCH} kept; "
    ), d["reason"]
    assert d["kind"] == "reconfigure" and d["global_batch_size"] == BATCH
    assert d["dp"] * d["tp"] * d["pp"] == world_after and d["micro_batch_size"] == 2
    assert d["candidates"][0]["dp"] == d["dp"] and len(d["candidates"]) >= 1
    return d


def _check_lineage(run_dir: Path, log: str, world_before: int, world_after: int) -> None:
    """One membership change: rows of the first attempt, then the resumed attempt."""
    found = re.search(r"resumed from step-(\d+)", log)
    assert found, log[-4000:]
    ckpt_step = int(found.group(1))  # 4 unless the first attempt outran the change past step 8
    assert ckpt_step >= CKPT_EVERY  # a multiple of CKPT_EVERY, or the step a graceful stop saved
    rows = _rows(run_dir)

    def world(r: dict) -> int:
        return r["dp"] * r["tp"] * r["pp"]

    # the resumed attempt starts where a step repeats or (after a graceful stop saved the last
    # step) where the world size changes
    cut = next(
        (
            i
            for i in range(1, len(rows))
            if rows[i]["step"] <= rows[i - 1]["step"] or world(rows[i]) != world(rows[i - 1])
        ),
        None,
    )
    assert cut is not None, "metrics.jsonl shows no restart"
    first, resumed = rows[:cut], rows[cut:]
    assert [r["step"] for r in first] == list(range(1, len(first) + 1))
    assert len(first) >= CHANGE_AFTER
    assert all(r["dp"] == world_before for r in first), [r["dp"] for r in first]  # no fixed dp
    assert [r["step"] for r in resumed] == list(range(ckpt_step + 1, STEPS + 1))
    replan = _resume_decision(run_dir, world_before, world_after)
    print(f"replan: {replan['reason']}")
    layout = (replan["dp"], replan["tp"], replan["pp"])
    assert all((r["dp"], r["tp"], r["pp"]) == layout for r in resumed)  # replanned
    for before, after in zip(first[ckpt_step:], resumed):  # steps run twice
        assert after["loss"] == pytest.approx(before["loss"], rel=REL_TOL), after["step"]
    offset = 0
    for r in first[:ckpt_step] + resumed:
        offset += r["global_batch_size"]
        assert r["samples"] == offset and r["tokens"] == offset * SEQ_LEN, r
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["samples"] == STEPS * BATCH == offset
    assert summary["tokens"] == STEPS * BATCH * SEQ_LEN
    assert tuple(summary["final_plan"][k] for k in ("dp", "tp", "pp")) == layout


def test_host_dies_survivor_resumes_at_smaller_world(tmp_path):
    run_dir = tmp_path / "run"
    with netns.hosts(2) as hosts:
        t0 = time.perf_counter()
        procs = [_start(h, hosts, run_dir, tmp_path / f"host{h.index}.log") for h in hosts]
        _wait_for_step(run_dir, CHANGE_AFTER, procs[0])
        kill_s = time.perf_counter() - t0
        assert netns.kill_host(hosts[1])  # agent + worker of host 2
        results = netns.wait_all(procs, timeout_s=300)
        total_s = time.perf_counter() - t0
    log = (tmp_path / "host1.log").read_text()
    print(f"elastic shrink: host 2 killed at {kill_s:.1f} s, finished at {total_s:.1f} s")
    assert results[0][0] == 0, log[-4000:]
    assert results[1][0] != 0  # killed
    _check_lineage(run_dir, log, world_before=2, world_after=1)


def test_host_joins_running_job_and_it_resumes_at_larger_world(tmp_path):
    run_dir = tmp_path / "run"
    with netns.hosts(2) as hosts:
        t0 = time.perf_counter()
        first = _start(hosts[0], hosts, run_dir, tmp_path / "host1.log")
        _wait_for_step(run_dir, CHANGE_AFTER, first)
        paused = _pause_workers(hosts[0], first)
        join_s = time.perf_counter() - t0
        second = _start(hosts[1], hosts, run_dir, tmp_path / "host2.log")
        _resume_when_replaced(paused, timeout_s=120)
        print(f"paused worker signalled by its agent {time.perf_counter() - t0 - join_s:.1f} s after the pause")
        results = netns.wait_all([first, second], timeout_s=300)
        total_s = time.perf_counter() - t0
    log = "".join((tmp_path / f"host{i}.log").read_text() for i in (1, 2))  # rank 0: either
    print(f"elastic grow: host 2 joined at {join_s:.1f} s, finished at {total_s:.1f} s")
    assert [rc for rc, _ in results] == [0, 0], log[-4000:]
    _check_lineage(run_dir, log, world_before=1, world_after=2)
