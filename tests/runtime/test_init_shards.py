"""Shard-local initialisation (`model.init_weights`): every layout holds the same logical weights
as a plain single-process model, and each rank draws only its own shard.

One 4-rank gloo launch builds the engine under dp4, dp2·tp2 (FSDP2's `_StridedShard` rows),
tp2·pp2 and dp2·pp2; each rank returns its parameters' full tensors and the values it drew.
The shape makes every shard a whole number of initialisation tiles, so draws = shard exactly.
"""

import pytest
import torch
from tests.runtime._workers import run_ranks

from copus.core.plan.plan import ParallelPlan
from copus.core.specs.models import ModelShape

SHAPE = ModelShape(name="t", n_layers=2, dim=512, n_heads=4, n_kv_heads=2, ffn_dim=1024, vocab_size=512, seq_len=16)
LAYOUTS = [(4, 1, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)]


def _work():
    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.engine import Engine, EngineSettings
    from copus.runtime.engine.model import DrawCounter, init_std

    cache, out = MeshCache("cpu"), {}
    for dp, tp, pp in LAYOUTS:
        plan = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=1, num_microbatches=2 * pp)
        before = DrawCounter.values
        eng = Engine(SHAPE, plan, EngineSettings(), "cpu", cache, seed=5)
        drawn = DrawCounter.values - before
        local = sum(p.to_local().numel() for n, p in eng.model.named_parameters() if init_std(n, SHAPE) is not None)
        full = {n: p.full_tensor() for n, p in eng.model.named_parameters()}
        eng.close()
        before = DrawCounter.values
        eng = Engine(SHAPE, plan, EngineSettings(), "cpu", cache, seed=5, init=False)
        loaded = DrawCounter.values - before
        eng.close()
        out[(dp, tp, pp)] = {"full": full, "drawn": drawn, "local": local, "no_init": loaded}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_work, 4, timeout=300)


@pytest.fixture(scope="module")
def reference():
    from copus.runtime.engine.model import build_model, materialize

    model = materialize(build_model(SHAPE, "cpu"), "cpu", 5)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_holds_the_single_process_weights(ranks, reference, layout):
    seen: dict[str, torch.Tensor] = {}
    for r in ranks:
        seen.update(r[layout]["full"])
    assert sorted(seen) == sorted(reference)
    for name, ref in reference.items():
        assert torch.equal(seen[name], ref), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_draws_its_shard_only(ranks, layout):
    for r in ranks:
        assert r[layout]["drawn"] == r[layout]["local"]
        assert r[layout]["no_init"] == 0


def test_weights_depend_on_the_seed_and_look_normal(reference):
    from copus.runtime.engine.model import build_model, materialize

    other = materialize(build_model(SHAPE, "cpu"), "cpu", 6)
    w = reference["layers.0.feed_forward.w1.weight"]
    assert not torch.equal(w, other.layers["0"].feed_forward.w1.weight.detach())
    assert float(w.std()) == pytest.approx(0.02, rel=0.02)
    assert abs(float(w.mean())) < 1e-3
    wo = reference["layers.1.attention.wo.weight"]
    assert float(wo.std()) == pytest.approx(0.02 / 2.0, rel=0.03)  # 0.02/√(2L), L = 2
    assert torch.equal(reference["norm.weight"], torch.ones(SHAPE.dim))
