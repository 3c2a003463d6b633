"""Elastic world size: a host dies mid-run, the survivor resumes at a smaller world and finishes.

Two namespaced hosts run `torchrun --nnodes 1:2 --max-restarts 3 ... -m copus train` with no
fixed dp (the plan is chosen for whatever world the rendezvous forms) and a checkpoint every 4
steps. Once step 6 is logged, every process in host 2's namespace (its elastic agent and its
worker) is killed with SIGKILL. Host 1's worker then fails in a gloo collective, its agent
starts a new rendezvous round, which closes with one node; the restarted worker
(TORCHELASTIC_RESTART_COUNT=1) resumes from the step-4 checkpoint under a plan for world 1.

Checked: host 1 exits 0; steps 1..4 ran at dp=2, the final lineage after the checkpoint at dp=1;
the steps run twice (5, 6, ..., before and after the kill) have the same loss to rel. 1e-5 (same
parameters, optimizer state and samples; only the reduction order differs); sample accounting:
every step of the final lineage advanced the global sample offset by its global batch, and the
summary's samples/tokens are their sums.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import netns  # noqa: E402

SKIP = netns.skip_reason()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(SKIP is not None, reason=f"no network namespaces: {SKIP}")]

STEPS, CKPT_EVERY, KILL_AFTER, BATCH, SEQ_LEN = 16, 4, 6, 8, 128
REL_TOL = 1e-5
TRAIN = ["-m", "copus", "train", "--max-steps", str(STEPS), "--policy", "constant", "--seed", "0",
         "--set", "parallel.micro_batch_size=2", "--set", f"batch.initial={BATCH}",
         "--set", "data.max_chars=100000", "--set", "train.warmup_tokens=0",
         "--set", "train.lr_schedule=constant", "--set", "eval.interval_steps=0",
         "--set", f"checkpoint.interval_steps={CKPT_EVERY}",
         "--set", "log.progress=false", "--set", "log.tensorboard=false"]
# last_call_timeout: how long a round with >= min nodes waits for more (the first round closes
# at once when both hosts join); keep-alive: how fast a dead agent is noticed.
RDZV = dict(last_call_timeout=5, keep_alive_interval=1, keep_alive_max_attempt=3)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()
            if line.strip().endswith("}")]


def test_host_dies_survivor_resumes_at_smaller_world(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with netns.hosts(2) as hosts:
        logs = [open(tmp_path / f"host{h.index}.log", "w") for h in hosts]
        procs = [h.popen(netns.torchrun_argv(h, hosts[0], [*TRAIN, "--run-dir", str(run_dir)],
                                             nnodes="1:2", nproc_per_node=1, rdzv_id="elastic",
                                             max_restarts=3, rdzv_conf=RDZV),
                         env=env, stdout=log, stderr=subprocess.STDOUT)
                 for h, log in zip(hosts, logs)]
        t0 = time.perf_counter()
        deadline = t0 + 300
        while not any(r["step"] >= KILL_AFTER for r in _rows(run_dir)):
            assert procs[0].poll() is None and time.perf_counter() < deadline, \
                "run ended or stalled before the kill"
            time.sleep(0.2)
        kill_s = time.perf_counter() - t0
        assert netns.kill_host(hosts[1])  # agent + worker of host 2
        results = netns.wait_all(procs, timeout_s=300)
        total_s = time.perf_counter() - t0
        for log in logs:
            log.close()
    host1_log = (tmp_path / "host1.log").read_text()
    print(f"elastic run: host 2 killed at {kill_s:.1f} s, finished at {total_s:.1f} s")
    assert results[0][0] == 0, host1_log[-4000:]
    assert results[1][0] != 0  # killed
    found = re.search(r"resumed from step-(\d+)", host1_log)
    assert found, host1_log[-4000:]
    ckpt_step = int(found.group(1))  # 4 unless the first attempt outran the kill past step 8
    assert ckpt_step >= CKPT_EVERY and ckpt_step % CKPT_EVERY == 0

    rows = _rows(run_dir)
    cut = next((i for i in range(1, len(rows)) if rows[i]["step"] <= rows[i - 1]["step"]), None)
    assert cut is not None, "metrics.jsonl shows no restart"
    first, resumed = rows[:cut], rows[cut:]  # the attempt that lost host 2, the resumed one
    assert [r["step"] for r in first] == list(range(1, len(first) + 1))
    assert len(first) >= KILL_AFTER
    assert all(r["dp"] == 2 for r in first), "the first rendezvous did not form a 2-host world"
    assert [r["step"] for r in resumed] == list(range(ckpt_step + 1, STEPS + 1))
    assert all((r["dp"], r["tp"], r["pp"]) == (1, 1, 1) for r in resumed)  # replanned for world 1
    for before, after in zip(first[ckpt_step:], resumed):  # steps run twice
        assert after["loss"] == pytest.approx(before["loss"], rel=REL_TOL), after["step"]
    lineage = first[:ckpt_step] + resumed
    offset = 0
    for r in lineage:
        offset += r["global_batch_size"]
        assert r["samples"] == offset and r["tokens"] == offset * SEQ_LEN, r
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["samples"] == STEPS * BATCH == offset
    assert summary["tokens"] == STEPS * BATCH * SEQ_LEN
    assert summary["final_plan"]["dp"] == 1
