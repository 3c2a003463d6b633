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
    tokens = torch.randint(0, 256, (8, shape.seq_len + 1), generator=gen)[rank * 4 : (rank + 1) * 4]
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
    return {
        "engine": (out.loss, out.small_sqnorm, out.big_sqnorm, out.num_small),
        "api": (r.loss, r.small_sqnorm, r.big_sqnorm, r.num_small),
    }


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
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "examples" / "own_loop.py"),
        "--policy",
        "norm-test",
        "--steps",
        "21",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 21
    assert rows[0]["global_batch_size"] == 8
    assert rows[-1]["global_batch_size"] > 8, rows[-1]
    assert rows[-1]["loss"] < rows[0]["loss"]


def _meta_step(loss_as_tensor: bool):
    import torch
    from torch import nn

    from copus.adapt import AdaptiveBatch

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2)).to("meta")
    adapt = AdaptiveBatch(model, policy="constant", initial_batch=4, micro_batch_size=2)
    adapt.begin_step()
    for _ in range(adapt.num_microbatches):
        loss = model(torch.randn(2, 8, device="meta")).pow(2).mean()
        (loss / adapt.num_microbatches).backward()
    vec = adapt._statistics(loss if loss_as_tensor else 0.5)
    adapt.close()
    return vec


def test_statistics_vector_lives_on_the_models_device():
    """The statistics of a model on a non-default device (meta: shapes and devices, no data)
    stay on that device: loss (a device tensor or a float), Σ_j‖g_j‖² from the hooks and ‖ḡ‖²
    from `_foreach_norm` are stacked there. Before issue 23 a CPU loss tensor was stacked with
    the device's norms ("Tensor on device meta is not on the expected device cpu"; on CUDA the
    same error at every step of the torchtitan integration)."""
    import torch

    from copus.runtime.engine.grad_stats import weighted_sqnorm

    for as_tensor in (True, False):
        vec = _meta_step(as_tensor)
        assert vec.device.type == "meta" and vec.dtype == torch.float64 and vec.shape == (3,)
    grads = [torch.ones(3, device="meta"), torch.ones(2, 2, device="meta")]
    assert weighted_sqnorm(grads, tp=1).device.type == "meta"


def test_foreach_norm_matches_the_per_tensor_sum():
    """‖ḡ‖² from the grouped `_foreach_norm` equals Σ‖g‖² summed tensor by tensor (fp32)."""
    import torch

    from copus.runtime.engine.grad_stats import weighted_sqnorm

    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=gen) for s in ((5, 7), (11,), (3, 3, 3))]
    ts.append(torch.randn(4, 4, generator=gen).to(torch.bfloat16))
    want = sum(float(t.float().pow(2).sum()) for t in ts)
    assert abs(float(weighted_sqnorm(ts, tp=1)) - want) <= 1e-5 * want
    assert abs(float(weighted_sqnorm(ts, tp=2)) - want / 2) <= 1e-5 * want
