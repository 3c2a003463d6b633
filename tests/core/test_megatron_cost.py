"""The Megatron structure of the step-time and memory models (core/cost/megatron_cost.py)."""

from dataclasses import replace

import numpy as np
import pytest

from copus.core.specs.hardware import get_hardware, with_overrides
from copus.core.cost.memory import MemoryModel
from copus.core.specs.resolve import get_model_shape
from copus.core.cost.throughput import StepTimeModel

SHAPE = get_model_shape("llama-3.2-3b")  # tied embeddings
HW = get_hardware("h100-nvlink-pairs")


def test_fp32_gradient_all_reduce_once_per_step():
    model = StepTimeModel.analytic(SHAPE, HW, 8)
    p = model.params
    parts = model.breakdown(2, 1, 4, 1, 8)  # dp pair = one NVLink pair (tier 0)
    local = float(model.stage_params(4))
    buckets = np.ceil(local / 4e7)
    expected = 2 * buckets * p.dp_latency_s + 2 * 0.5 * local * 4 * p.dp_s_per_byte
    assert float(parts["sync_s"]) == pytest.approx(expected)
    # more micro-batches add compute, never more gradient traffic
    assert float(model.breakdown(2, 1, 4, 1, 64)["sync_s"]) == pytest.approx(expected)
    assert float(parts["allgather_s"]) == 0.0


def test_distributed_optimizer_moves_three_quarters_and_shards_the_step():
    rep = StepTimeModel.analytic(SHAPE, HW, 8)
    dist = StepTimeModel.analytic(SHAPE, HW, 8, distributed_optimizer=True)
    a, b = rep.breakdown(8, 1, 1, 1, 4), dist.breakdown(8, 1, 1, 1, 4)
    lat = 2 * 7 * np.ceil(float(rep.stage_params(1)) / 4e7) * rep.params.dp_latency_s
    assert (float(b["sync_s"]) - lat) / (float(a["sync_s"]) - lat) == pytest.approx(6 / 8)
    opt = lambda x: float(x["optimizer_s"]) - rep.params.step_overhead_s  # noqa: E731
    assert opt(b) == pytest.approx(opt(a) / 8)
    mem_rep = MemoryModel(shape=SHAPE, stack="megatron").breakdown(8, 1, 1, 1, 4)["states"]
    mem_dist = MemoryModel(shape=SHAPE, stack="megatron", distributed_optimizer=True).breakdown(8, 1, 1, 1, 4)["states"]
    assert float(mem_rep) == pytest.approx(18 * SHAPE.num_params())  # Megatron README
    assert float(mem_dist) == pytest.approx((6 + 12 / 8) * SHAPE.num_params())


def test_tied_embedding_sync_only_across_a_pipeline():
    model = StepTimeModel.analytic(SHAPE, HW, 8)
    assert float(model.breakdown(8, 1, 1, 1, 2)["embedding_sync_s"]) == 0.0
    assert float(model.breakdown(2, 1, 4, 1, 8)["embedding_sync_s"]) > 0.0
    untied = StepTimeModel.analytic(replace(SHAPE, tie_embeddings=False), HW, 8)
    assert float(untied.breakdown(2, 1, 4, 1, 8)["embedding_sync_s"]) == 0.0


def test_shared_nic_is_split_between_the_groups_that_cross_it():
    """16 ranks on 2 nodes: dp16 (8 members per node) gets the whole NIC, dp2 at stride 8 one share."""
    model = StepTimeModel.analytic(SHAPE, HW, 16)
    _, slow_dp16, _ = model.slowdowns(16, 1, 1)
    _, slow_dp2, _ = model.slowdowns(2, 8, 1)
    assert float(slow_dp2) == pytest.approx(8 * float(slow_dp16))
    own_nics = StepTimeModel.analytic(SHAPE, with_overrides(HW, shared_nic=False), 16)
    assert float(own_nics.slowdowns(16, 1, 1)[1]) == pytest.approx(float(slow_dp2))


def test_tensor_parallel_efficiency_and_unsplit_elementwise_work():
    # the plain-FLOP structure (a profile without the roofline's efficiencies)
    flat = with_overrides(HW, gemm_efficiency=None, attention_efficiency=None)
    model = StepTimeModel.analytic(SHAPE, flat, 8)
    ideal = StepTimeModel.analytic(SHAPE, with_overrides(flat, tp_efficiency=1.0), 8)
    one, two = model.breakdown(4, 1, 2, 1, 4), model.breakdown(2, 2, 2, 1, 8)
    assert float(two["elementwise_s"]) == pytest.approx(float(one["elementwise_s"]))  # not split
    flops = lambda m, x: float(x["compute_s"]) - m.params.layer_overhead_s * 15  # noqa: E731
    assert flops(model, two) / flops(model, one) == pytest.approx(0.5 / flat.tp_efficiency)
    assert flops(ideal, ideal.breakdown(2, 2, 2, 1, 8)) / flops(ideal, ideal.breakdown(4, 1, 2, 1, 4)) == pytest.approx(
        0.5
    )
