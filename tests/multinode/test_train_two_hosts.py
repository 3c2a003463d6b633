"""`copus train` across two namespaced hosts (torchrun, c10d rendezvous, gloo) equals one host.

Two network namespaces, one worker each, train 10 steps of the `tiny` model with a fixed plan
(dp=2, global batch 8, micro-batch 2, constant LR) and seed. The same command under
`torchrun --standalone --nproc-per-node 2` on one host is the reference. The data order, the
initialisation and the arithmetic do not depend on where ranks live, and gloo's 2-rank reductions
are the same algorithm over TCP either way, so the losses must agree to rel. 1e-5 (they are in
practice bit-identical; the tolerance only allows for a different reduction order).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import netns  # noqa: E402

SKIP = netns.skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(SKIP is not None, reason=f"no network namespaces: {SKIP}")]

STEPS = 10
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
    "parallel.dp=2",
    "--set",
    "parallel.micro_batch_size=2",
    "--set",
    "batch.initial=8",
    "--set",
    "data.max_chars=100000",
    "--set",
    "train.warmup_tokens=0",
    "--set",
    "train.lr_schedule=constant",
    "--set",
    "eval.interval_steps=0",
    "--set",
    "checkpoint.interval_steps=0",
    "--set",
    "log.progress=false",
    "--set",
    "log.tensorboard=false",
]


def _losses(run_dir: Path) -> list[tuple[int, float, int]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"], r["dp"]) for r in rows]


def _check(results: list[tuple[int, str]]) -> None:
    for rc, out in results:
        assert rc == 0, out[-4000:]


def test_two_namespaced_hosts_train_like_one_host(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with netns.hosts(3) as hosts:
        # reference on host 3: one host, two local workers (runs alongside, isolated)
        ref_dir = tmp_path / "one-host"
        ref = hosts[2].popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                *TRAIN,
                "--run-dir",
                str(ref_dir),
            ],
            **out,
        )
        # hosts 1 and 2, one worker each; the run folder is shared (as on a shared file system)
        run_dir = tmp_path / "two-hosts"
        pair = hosts[:2]
        before = [netns.rx_bytes(h) for h in pair]
        t0 = time.perf_counter()
        procs = [
            h.popen(
                netns.torchrun_argv(
                    h, pair[0], [*TRAIN, "--run-dir", str(run_dir)], nnodes="2", nproc_per_node=1, rdzv_id="train2"
                ),
                **out,
            )
            for h in pair
        ]
        results = netns.wait_all(procs, timeout_s=300)
        wall_s = time.perf_counter() - t0
        received = [netns.rx_bytes(h) - b for h, b in zip(pair, before)]
        _check(netns.wait_all([ref], timeout_s=300))
    _check(results)
    print(f"two-host run: {wall_s:.1f} s wall, veth rx bytes {received}")

    ref_losses, losses = _losses(ref_dir), _losses(run_dir)
    assert [s for s, _, _ in losses] == list(range(1, STEPS + 1))
    assert all(dp == 2 for _, _, dp in losses)
    assert losses[-1][1] < losses[0][1]  # it trained
    for (s, a, _), (_, b, _) in zip(ref_losses, losses, strict=True):
        assert b == pytest.approx(a, rel=REL_TOL), f"step {s}: one host {a} vs two hosts {b}"
    # the gradients went over the veth links: FSDP2 all-gathers + reduce-scatters of a ~1.4 MB
    # (fp32) model, 10 steps, each direction
    assert min(received) > 10 * 1_000_000
