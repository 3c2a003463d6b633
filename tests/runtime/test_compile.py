"""`train.compile`: compiled blocks (inductor) against eager through what copus does while running.

2 gloo ranks, a 1-layer model. Eager and compiled engines train the same batches: at layout
dp=2 with micro-batch sizes 2 → 4 → 1 (two `set_plan` batch changes), then a layout switch to
tp=2 (a new engine in the same process, as an in-process reconfiguration builds one) with
selective AC, sizes 2 → 4. Checked: losses and noise-scale statistics agree (rtol 1e-4), no
graph break, and the number of compiled graphs stays bounded (dynamic batch dimension: one
graph for sizes ≥ 2 and one for size 1 per layout).
"""

import pytest
import torch

from copus.core.plan.plan import ParallelPlan
from copus.core.specs.models import ModelShape
from tests.runtime._workers import run_ranks

SHAPE = ModelShape(name="t", n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, seq_len=16)
LR = 1e-2
# (layout, settings, [(global batch, micro-batch size)...])
PHASES = [
    ((2, 1, 1), {}, [(8, 2), (8, 4), (4, 1)]),
    ((1, 2, 1), {"activation_checkpointing": "selective"}, [(4, 2), (8, 4)]),
]


def _batch(step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, SHAPE.vocab_size, (rows, SHAPE.seq_len + 1), generator=g)


def _work():
    """Eager then compiled, in one launch (one process start per rank)."""
    from copus.runtime.engine.dist import MeshCache

    cache = MeshCache("cpu")
    return {"eager": _phases(cache, False), "compiled": _phases(cache, True)}


def _phases(cache, compile: bool) -> dict:
    from torch._dynamo.utils import counters

    from copus.runtime.engine.engine import Engine, EngineSettings

    counters.clear()
    outs, step = [], 0
    for (dp, tp, pp), kw, sizes in PHASES:
        gbs, mbs = sizes[0]
        plan = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=gbs // (dp * mbs))
        eng = Engine(SHAPE, plan, EngineSettings(compile=compile, **kw), "cpu", cache, seed=0)
        for gbs, mbs in sizes:
            eng.set_plan(eng.plan.with_batch(gbs, micro_batch_size=mbs))
            n = gbs // dp
            tokens = _batch(step, gbs)[eng.dp_rank * n : (eng.dp_rank + 1) * n]
            o = eng.train_step(tokens, LR)
            outs.append((o.loss, o.small_sqnorm, o.big_sqnorm))
            step += 1
        eng.close()
    return {"outs": outs, "graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


@pytest.fixture(scope="module")
def results():
    ranks = run_ranks(_work, 2, timeout=900)
    return {k: [r[k] for r in ranks] for k in ("eager", "compiled")}


@pytest.mark.slow
def test_compiled_matches_eager_through_batch_and_layout_changes(results):
    eager, comp = results["eager"][0], results["compiled"][0]
    assert len(comp["outs"]) == sum(len(p[2]) for p in PHASES)
    for e, c in zip(eager["outs"], comp["outs"]):
        assert c == pytest.approx(e, rel=1e-4)
    assert results["compiled"][0]["outs"] == results["compiled"][1]["outs"]


@pytest.mark.slow
def test_compile_has_no_graph_break_and_bounded_graphs(results):
    comp = results["compiled"][0]
    assert comp["breaks"] == 0
    # dp=2: sizes {2, 4} share one dynamic graph, size 1 is its own; tp=2: one dynamic graph
    assert comp["graphs"] == 3
    assert results["eager"][0]["graphs"] == 0


def test_compile_unavailable_is_one_line(monkeypatch):
    from torch._inductor import cpp_builder

    from copus.runtime.engine.parallelize import check_compile_available

    def missing():
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    with pytest.raises(
        ValueError,
        match=r"^train.compile=true is unavailable here .*"
        r"allowed: train.compile=false$",
    ):
        check_compile_available()
