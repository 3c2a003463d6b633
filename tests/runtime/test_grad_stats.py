"""GradStats hooks on a plain (single-process, unsharded) model against exact per-sample sums.

The distributed cases (FSDP2, TP with and without sequence parallel, PP) are checked end to end
in test_engine.py / test_engine_3d.py; here the hook arithmetic itself: per-micro-batch squared
norms (tensor hooks, before accumulation) and per-rank accumulated norms (post-accumulate hooks at
the K-th call), with the grad_scale conventions the engine uses.
"""

import pytest
import torch
import torch.nn.functional as F

from copus.core.specs.models import ModelShape
from copus.runtime.engine.grad_stats import GradStats, replication_weight, weighted_sqnorm
from copus.runtime.engine.model import build_model, materialize
from tests.runtime._workers import exact_stats, run_ranks

SHAPE = ModelShape(name="t", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, seq_len=16)


def _tokens(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SHAPE.vocab_size, (n, SHAPE.seq_len + 1), generator=g)


def _accumulate(model, tokens, k):
    """The engine's manual accumulation: backward of loss/K per micro-batch."""
    for chunk in tokens.chunk(k):
        loss = F.cross_entropy(model(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten())
        (loss / k).backward()


@pytest.mark.parametrize("mode,small", [("microbatch", 2), ("rank", 8)])
def test_hooks_equal_exact_per_sample_sums(mode, small):
    model = materialize(build_model(SHAPE, "cpu"), "cpu", 0)
    tokens = _tokens()
    ex = exact_stats(model, tokens, small_batch=small)
    k = 4
    stats = GradStats(model, tp=1, mode=mode, keep_grads=True)
    stats.begin(k, grad_scale=float(k) if mode == "microbatch" else 1.0)
    _accumulate(model, tokens, k)
    num_small = tokens.shape[0] // small
    assert float(stats.small_sqnorm_sum()) / num_small == pytest.approx(ex["small_sqnorm"], rel=1e-5)
    assert len(next(iter(stats.kept.values()))) == num_small
    # with dp = 1 the accumulated grad is ḡ itself
    big = float(weighted_sqnorm([p.grad for p in model.parameters()], tp=1))
    assert big == pytest.approx(ex["big_sqnorm"], rel=1e-5)
    stats.close()


def test_begin_resets_and_close_removes_hooks():
    model = materialize(build_model(SHAPE, "cpu"), "cpu", 0)
    stats = GradStats(model, tp=1, mode="microbatch")
    stats.begin(1, 1.0)
    _accumulate(model, _tokens(2), 1)
    first = float(stats.small_sqnorm_sum())
    assert first > 0
    model.zero_grad()
    stats.begin(1, 1.0)
    assert float(stats.small_sqnorm_sum()) == 0.0
    _accumulate(model, _tokens(2), 1)
    assert float(stats.small_sqnorm_sum()) == pytest.approx(first)
    stats.close()
    stats.begin(1, 1.0)
    _accumulate(model, _tokens(2), 1)
    assert float(stats.small_sqnorm_sum()) == 0.0


def test_plain_tensors_count_once_over_tp():
    t = torch.ones(4)
    assert replication_weight(t, tp=4) == 0.25
    assert float(weighted_sqnorm([t], tp=2)) == 2.0


def test_bad_mode():
    model = build_model(SHAPE)
    with pytest.raises(ValueError, match="gns_small"):
        GradStats(model, tp=1, mode="sample")


# ------------------------------------------------------------ FSDP2 at dp = 2, 4 micro-batches
DP2_SHAPE = ModelShape(name="t", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, seq_len=16)


def _unsharded_grad_bytes(model) -> int:
    """Bytes of dp-unsharded gradients FSDP2 holds now: autograd's `.grad` of the unsharded
    parameters plus FSDP2's reduce-dtype accumulator."""
    from torch.distributed.fsdp import FSDPModule

    records = [
        fp
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params
    ]
    total = 0
    for fp in records:
        for t in (
            getattr(getattr(fp, "_unsharded_param", None), "grad", None),
            getattr(fp, "unsharded_accumulated_grad", None),
        ):
            if t is not None:
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.untyped_storage().nbytes()
    return total


def _dp2_work():
    from copus.core.plan.plan import ParallelPlan
    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.engine import Engine, EngineSettings

    cache, out = MeshCache("cpu"), {}
    plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=1, num_microbatches=4)
    tokens = _tokens(8, seed=3)
    for mode in ("microbatch", "rank"):
        for dtype in ("fp32", "bf16"):
            eng = Engine(DP2_SHAPE, plan, EngineSettings(gns_small=mode, dtype=dtype), "cpu", cache, seed=0)
            seen: list[int] = []
            h = eng.model.register_forward_pre_hook(lambda m, a, seen=seen: seen.append(_unsharded_grad_bytes(m)))
            o = eng.train_step(tokens[eng.dp_rank * 4 : (eng.dp_rank + 1) * 4], 0.0)
            h.remove()
            out[(mode, dtype)] = {"small": o.small_sqnorm, "big": o.big_sqnorm, "num_small": o.num_small, "held": seen}
            eng.close()
    return out


@pytest.fixture(scope="module")
def dp2():
    return run_ranks(_dp2_work, 2, timeout=240)


@pytest.fixture(scope="module")
def dp2_exact():
    model = materialize(build_model(DP2_SHAPE, "cpu"), "cpu", 0)
    tokens = _tokens(8, seed=3)
    return {"microbatch": exact_stats(model, tokens, small_batch=1), "rank": exact_stats(model, tokens, small_batch=4)}


@pytest.mark.parametrize("mode", ["microbatch", "rank"])
def test_dp2_fp32_statistics_equal_exact(dp2, dp2_exact, mode):
    o = dp2[0][(mode, "fp32")]
    assert o["small"] == pytest.approx(dp2_exact[mode]["small_sqnorm"], rel=1e-4)
    assert o["big"] == pytest.approx(dp2_exact[mode]["big_sqnorm"], rel=1e-4)
    assert o["num_small"] == (8 if mode == "microbatch" else 2)


@pytest.mark.parametrize("mode", ["microbatch", "rank"])
def test_dp2_bf16_statistics_track_fp32(dp2, dp2_exact, mode):
    """bf16 compute with FSDP2's fp32 reduce: the small-gradient statistic within bf16 rounding
    (1 %) of the exact one. In "rank" mode FSDP2 keeps micro-batches 1..K-1 in its private fp32
    accumulator; reading `p.grad` alone gave the last micro-batch ÷ K (≈ 1/4 of the value)."""
    o = dp2[0][(mode, "bf16")]
    assert o["small"] == pytest.approx(dp2_exact[mode]["small_sqnorm"], rel=1e-2)
    assert o["big"] == pytest.approx(dp2_exact[mode]["big_sqnorm"], rel=1e-2)
    assert dp2[0][(mode, "bf16")] == dp2[1][(mode, "bf16")]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_microbatch_mode_holds_no_unsharded_gradient_between_micro_batches(dp2, dtype):
    """ "microbatch" reduce-scatters every micro-batch: at the start of each micro-batch's
    forward no dp-unsharded gradient exists. "rank" must accumulate this rank's gradient
    unsharded, so from the second micro-batch on it holds one."""
    assert dp2[0][("microbatch", dtype)]["held"] == [0, 0, 0, 0]
    held = dp2[0][("rank", dtype)]["held"]
    assert held[0] == 0 and all(b > 0 for b in held[1:])
