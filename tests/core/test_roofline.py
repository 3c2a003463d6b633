"""Roofline compute per GPU generation (core/cost/compute.py), the step's time split, and the
memory of full activation checkpointing at large micro-batches under sequence parallelism."""

import numpy as np
import pytest

from copus.core.cost.compute import block_terms, recompute_factors, stage_compute_flops
from copus.core.cost.memory import ALLOCATOR_OVERHEAD, MemoryModel
from copus.core.cost.throughput import COMPUTE_EFFICIENCY, StepTimeModel, StepTimeParams, time_split
from copus.core.specs.hardware import GPU_GENERATIONS, GiB, get_hardware, with_overrides
from copus.core.specs.models import ModelShape
from copus.core.specs.resolve import get_model_shape

SEVEN_B = get_model_shape("llama-2-7b")
L70B = ModelShape(
    name="llama-3.1-70b",
    n_layers=80,
    dim=8192,
    n_heads=64,
    n_kv_heads=8,
    ffn_dim=28672,
    vocab_size=128256,
    seq_len=8192,
)


def test_gemm_time_is_flop_time_plus_byte_time_per_projection():
    """Each projection (K, N) at M = b·s tokens: 6·M·K·N/(η·P) + 3·e·(M·K + K·N + M·N)/BW, with
    column-parallel projections split along N and row-parallel ones along K."""
    hw = get_hardware("a100-80gb")
    model = StepTimeModel.analytic(SEVEN_B, hw)
    h, f, s = 4096, 11008, SEVEN_B.seq_len
    for tp, b in ((1, 1), (4, 2)):
        M = b * s
        dims = [(h, h // tp), (h, h // tp), (h, h // tp), (h // tp, h), (h, f // tp), (h, f // tp), (f // tp, h)]
        expected = sum(
            6 * M * k * n / (hw.peak_flops * hw.gemm_efficiency) + 3 * 2 * (M * k + k * n + M * n) / hw.memory_bw
            for k, n in dims
        )
        assert float(block_terms(model, tp, b)["gemm_s"]) == pytest.approx(expected, rel=1e-12)


def test_narrow_gemms_reach_less_of_peak():
    """Splitting the projections over tp makes them narrower: per-rank time × tp grows, and the
    loss is larger for a narrow model than for a wide one."""
    hw = get_hardware("h100-sxm")
    wide = StepTimeModel.analytic(L70B, hw)
    narrow = StepTimeModel.analytic(SEVEN_B, hw)
    for model in (wide, narrow):
        one = float(block_terms(model, 1, 1)["gemm_s"])
        eight = float(block_terms(model, 8, 1)["gemm_s"])
        assert eight * 8 > one
    loss = [float(block_terms(m, 8, 1)["gemm_s"]) * 8 / float(block_terms(m, 1, 1)["gemm_s"]) for m in (wide, narrow)]
    assert loss[0] < loss[1]


def test_generations_differ_by_their_own_constants():
    """Compute-bound GEMMs scale with η_g·peak; element-wise work with HBM bandwidth; flash
    attention with its own efficiency."""
    a100, h100 = get_hardware("a100-80gb"), get_hardware("h100-sxm")
    terms = {hw.name: block_terms(StepTimeModel.analytic(L70B, hw), 1, 4) for hw in (a100, h100)}
    gemm_ratio = float(terms["a100-80gb"]["gemm_s"] / terms["h100-sxm"]["gemm_s"])
    assert gemm_ratio == pytest.approx(
        h100.peak_flops * h100.gemm_efficiency / (a100.peak_flops * a100.gemm_efficiency), rel=0.1
    )
    assert float(terms["a100-80gb"]["elementwise_s"] / terms["h100-sxm"]["elementwise_s"]) == pytest.approx(
        h100.memory_bw / a100.memory_bw
    )
    assert float(terms["a100-80gb"]["attention_s"] / terms["h100-sxm"]["attention_s"]) == pytest.approx(
        h100.peak_flops * GPU_GENERATIONS["hopper"][1] / (a100.peak_flops * GPU_GENERATIONS["ampere"][1])
    )


def test_analytic_coefficient_is_kappa_times_the_generations_matmul_peak():
    hw = get_hardware("mi210")
    params = StepTimeParams.analytic(hw)
    assert params.s_per_flop == pytest.approx(1.0 / (hw.peak_flops * hw.gemm_efficiency * COMPUTE_EFFICIENCY))
    cpu = get_hardware("cpu")  # no roofline: the plain FLOP count at the profile's mfu
    assert StepTimeParams.analytic(cpu).s_per_flop == pytest.approx(1.0 / (cpu.peak_flops * cpu.mfu))


def test_recompute_by_mode():
    """full: one more forward of everything; selective (torchtitan's op policy): the unsaved
    matmuls and every element-wise op, never the saved attention output."""
    model = StepTimeModel.analytic(SEVEN_B, "h100-sxm")
    f = recompute_factors(model, np.array([0, 1, 2]))
    np.testing.assert_allclose(f["elementwise_s"], [1.0, 4 / 3, 4 / 3])
    np.testing.assert_allclose(f["attention_s"], [1.0, 1.0, 1 + 1 / 3.5])
    assert f["gemm_s"][0] == 1.0 and 1.0 < f["gemm_s"][1] < f["gemm_s"][2] == pytest.approx(4 / 3)
    work = stage_compute_flops(model, 2, 2, 2, np.array([0, 1, 2]))
    assert work["recompute"][0] == 0 and 0 < work["recompute"][1] < work["recompute"][2]
    np.testing.assert_allclose(work["total"] - work["recompute"], work["total"][0])


@pytest.mark.parametrize("hw", ["h100-sxm", "h100-nvlink-pairs", "mi210", "cpu"])
def test_time_split_sums_to_the_step(hw):
    model = StepTimeModel.analytic(SEVEN_B, hw, 32)
    rng = np.random.default_rng(0)
    dp, tp, pp = rng.choice([1, 2, 4], 200), rng.choice([1, 2, 4], 200), rng.choice([1, 2, 8], 200)
    b, m = rng.integers(1, 5, 200), rng.integers(1, 40, 200)
    ac = rng.integers(0, 3, 200)
    parts = time_split(model, dp, tp, pp, b, m, activation_checkpointing=ac)
    step = model.predict(dp, tp, pp, b, m, activation_checkpointing=ac)
    np.testing.assert_allclose(sum(parts.values()), step, rtol=1e-9)
    assert all(np.all(v >= -1e-9 * step) for v in parts.values())
    assert np.all(parts["bubble_s"][pp == 1] == 0) and np.all(parts["bubble_s"][pp > 1] > 0)
    assert np.all(parts["recompute_s"][ac == 0] == 0) and np.all(parts["recompute_s"][ac > 0] > 0)


def _torchtitan_memory(**kw) -> MemoryModel:
    return MemoryModel(
        L70B,
        mixed_precision=True,
        autocast=False,
        loss_parallel=True,
        logit_bytes=12.0,
        allocator_overhead=ALLOCATOR_OVERHEAD,
        activation_checkpointing="full",
        **kw,
    )


def test_torchtitan_70b_fits_at_its_own_micro_batch():
    """torchtitan Table 4: FSDP 32 · TP 8, one micro-batch of 16, full AC, sequence parallel, ran in
    71.9 GiB of 95; the model puts it within 15 % and feasible."""
    total = float(_torchtitan_memory(sequence_parallel=True).bytes_per_rank(32, 8, 1, 16, 1))
    assert total / GiB == pytest.approx(71.9, rel=0.15)
    assert total < 95.0 * GiB


def test_sequence_parallel_gather_is_unsharded_and_grows_with_the_micro_batch():
    mm = _torchtitan_memory(sequence_parallel=True)
    one, four = (mm.breakdown(32, 8, 1, b, 1)["sp_gather"] for b in (1, 4))
    assert float(one) == pytest.approx(2 * 2 * 8192 * 8192)  # 2 tensors · bf16 · s·h, not split by tp
    assert float(four) == pytest.approx(4 * float(one))
    assert float(_torchtitan_memory(sequence_parallel=False).breakdown(32, 8, 1, 4, 1)["sp_gather"]) == 0.0
    assert float(mm.breakdown(256, 1, 1, 4, 1)["sp_gather"]) == 0.0  # no tensor parallelism


def test_custom_profile_needs_both_efficiencies():
    with pytest.raises(ValueError, match="gemm_efficiency and attention_efficiency"):
        with_overrides(get_hardware("h100-sxm"), attention_efficiency=None)
    with pytest.raises(ValueError, match="gemm_efficiency=1.5"):
        with_overrides(get_hardware("h100-sxm"), gemm_efficiency=1.5)
