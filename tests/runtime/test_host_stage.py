"""Branch staging off the device (`host_stage.TensorStage`): a bit-identical restore in place,
12 bytes per local parameter, and a one-line refusal before anything changes when the copy
does not fit."""

import pytest
import torch
from tests.runtime._workers import run_ranks

from copus.core.plan.plan import ParallelPlan
from copus.core.specs.models import ModelShape

SHAPE = ModelShape(name="t", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128, seq_len=16)


def _snapshot(eng):
    out = [p.to_local().clone() for p in eng.model.parameters()]
    for p in eng.model.parameters():
        out += [
            v.to_local().clone() if hasattr(v, "to_local") else v.clone()
            for _, v in sorted(eng.optimizer.state[p].items())
        ]
    return out


def _work(folder: str):
    import os
    import shutil

    import torch.distributed as dist

    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.engine import Engine, EngineSettings
    from copus.runtime.train import host_stage

    eng = Engine(
        SHAPE,
        ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=1, num_microbatches=2),
        EngineSettings(),
        "cpu",
        MeshCache("cpu"),
        seed=0,
    )
    tokens = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.seq_len + 1), generator=torch.Generator().manual_seed(1))
    eng.train_step(tokens, 1e-2)
    before = _snapshot(eng)
    local = sum(p.to_local().numel() for p in eng.model.parameters())
    stage = host_stage.TensorStage(eng, folder, eng.plan.describe())
    dist.barrier()
    files = len(os.listdir(folder))
    eng.train_step(tokens, 1e-2)
    eng.train_step(tokens, 1e-2)
    changed = not all(torch.equal(a, b) for a, b in zip(before, _snapshot(eng)))
    stage.restore(eng)
    restored = all(torch.equal(a, b) for a, b in zip(before, _snapshot(eng)))
    nbytes = stage.nbytes
    stage.close()
    dist.barrier()
    left = len(os.listdir(folder))
    # a disk too small for the copy: refused with one line, nothing written or changed
    real = shutil.disk_usage
    host_stage.shutil.disk_usage = lambda p: real(p)._replace(free=100)
    try:
        host_stage.TensorStage(eng, folder, eng.plan.describe())
        error = None
    except host_stage.StageError as exc:
        error = str(exc)
    finally:
        host_stage.shutil.disk_usage = real
    untouched = all(torch.equal(a, b) for a, b in zip(before, _snapshot(eng)))
    eng.close()
    return {
        "files": files,
        "changed": changed,
        "restored": restored,
        "nbytes": nbytes,
        "local": local,
        "left": left,
        "error": error,
        "untouched": untouched,
        "after_refusal": len(os.listdir(folder)),
    }


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_ranks(_work, 2, str(tmp_path_factory.mktemp("stage")))[0]


def test_restore_is_bit_identical_in_place(result):
    assert result["files"] == 2 and result["changed"] and result["restored"]  # a file per rank
    assert result["left"] == 0


def test_staged_bytes_are_weights_and_adam_moments(result):
    # fp32 weights + exp_avg + exp_avg_sq (+ AdamW's scalar step per parameter)
    assert 12 * result["local"] <= result["nbytes"] <= 12 * result["local"] + 8 * 64


def test_refusal_names_the_plan_and_the_missing_bytes(result):
    msg = result["error"]
    assert msg is not None and "\n" not in msg
    assert "dp2.tp1.pp1" in msg
    missing = result["nbytes"] - 100
    assert f"{missing:,} missing" in msg
    assert result["untouched"] and result["after_refusal"] == 0
