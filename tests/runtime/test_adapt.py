"""copus.adapt: the library API inside a user's own loop (issue 9)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.runtime._workers import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _api_vs_engine():
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from copus.adapt import AdaptiveBatch
    from copus.core.specs.resolve import get_model_shape
    from copus.core.plan.plan import ParallelPlan
    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.engine import Engine, EngineSettings, token_loss
    from copus.runtime.engine.model import build_model, materialize

    shape = get_model_shape("tiny")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (8, shape.seq_len + 1), generator=gen)[rank * 4:(rank + 1) * 4]
    plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=2)
    engine = Engine(shape, plan, EngineSettings(grad_clip=0.0), "cpu", MeshCache("cpu"), seed=3)
    out = engine.train_step(tokens, lr=0.0)

    model = build_model(shape, "meta")
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    materialize(model, "cpu", seed=3)
    adapt = AdaptiveBatch(model, policy="constant", initial_batch=8, micro_batch_size=2)
    adapt.begin_step()
    total = 0.0
    for k, chunk in enumerate(tokens.chunk(adapt.num_microbatches)):
        model.set_requires_gradient_sync(adapt.is_last_microbatch(k))
        loss = token_loss(model(chunk[:, :-1]), chunk[:, 1:])
        (loss / 2).backward()
        total += loss.item() / 2
    adapt.end_step(total)
    r = adapt.last_record
    return {"engine": (out.loss, out.small_sqnorm, out.big_sqnorm, out.num_small),
            "api": (r.loss, r.small_sqnorm, r.big_sqnorm, r.num_small)}


def test_api_statistics_equal_the_trainer_engine():
    """Same init, same samples, dp=2, 2 micro-batches: s̄, q, J and the loss agree to fp32
    round-off (rel 1e-5: the two paths sum the same numbers in a different order)."""
    res = run_ranks(_api_vs_engine, 2)
    for r in res:
        e, a = r["engine"], r["api"]
        assert e[3] == a[3] == 4
        for x, y in zip(e[:3], a[:3]):
            assert abs(x - y) <= 1e-5 * abs(x), (e, a)


def test_example_runs_under_torchrun_and_its_batch_grows():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "own_loop.py"), "--policy", "norm-test", "--steps", "21"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 21
    assert rows[0]["global_batch_size"] == 8
    assert rows[-1]["global_batch_size"] > 8, rows[-1]
    assert rows[-1]["loss"] < rows[0]["loss"]
