"""Step-time model and topology: vectorisation, structure of the equation, link tiers."""

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copus.core.specs.hardware import HARDWARE, Topology, crosses, get_hardware
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import layouts
from copus.core.cost.overlap import gamma_sum
from copus.core.cost.throughput import StepTimeModel, StepTimeParams

SEVEN_B = get_model_shape("llama-2-7b")
TINY = get_model_shape("tiny")


def _random_plans(rng, n):
    return (
        rng.choice([1, 2, 4, 8], n),
        rng.choice([1, 2, 4], n),
        rng.choice([1, 2, 4], n),
        rng.integers(1, 9, n),
        rng.integers(4, 64, n),
    )


@pytest.mark.parametrize("hw", sorted(HARDWARE))
def test_vectorised_predict_equals_scalar_loop(hw):
    model = StepTimeModel.analytic(SEVEN_B, hw, world_size=32)
    cols = _random_plans(np.random.default_rng(0), 300)
    vec = model.predict(*cols)
    loop = np.array([float(model.predict(*(int(c[i]) for c in cols))) for i in range(300)])
    assert vec.shape == (300,)
    np.testing.assert_allclose(vec, loop, rtol=1e-12)
    assert np.all(np.isfinite(vec)) and np.all(vec > 0)


def test_broadcasts_scalars_against_arrays():
    model = StepTimeModel.analytic(SEVEN_B, "h100-sxm", 16)
    out = model.predict(2, 2, 4, np.array([1, 2, 4]), 8)
    assert out.shape == (3,)
    assert out[0] == pytest.approx(float(model.predict(2, 2, 4, 1, 8)))


def test_more_microbatches_take_longer_and_bubble_shrinks():
    model = StepTimeModel.analytic(SEVEN_B, "h100-nvlink-pairs", 16)
    m = np.arange(4, 129)
    for dp, tp, pp in layouts(16, SEVEN_B):
        parts = model.breakdown(dp, tp, pp, 2, m)
        assert np.all(np.diff(parts["step_s"]) > 0), (dp, tp, pp)
        bubble = parts["bubble_s"] / parts["step_s"]
        if pp == 1:
            assert np.all(bubble == 0)
        else:
            assert np.all(np.diff(bubble) < 0), (dp, tp, pp)


def test_pipeline_without_communication_is_fill_plus_drain():
    """dp = 1, no comm or fixed costs: step = (m + pp − 1) × per-micro-batch stage time."""
    p = StepTimeParams(
        layer_overhead_s=1e-3,
        s_per_flop=1e-12,
        tp_latency_s=0,
        tp_s_per_byte=0,
        dp_latency_s=0,
        dp_s_per_byte=0,
        pp_latency_s=0,
        pp_s_per_byte=0,
        optimizer_s_per_param=0,
        step_overhead_s=0,
        gamma=2.0,
    )
    model = StepTimeModel(p, TINY)
    stage = float(model.breakdown(1, 1, 4, 2, 8)["compute_s"])
    assert float(model.predict(1, 1, 4, 2, 8)) == pytest.approx((8 + 4 - 1) * stage)
    # compute is affine in micro_batch_size and per stage: ceil(4/4) = 1 block + head
    flops = 6 * TINY.layer_params() + 12 * TINY.dim * TINY.seq_len + 6 * TINY.vocab_size * TINY.dim
    assert stage == pytest.approx(2 * 1e-3 + 1e-12 * 2 * TINY.seq_len * flops)


def test_single_rank_compute_matches_model_flops():
    """pp = 1: stage FLOPs = flops_per_token·seq minus the embedding lookup's nominal 6·V·h."""
    model = StepTimeModel.analytic(SEVEN_B, "h100-sxm")
    s = SEVEN_B
    expected = (s.flops_per_token() - 6 * s.vocab_size * s.dim) * s.seq_len
    assert float(model.stage_flops_per_sample(1)) == pytest.approx(expected)


