"""Datasheet dense bf16 peak FLOP/s of an accelerator, from the name torch reports for it.

MFU = achieved model FLOP/s ÷ this peak, so a wrong peak mis-scales every MFU figure: an H100
PCIe (756 TFLOP/s) read as an SXM part (989) under-reports MFU by 24 %. `device_peak(name)`
matches `torch.cuda.get_device_name()` (e.g. "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB",
"AMD Instinct MI300X") against the table below and returns None for a part not in it: the
caller reports "peak unknown" (MFU null) rather than another part's figure.

Figures: dense (no 2:4 sparsity) bf16 tensor-core FLOP/s from each vendor's datasheet; where the
datasheet quotes only the sparse figure, half of it. Matching: the name upper-cased, "-" and "_"
read as spaces; the first pattern that matches wins (more specific variants first: H100 PCIe
and NVL before H100 SXM; a pattern is a whole word, so "A10" does not match "A10G" and "H200"
does not match "GH200").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GpuPeak", "GPU_PEAKS", "device_peak", "peak_unknown_reason"]

T = 1e12


@dataclass(frozen=True, slots=True)
class GpuPeak:
    """One accelerator: a whole-word regex on the normalised name, a label, dense bf16 FLOP/s."""

    pattern: str
    label: str
    peak_flops: float


GPU_PEAKS: tuple[GpuPeak, ...] = (
    # NVIDIA Blackwell
    GpuPeak(r"GB200", "GB200", 2500 * T),
    GpuPeak(r"B200", "B200", 2250 * T),
    GpuPeak(r"B100", "B100", 1750 * T),
    # NVIDIA Hopper (H800 = H100 with a reduced NVLink; H20 = the export part)
    GpuPeak(r"GH200", "GH200", 989 * T),
    GpuPeak(r"H200 NVL", "H200 NVL", 835 * T),
    GpuPeak(r"H200", "H200", 989 * T),
    GpuPeak(r"H100 PCIE", "H100 PCIe", 756 * T),
    GpuPeak(r"H100 NVL", "H100 NVL", 835 * T),
    GpuPeak(r"H100", "H100 SXM", 989 * T),
    GpuPeak(r"H800 PCIE", "H800 PCIe", 756 * T),
    GpuPeak(r"H800", "H800 SXM", 989 * T),
    GpuPeak(r"H20", "H20", 148 * T),
    # NVIDIA Ampere / Ada data-centre parts (A100 40 GB and 80 GB, SXM and PCIe: one figure)
    GpuPeak(r"A100", "A100", 312 * T),
    GpuPeak(r"A800", "A800", 312 * T),
    GpuPeak(r"A40", "A40", 149.7 * T),
    GpuPeak(r"A30", "A30", 165 * T),
    GpuPeak(r"A10", "A10", 125 * T),
    GpuPeak(r"L40S", "L40S", 362 * T),
    GpuPeak(r"L40", "L40", 181 * T),
    GpuPeak(r"L4", "L4", 121 * T),
    # AMD Instinct
    GpuPeak(r"MI355X", "MI355X", 2500 * T),
    GpuPeak(r"MI325X", "MI325X", 1307 * T),
    GpuPeak(r"MI300X", "MI300X", 1307 * T),
    GpuPeak(r"MI300A", "MI300A", 981 * T),
    GpuPeak(r"MI250X", "MI250X", 383 * T),
    GpuPeak(r"MI250", "MI250", 362 * T),
    GpuPeak(r"MI210", "MI210", 181 * T),
)


def _normalise(name: str) -> str:
    return re.sub(r"[-_]", " ", name.upper())


def device_peak(name: str) -> GpuPeak | None:
    """The table's entry for a device name (torch.cuda.get_device_name), None when unknown."""
    text = _normalise(name)
    for entry in GPU_PEAKS:
        if re.search(rf"(?<![A-Z0-9]){entry.pattern}(?![A-Z0-9])", text):
            return entry
    return None


def peak_unknown_reason(name: str) -> str:
    """Why MFU is not reported for `name` (one line)."""
    return (
        f"peak unknown: device {name!r} is not in copus.core.specs.gpu_peaks (dense bf16 "
        f"datasheet peaks of {', '.join(p.label for p in GPU_PEAKS)}); MFU not reported"
    )
