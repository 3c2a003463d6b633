"""Process groups across layout switches (issue 23): a switch destroys the sub-groups of the
layout it left (`MeshCache.release_except`), so 20 switches leave the live group count, the
open file descriptors (gloo's sockets; on NCCL, communicators and their device buffers) and the
RSS flat. Negative control: without the release every switch back builds fresh groups and the
descriptors pile up."""

from __future__ import annotations

import os

import pytest

from tests.runtime._workers import run_ranks


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _switches(release: bool, n: int = 20) -> list[dict]:
    import torch

    from copus.core.plan.plan import ParallelPlan
    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.engine import Engine, EngineSettings
    from copus.runtime.state import reconfigure as rc

    shape = get_model_shape("tiny")
    cache = MeshCache("cpu")
    plans = [
        ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=1),
        ParallelPlan(dp=1, tp=2, pp=1, micro_batch_size=2, num_microbatches=2),
    ]

    def build(plan, allocate=True, init=True):
        return Engine(shape, plan, EngineSettings(), "cpu", cache, seed=0, allocate=allocate, init=init)

    engine = build(plans[0])
    tokens = torch.randint(0, 256, (4, shape.seq_len + 1), generator=torch.Generator().manual_seed(0))
    out = []
    for i in range(1, n + 1):
        plan = plans[i % 2]
        engine, _report = rc.switch_engine(engine, plan, build)
        released = cache.release_except(dp=plan.dp, tp=plan.tp, pp=plan.pp) if release else 0
        r = engine.dp_rank
        local = tokens[2 * r : 2 * r + 2] if plan.dp == 2 else tokens
        engine.train_step(local, 1e-3)  # the new layout's groups work
        out.append(
            {"fds": len(os.listdir("/proc/self/fd")), "meshes": len(cache), "released": released, "rss_mb": _rss_mb()}
        )
    engine.close()
    return out


@pytest.mark.slow
def test_twenty_switches_keep_groups_and_memory_flat():
    rows = run_ranks(_switches, 2, True, timeout=600)[0]
    assert all(r["meshes"] == 1 for r in rows)
    assert all(r["released"] >= 1 for r in rows)
    fds = [r["fds"] for r in rows]
    assert max(fds[2:]) - min(fds[2:]) <= 2, fds
    rss = [r["rss_mb"] for r in rows]
    assert rss[-1] - rss[3] < 0.25 * rss[3], rss  # no growth with the switch count
    control = run_ranks(_switches, 2, False, 6, timeout=600)[0]
    assert control[-1]["meshes"] == 2  # without release: both layouts kept