def test_gamma_sum_limits():
    a, b = np.array([3.0, 0.0, 2.0]), np.array([4.0, 0.0, 0.0])
    np.testing.assert_allclose(gamma_sum(a, b, 1.0), [7.0, 0.0, 2.0])
    np.testing.assert_allclose(gamma_sum(a, b, 2.0), [5.0, 0.0, 2.0])
    assert gamma_sum(a, b, 60.0)[0] == pytest.approx(4.0, rel=1e-2)


def test_data_parallel_sync_hides_behind_compute_with_large_gamma():
    base = StepTimeModel.analytic(SEVEN_B, "h100-sxm", 8)
    no_overlap = base.with_params(replace(base.params, gamma=1.0))
    overlap = base.with_params(replace(base.params, gamma=10.0))
    assert float(overlap.predict(8, 1, 1, 2, 4)) < float(no_overlap.predict(8, 1, 1, 2, 4))
    # dp = 1: nothing to overlap, γ is irrelevant
    assert float(overlap.predict(1, 4, 2, 2, 4)) == pytest.approx(float(no_overlap.predict(1, 4, 2, 2, 4)))


def test_crosses_matches_explicit_rank_groups():
    """The closed form agrees with enumerating the (pp, dp, tp) mesh's groups rank by rank."""
    for world in (2, 4, 6, 8, 12, 16, 24):
        for domain in (1, 2, 3, 4, 8):
            topo = Topology(world_size=world, gpus_per_node=domain)
            for dp, tp, pp in layouts(world):
                for dim, size, stride in (("tp", tp, 1), ("dp", dp, tp), ("pp", pp, dp * tp)):
                    groups = topo.groups(dim, dp, tp, pp)
                    if dim == "pp":  # only adjacent stages talk
                        pairs = [(g[i], g[i + 1]) for g in groups for i in range(len(g) - 1)]
                    else:
                        pairs = [(a, b) for g in groups for a, b in itertools.combinations(g, 2)]
                    brute = any(a // domain != b // domain for a, b in pairs)
                    assert bool(crosses(size, stride, world, domain)) == brute, (world, domain, dim, dp, tp, pp)


def test_tiers_on_copus_nvlink_pairs_cluster():
    """COPUS §5.1: TP > 2 leaves the NVLink pair; dp groups spanning 16 ranks cross nodes."""
    hw = get_hardware("h100-nvlink-pairs")
    topo = Topology(world_size=16, gpus_per_node=hw.gpus_per_node, nvlink_group=hw.nvlink_group)
    assert topo.tier("tp", dp=8, tp=2, pp=1) == 0
    assert topo.tier("tp", dp=4, tp=4, pp=1) == 1
    assert topo.tier("dp", dp=8, tp=2, pp=1) == 2 and topo.crosses_nodes("dp", 8, 2, 1)
    assert topo.tier("dp", dp=4, tp=2, pp=2) == 1 and not topo.crosses_nodes("dp", 4, 2, 2)
    assert topo.crosses_nodes("pp", 4, 2, 2)
    model = StepTimeModel.analytic(SEVEN_B, hw, 16)
    tp_s = model.breakdown([4, 2], [2, 4], [2, 2], 1, 8)["tp_s"]
    per_byte_ratio = hw.tier_slowdown[1]
    assert tp_s[1] > tp_s[0] * per_byte_ratio / 2  # 4-way over PCIe vs 2-way over NVLink


def test_best_plan_moves_towards_data_parallel_as_batch_grows():
    """COPUS §5.3: TP/PP-heavy layouts win at small batch, DP-heavy at large (7B on 32 MI210)."""
    model = StepTimeModel.analytic(SEVEN_B, "mi210", 32)

    def best_dp(batch):
        scores = []
        for dp, tp, pp in layouts(32, SEVEN_B):
            for mbs in (1, 2, 4):
                if batch % (dp * mbs) == 0 and batch // (dp * mbs) >= pp:
                    scores.append((batch / float(model.predict(dp, tp, pp, mbs, batch // (dp * mbs))), dp))
        return max(scores)[1]

    assert best_dp(16) < best_dp(1024)


def test_params_roundtrip_and_validation():
    p = StepTimeParams.analytic(get_hardware("a100-80gb"))
    assert StepTimeParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="gamma"):
        replace(p, gamma=0.5)
    with pytest.raises(ValueError, match="s_per_flop"):
        replace(p, s_per_flop=float("nan"))
    with pytest.raises(ValueError, match="unknown StepTimeParams"):
        StepTimeParams.from_dict({**p.to_dict(), "alpha": 1.0})


def test_get_hardware_names_allowed_values():
    assert get_hardware("h100-sxm").nvlink_group == 8
    with pytest.raises(ValueError, match="allowed: a100-80gb, cpu, h100-") as err:
        get_hardware("tpu")
    from copus.core.specs.hardware import HARDWARE  # every profile named, sorted (issue 25 added one)

    assert f"allowed: {', '.join(sorted(HARDWARE))}" in str(err.value)


_POSITIVE = st.floats(min_value=1e-15, max_value=1e-1, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(
    coeffs=st.lists(_POSITIVE, min_size=10, max_size=10),
    gamma=st.floats(1.0, 10.0),
    layout=st.sampled_from(layouts(16, SEVEN_B)),
    mbs=st.integers(1, 16),
    m=st.integers(1, 64),
)
def test_step_time_grows_with_work_for_any_coefficients(coeffs, gamma, layout, mbs, m):
    names = [n for n in StepTimeParams.names() if n != "gamma"]
    model = StepTimeModel(
        StepTimeParams(**dict(zip(names, coeffs)), gamma=gamma), SEVEN_B, get_hardware("h100-nvlink-pairs")
    )
    dp, tp, pp = layout
    t = float(model.predict(dp, tp, pp, mbs, m))
    assert np.isfinite(t) and t > 0
    assert float(model.predict(dp, tp, pp, mbs, m + 1)) > t
    assert float(model.predict(dp, tp, pp, mbs + 1, m)) >= t


def test_every_micro_batch_reduce_scatters_its_gradients_unless_torch_stage_defers_it():
    """copus's engine reduce-scatters each micro-batch's fp32 gradients (the runtime's default
    gns.small = "microbatch"): with dp > 1 and m ≥ 2 the first m − 1 micro-batches overlap
    all-gather + reduce-scatter with compute (t_acc); torch's own PipelineStage at pp > 1
    reduces once after the last micro-batch, so the step is the older, cheaper sum."""
    model = StepTimeModel.analytic(SEVEN_B, "h100-sxm", 64)
    torch_stage = StepTimeModel.analytic(SEVEN_B, "h100-sxm", 64, pipeline_no_sync=True)
    bd = model.breakdown(64, 1, 1, 1, 4)
    assert float(bd["accumulating_s"]) > float(bd["microbatch_s"])
    expected = 3 * bd["accumulating_s"] + gamma_sum(bd["microbatch_s"], bd["sync_s"], model.params.gamma)
    assert float(bd["step_s"]) == pytest.approx(float(expected + bd["optimizer_s"]), rel=1e-12)
    # one micro-batch, or one data-parallel rank: nothing changes
    for args in ((64, 1, 1, 1, 1), (1, 8, 8, 1, 4)):
        one = model.breakdown(*args)
        assert float(one["accumulating_s"]) == pytest.approx(float(one["microbatch_s"]))
    # pp > 1: copus's stages pay per micro-batch, torch's stage only at the end
    ours, theirs = model.predict(8, 1, 8, 1, 8), torch_stage.predict(8, 1, 8, 1, 8)
    assert float(ours) > float(theirs)
    assert float(model.predict(64, 1, 1, 1, 4)) == float(torch_stage.predict(64, 1, 1, 1, 4))  # pp = 1 alike
