"""Candidate enumeration, memory pruning and the goodput formula (COPUS Eqs. 6–8)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copus.core.plan.goodput import batch_values, build_candidates, goodput, rank
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import enumerate_plans, plan_problems


class ToyMemory:
    """Bytes per rank: parameters sharded by tp·pp plus activations ∝ micro_batch_size."""

    def bytes_per_rank(self, dp, tp, pp, micro_batch_size, num_microbatches):
        return 8e9 / (tp * pp) + 2e9 * micro_batch_size * np.minimum(num_microbatches, pp) / tp


def _plans(cands):
    return {(p.dp, p.tp, p.pp, p.micro_batch_size, p.num_microbatches) for p in cands.plans(range(len(cands)))}


@pytest.mark.parametrize("world", [1, 4, 8, 12])
def test_candidates_match_the_scalar_enumeration(world):
    shape = get_model_shape("llama-3.2-3b")
    cands = build_candidates(world, shape, min_batch=8, max_batch=96, micro_batch_sizes=[1, 2, 4])
    expected = {
        (p.dp, p.tp, p.pp, p.micro_batch_size, p.num_microbatches)
        for p in enumerate_plans(world, range(8, 97), [1, 2, 4], shape)
    }
    assert _plans(cands) == expected
    assert np.array_equal(cands.global_batch_size, cands.dp * cands.micro_batch_size * cands.num_microbatches)
    for i in range(0, len(cands), 7):
        assert not plan_problems(cands.plan(i), world, shape)


def test_index_of_and_layout_mask():
    cands = build_candidates(4, get_model_shape("tiny"), min_batch=4, max_batch=16)
    plan = cands.plan(5)
    assert cands.index_of(plan) == 5
    assert cands.same_layout(plan).sum() >= 1
    assert cands.index_of(plan.with_batch(4096 * plan.dp * plan.micro_batch_size)) is None


def test_geometric_grid_rounds_up_to_reachable_batches():
    vals = batch_values(16, 1024, 6, batch_grid="geometric", steps_per_octave=2)
    assert vals.min() >= 16 and vals.max() <= 1024
    assert np.all(vals % 6 == 0) and np.all(np.diff(vals) > 0)
    assert len(vals) <= 2 * 6 + 2  # about two per octave over 6 octaves
    with pytest.raises(ValueError, match="batch_grid='nope'"):
        batch_values(1, 2, 1, batch_grid="nope")


def test_memory_pruning_drops_exactly_the_plans_over_capacity():
    shape = get_model_shape("llama-3.2-3b")
    full = build_candidates(8, shape, min_batch=16, max_batch=64, memory_model=ToyMemory())
    cap = 6e9
    pruned = build_candidates(8, shape, min_batch=16, max_batch=64, memory_model=ToyMemory(), memory_capacity_bytes=cap)
    assert 0 < len(pruned) < len(full)
    assert np.all(pruned.memory_bytes <= cap)
    assert len(pruned) == int(np.sum(full.memory_bytes <= cap))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(min_batch=0, max_batch=4), "batch range"),
        (dict(min_batch=8, max_batch=4), "batch range"),
        (dict(min_batch=1, max_batch=4, micro_batch_sizes=[0]), "micro_batch_sizes"),
        (dict(min_batch=1, max_batch=4, memory_capacity_bytes=1e9), "memory_model"),
    ],
)
def test_bad_arguments_raise_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        build_candidates(4, get_model_shape("tiny"), **kw)


def test_goodput_formula():
    step = np.array([1.0, 2.0, 4.0])
    batch = np.array([16, 32, 64])
    b_noise = 32.0
    eff = (b_noise + 1) / (b_noise + batch)
    np.testing.assert_allclose(goodput(step, batch, b_noise, lr_aware=False), batch / step * eff)
    np.testing.assert_allclose(goodput(step, batch, b_noise), batch / step * eff * np.sqrt(batch))
    np.testing.assert_allclose(
        goodput(step, batch, b_noise, lr_ref_batch=16.0), batch / step * eff * np.sqrt(batch / 16)
    )
    # b_noise unknown (inf): pure throughput
    np.testing.assert_allclose(goodput(step, batch, float("inf"), lr_aware=False), batch / step)
    # broken step times never win
    assert goodput(np.array([np.nan, 0.0]), np.array([8, 8]), 4.0).tolist() == [0.0, 0.0]


def test_larger_b_noise_favours_larger_batches():
    """At equal throughput, goodput prefers small B when b_noise is small, large B when large."""
    batch = np.array([16, 256])
    step = batch / 100.0  # same samples/s
    assert rank(goodput(step, batch, 4.0, lr_aware=False))[0] == 0
    assert rank(goodput(step, batch, 1e5, lr_aware=False))[0] == 0  # E(B) < 1 always
    assert rank(goodput(step, batch, 1e5))[0] == 1  # sqrt(B) wins when noise is large
    g_small = goodput(step, batch, 4.0, lr_aware=False)
    g_big = goodput(step, batch, 1e5, lr_aware=False)
    assert g_small[1] / g_small[0] < g_big[1] / g_big[0]


def test_rank_sorts_best_first_and_breaks_ties_by_step_time():
    scores = np.array([1.0, 3.0, 3.0, np.nan, 2.0])
    step = np.array([1.0, 2.0, 1.0, 1.0, 1.0])
    assert rank(scores, step).tolist() == [2, 1, 4, 0, 3]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 1.0, 2.0, 2.5, np.nan]), min_size=1, max_size=30),
    st.integers(1, 35),
    st.randoms(use_true_random=False),
)
def test_rank_top_is_the_prefix_of_the_full_ranking(scores, top, rnd):
    scores = np.array(scores)
    step = np.array([rnd.choice([1.0, 2.0]) for _ in scores])
    full = rank(scores, step)
    assert sorted(full.tolist()) == list(range(len(scores)))
    assert rank(scores, step, top=top).tolist() == full[:top].tolist()
