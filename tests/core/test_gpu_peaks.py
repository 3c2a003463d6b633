"""The accelerator name → datasheet dense bf16 peak table that MFU is reported against."""

import pytest

from copus.core.specs.gpu_peaks import GPU_PEAKS, device_peak, peak_unknown_reason

T = 1e12


@pytest.mark.parametrize(
    "name, label, peak",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989 * T),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756 * T),
        ("NVIDIA H100 NVL", "H100 NVL", 835 * T),
        ("NVIDIA H200", "H200", 989 * T),
        ("NVIDIA H200 NVL", "H200 NVL", 835 * T),
        ("NVIDIA GH200 480GB", "GH200", 989 * T),
        ("NVIDIA H800", "H800 SXM", 989 * T),
        ("NVIDIA H20", "H20", 148 * T),
        ("NVIDIA B200", "B200", 2250 * T),
        ("NVIDIA A100-SXM4-40GB", "A100", 312 * T),
        ("NVIDIA A100-SXM4-80GB", "A100", 312 * T),
        ("NVIDIA A100-PCIE-40GB", "A100", 312 * T),
        ("NVIDIA A100 80GB PCIe", "A100", 312 * T),
        ("NVIDIA L40S", "L40S", 362 * T),
        ("NVIDIA L40", "L40", 181 * T),
        ("NVIDIA L4", "L4", 121 * T),
        ("NVIDIA A10", "A10", 125 * T),
        ("AMD Instinct MI300X", "MI300X", 1307 * T),
        ("AMD Instinct MI250X/MI250", "MI250X", 383 * T),
        ("AMD Instinct MI210", "MI210", 181 * T),
    ],
)
def test_known_parts(name, label, peak):
    entry = device_peak(name)
    assert entry is not None and entry.label == label and entry.peak_flops == peak


@pytest.mark.parametrize(
    "name", ["NVIDIA A10G", "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000", "", "cpu"]
)
def test_unknown_parts_have_no_peak(name):
    """Not another part's figure: A10G is not an A10, V100 has no bf16 tensor cores."""
    assert device_peak(name) is None
    reason = peak_unknown_reason(name)
    assert reason.startswith("peak unknown") and len(reason.splitlines()) == 1


def test_table_is_specific_first():
    """Every label resolves to itself (no earlier, broader pattern shadows it)."""
    for entry in GPU_PEAKS:
        assert device_peak(f"Vendor {entry.label}") is entry, entry.label
