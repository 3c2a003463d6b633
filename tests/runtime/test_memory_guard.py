"""Memory safety (issue 23): plans bounded by the memory model at the device's capacity less
parallel.memory_margin; an out-of-memory error on one rank stops every rank within seconds,
records the plan as infeasible in the run folder, and a resume never picks it again."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from copus.config import load_config
from copus.core.plan.plan import ParallelPlan
from copus.core.specs.resolve import get_model_shape
from copus.runtime.state import infeasible
from copus.runtime.train import perf

BASE = [
    "data.max_chars=200000",
    "eval.interval_steps=0",
    "log.progress=false",
    "log.tensorboard=false",
    "batch.initial=8",
    "batch.min=8",
    "batch.policy='constant'",
    "parallel.micro_batch_size=2",
    "train.lr_schedule=constant",
]


def test_capacity_is_the_device_memory_less_the_margin():
    cpu = torch.device("cpu")
    full = perf.device_memory_bytes(cpu)
    assert perf.memory_capacity_bytes(cpu, None, 0.0, 0.1) == pytest.approx(0.9 * full)
    assert perf.memory_capacity_bytes(cpu, None, 2.0, 0.25) == pytest.approx(1.5e9)


def test_infeasible_rule_and_fallback():
    bad = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=4, num_microbatches=2)
    same_layout_bigger = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=8, num_microbatches=2)
    one_microbatch = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=4, num_microbatches=1)
    other_layout = ParallelPlan(dp=1, tp=2, pp=1, micro_batch_size=4, num_microbatches=2)
    assert infeasible.covers(bad, bad) and infeasible.covers(bad, same_layout_bigger)
    assert not infeasible.covers(bad, one_microbatch)  # no unsharded fp32 grads at K = 1
    assert not infeasible.covers(bad, other_layout)
    fb = infeasible.fallback_plan(bad, [bad])
    assert (fb.micro_batch_size, fb.num_microbatches) == (2, 4)
    assert fb.global_batch_size == bad.global_batch_size
    tiny = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=1, num_microbatches=2)
    assert infeasible.fallback_plan(tiny, [tiny]) is None


def test_goodput_controller_forbids_recorded_plans_and_respects_capacity():
    from copus.core.control.controller import make_controller
    from copus.core.control.policies import PolicySettings

    shape = get_model_shape("tiny")
    start = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=2)
    settings = PolicySettings(initial=8, min=8, max=64)
    ctl = make_controller(settings, start, 2, shape)
    bad = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=4, num_microbatches=2)
    before = len(ctl.candidates)
    dropped = ctl.forbid(lambda p: infeasible.covers(bad, p))
    assert dropped > 0 and len(ctl.candidates) == before - dropped
    c = ctl.candidates
    left = [
        ParallelPlan(
            dp=int(c.dp[i]),
            tp=int(c.tp[i]),
            pp=int(c.pp[i]),
            micro_batch_size=int(c.micro_batch_size[i]),
            num_microbatches=int(c.num_microbatches[i]),
        )
        for i in range(len(c))
    ]
    assert not any(infeasible.covers(bad, p) for p in left)
    model = perf.runtime_memory_model(load_config(None, []), shape, "cpu")
    cap = float(model.bytes_per_rank(2, 1, 1, 4, 1))  # room for micro-batch 4, not 8
    bounded = make_controller(settings, start, 2, shape, memory_capacity_bytes=cap, memory_model=model)
    mem = bounded.candidates.memory_bytes
    assert len(bounded.candidates) and (mem <= cap).all()
    assert int(bounded.candidates.micro_batch_size.max()) <= 4


def oom_worker(cfg, run_dir: str, resume: bool) -> dict:
    """launch.worker, with rank 1's third engine step raising CUDA's out-of-memory error."""
    from copus.runtime.engine.engine import Engine
    from copus.runtime.train.launch import worker

    if os.environ["RANK"] == "1" and not resume:
        original, calls = Engine.train_step, [0]

        def train_step(self, tokens, lr):
            calls[0] += 1
            if calls[0] == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
            return original(self, tokens, lr)

        Engine.train_step = train_step
    return worker(cfg, run_dir, resume)


@pytest.mark.slow
def test_oom_on_one_rank_stops_all_and_resume_avoids_the_plan(tmp_path, capfd):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from copus.runtime.train.launch import launch

    cfg = load_config(None, [*BASE, "parallel.nproc=2", "train.max_steps=5", "checkpoint.interval_steps=2"])
    run = tmp_path / "run"
    t0 = time.monotonic()
    with pytest.raises(ChildFailedError):  # the elastic agent's report (max_restarts=0)
        launch(cfg, str(run), max_restarts=0, entry=oom_worker)
    ended = time.time()
    err = capfd.readouterr().err
    (row,) = [json.loads(x) for x in (run / infeasible.RECORD_FILE).read_text().splitlines()]
    assert (
        row["plan"] == {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 2, "num_microbatches": 2}
        and row["rank"] == 1
        and row["step"] == 3
    )
    lines = [x for x in err.splitlines() if "ran out of device memory at step 3" in x]
    assert len(lines) == 1 and "dp2.tp1.pp1 mb2x2" in lines[0] and "micro-batch 2" in lines[0]
    # every rank ended within seconds of the record (not the collective's 30-min timeout)
    assert ended - (run / infeasible.RECORD_FILE).stat().st_mtime < 15
    assert time.monotonic() - t0 < 240
    # resume from step 2: the recorded plan is never picked again (same batch, micro-batch 1)
    res = launch(cfg, str(run), resume=True, max_restarts=0)
    assert not res.get("error"), res
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    after = [r for r in rows if not r.get("superseded") and r["step"] > 2]
    assert [r["step"] for r in after] == [3, 4, 5]
    assert {(r["micro_batch_size"], r["num_microbatches"], r["global_batch_size"]) for r in after} == {(1, 4, 8)}
    assert "ran out of memory earlier in this run" in capfd.readouterr().out


def test_the_oom_line_is_out_before_the_record_that_ends_the_peers(tmp_path, capsys, monkeypatch):
    """The record is what ends the other ranks (OomWatch) and then the agent kills this one, so
    the one-line explanation must be on stderr before the record exists (seen in CI under load:
    the line was lost when the record went first)."""
    from copus.runtime.train import memory_guard

    guard = memory_guard.MemoryGuard.__new__(memory_guard.MemoryGuard)
    guard.model = perf.runtime_memory_model(load_config(None, []), get_model_shape("tiny"), "cpu")
    guard.capacity, guard.run_dir, guard.rank, guard.world = 2.0**30, tmp_path, 1, 2
    seen: list[str] = []
    record = infeasible.record

    def spy(*args, **kwargs):
        seen.append(capsys.readouterr().err)  # what stderr holds when the peers learn of it
        return record(*args, **kwargs)

    def no_exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(memory_guard.infeasible, "record", spy)
    monkeypatch.setattr(memory_guard.os, "_exit", no_exit)
    plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=2)
    with pytest.raises(SystemExit) as stop:
        guard.out_of_memory(plan, 3, torch.OutOfMemoryError("CUDA out of memory (test)"))
    assert stop.value.code == infeasible.EXIT_CODE
    assert len(seen) == 1 and "rank 1 ran out of device memory at step 3 under plan dp2.tp1.pp1 mb2x2" in seen[0]
    (row,) = [json.loads(x) for x in (tmp_path / infeasible.RECORD_FILE).read_text().splitlines()]
    assert row["rank"] == 1 and row["step"] == 3
