"""`Engine.close` frees the engine's tensors by reference counting (no `gc.collect()`), and a
tensor the caller still holds stays valid."""

import pytest
import torch
from tests.runtime._workers import run_ranks

from copus.core.plan.plan import ParallelPlan
from copus.core.specs.models import ModelShape

SHAPE = ModelShape(name="t", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128, seq_len=16)


def _work(mode: str, dtype: str):
    import gc
    import weakref

    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.engine import Engine, EngineSettings

    cache = MeshCache("cpu")
    plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=1, num_microbatches=2)
    tokens = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.seq_len + 1), generator=torch.Generator().manual_seed(0))
    gc.collect()
    gc.disable()
    try:
        eng = Engine(SHAPE, plan, EngineSettings(gns_small=mode, dtype=dtype), "cpu", cache, seed=0)
        eng.train_step(tokens, 1e-3)
        eng.train_step(tokens, 1e-3)  # gradients of the last step are dropped by zero_grad
        p = eng.model.layers["0"].feed_forward.w1.weight
        state = eng.optimizer.state[p]
        refs = [
            weakref.ref(p._local_tensor),
            weakref.ref(state["exp_avg"]._local_tensor),
            weakref.ref(state["exp_avg_sq"]._local_tensor),
        ]
        held = eng.model.norm.weight.full_tensor()
        held_sum = float(held.sum())
        del p, state
        eng.close()
        del eng
        alive = [r() is not None for r in refs]
        valid = float(held.sum()) == held_sum
    finally:
        gc.enable()
    return alive, valid


@pytest.mark.parametrize("mode,dtype", [("microbatch", "fp32"), ("rank", "bf16")])
def test_close_frees_tensors_without_gc(mode, dtype):
    for alive, valid in run_ranks(_work, 2, mode, dtype):
        assert alive == [False, False, False]
        assert valid
