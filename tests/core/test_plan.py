import pytest
from hypothesis import given
from hypothesis import strategies as st

from copus.core.specs.models import MODELS

from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan, enumerate_plans, layouts, plan_problems


def test_global_batch_and_world():
    p = ParallelPlan(dp=2, tp=2, pp=1, micro_batch_size=4, num_microbatches=3)
    assert p.global_batch_size == 24 and p.world_size == 4
    with pytest.raises(AttributeError):
        p.dp = 3  # frozen


@pytest.mark.parametrize("field,value", [("dp", 0), ("tp", -1), ("micro_batch_size", 1.5), ("num_microbatches", True)])
def test_bad_degrees_name_the_field(field, value):
    kw = dict(dp=1, tp=1, pp=1, micro_batch_size=1, num_microbatches=1)
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        ParallelPlan(**kw)


def test_validation_names_bad_value():
    tiny = get_model_shape("tiny")
    with pytest.raises(ValueError, match="tp=4 must divide n_heads=6"):
        ParallelPlan(dp=1, tp=4, pp=1, micro_batch_size=1, num_microbatches=1).validate(4, tiny)
    with pytest.raises(ValueError, match="pp=8 must be <= n_layers=4"):
        ParallelPlan(dp=1, tp=1, pp=8, micro_batch_size=1, num_microbatches=8).validate(8, tiny)
    with pytest.raises(ValueError, match="must equal the world size 4"):
        ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=1, num_microbatches=1).validate(4, tiny)
    with pytest.raises(ValueError, match="num_microbatches=1 must be >= pp=2"):
        ParallelPlan(dp=2, tp=1, pp=2, micro_batch_size=1, num_microbatches=1).validate(4, tiny)
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        get_model_shape("nope")


def test_with_batch():
    p = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=1)
    assert p.with_batch(16).num_microbatches == 4
    assert p.with_batch(16, 8).num_microbatches == 1
    with pytest.raises(ValueError, match="global_batch_size=6"):
        p.with_batch(6, 4)


def test_layouts_of_tiny_at_4():
    assert sorted(layouts(4, get_model_shape("tiny"))) == sorted(
        [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]
    )


@given(
    world=st.sampled_from([1, 2, 4, 6, 8, 16]),
    model=st.sampled_from(sorted(MODELS)),
    batches=st.lists(st.integers(1, 256), min_size=1, max_size=5),
    mbs=st.lists(st.integers(1, 16), min_size=1, max_size=4),
)
def test_enumeration_yields_only_valid_plans(world, model, batches, mbs):
    shape = MODELS[model]
    plans = list(enumerate_plans(world, batches, mbs, shape))
    assert len(plans) == len(set(plans))
    for p in plans:
        assert plan_problems(p, world, shape) == []
        assert p.global_batch_size in batches and p.micro_batch_size in mbs
    # completeness: every valid combination is present
    expect = 0
    for dp, _tp, pp in layouts(world, shape):
        for b in set(batches):
            for m in set(mbs):
                if b % (dp * m) == 0 and (pp == 1 or b // (dp * m) >= pp):
                    expect += 1
    assert len(plans) == expect


def test_model_param_counts_are_close_to_published():
    # published sizes: Llama 2 7B ≈ 6.74B, 13B ≈ 13.0B, Llama 3.2 3B ≈ 3.21B, Qwen2.5 32B ≈ 32.8B
    assert abs(MODELS["llama-2-7b"].num_params() / 6.74e9 - 1) < 0.01
    assert abs(MODELS["llama-2-13b"].num_params() / 13.02e9 - 1) < 0.01
    assert abs(MODELS["llama-3.2-3b"].num_params() / 3.21e9 - 1) < 0.01
    assert abs(MODELS["qwen-2.5-32b"].num_params() / 32.8e9 - 1) < 0.02
    assert 1e6 <= MODELS["tiny"].num_params() <= 5e6
