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
from tests.runtime._workers import exact_stats

SHAPE = ModelShape(name="t", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64,
                   vocab_size=64, seq_len=16)


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
