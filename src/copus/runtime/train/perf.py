"""What a training step costs the device: model FLOPs utilisation, peak memory, the memory
bound the controller plans under, and the wait for the device's queued work.

    MFU = tokens/s · F / (devices · peak_flops)          F = ModelShape.model_flops_per_token()
                                                            = 6·N' + 12·L·dim·seq (docs/metrics.md)

peak_flops: the device's datasheet dense bf16 FLOP/s from its hardware profile
(`core/specs/gpu_peaks.py` on CUDA, None = "peak unknown"; CPU: the "cpu" profile). Peak memory:
`torch.cuda.max_memory_allocated` on CUDA (what the caching allocator handed out, the quantity
the memory model predicts), the process's resident-set high-water mark on CPU (VmHWM); both
reset at every plan change (`reset_peak_memory`), so a plan's peak is its own. Beside it on
CUDA: the allocator's peak reserved bytes and the device's used bytes (`mem_get_info`).
Memory bound: the device's real capacity (`torch.cuda.get_device_properties(...).total_memory`
on CUDA; on CPU the "cpu" profile's memory, or `parallel.memory_budget_gb` when set) less
`parallel.memory_margin` of it.
"""

from __future__ import annotations

import resource
import sys

import torch

from copus.core.specs.hardware import HardwareProfile, get_hardware
from copus.core.specs.models import ModelShape

__all__ = [
    "device_memory_bytes",
    "device_memory_readings",
    "device_peak_flops",
    "memory_capacity_bytes",
    "mfu",
    "peak_flops",
    "peak_memory_bytes",
    "reset_peak_memory",
    "wait_for_device",
]


def peak_flops(hardware: HardwareProfile | None) -> float:
    """Dense peak FLOP/s of one device: the profile's datasheet figure (None: "cpu")."""
    return (hardware if hardware is not None else get_hardware("cpu")).peak_flops


def device_peak_flops(device: torch.device, hardware: HardwareProfile | None) -> float | None:
    """The peak MFU is reported against: on CUDA the datasheet dense bf16 FLOP/s of the device
    torch names (`core/specs/gpu_peaks.py`), None for a device not in that table ("peak
    unknown": no MFU rather than another part's figure); elsewhere `peak_flops(hardware)`."""
    if device.type == "cuda":  # CUDA only: the device's name
        from copus.core.specs.gpu_peaks import device_peak

        entry = device_peak(torch.cuda.get_device_name(device))
        return entry.peak_flops if entry is not None else None
    return peak_flops(hardware)


def mfu(tokens_per_s: float, shape: ModelShape, num_devices: int, device_peak: float | None) -> float:
    """Model FLOPs utilisation: tokens/s · model_flops_per_token / (devices · peak FLOP/s); NaN
    when the peak is unknown (None)."""
    if device_peak is None or not (tokens_per_s > 0 and num_devices > 0 and device_peak > 0):
        return float("nan")
    return tokens_per_s * shape.model_flops_per_token() / (num_devices * device_peak)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory since the last `reset_peak_memory`: CUDA max allocated, else
    the RSS high-water mark (Linux VmHWM, which `reset_peak_memory` resets; else ru_maxrss)."""
    if device.type == "cuda":  # CUDA only: the caching allocator's high-water mark
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux: KiB, macOS: bytes


def _status_bytes(key: str) -> int | None:
    """A "kB" field of /proc/self/status in bytes; None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (at every plan change, so a plan's peak is its own):
    CUDA's allocator peaks (allocated and reserved); on Linux the process's VmHWM
    (/proc/self/clear_refs "5")."""
    if device.type == "cuda":  # CUDA only: the caching allocator's peaks
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def device_memory_readings(device: torch.device) -> tuple[float, float]:
    """(peak reserved bytes since the last reset, bytes in use on the whole device now =
    total − free from `cudaMemGetInfo`: the CUDA context, NCCL buffers and other processes
    included) on CUDA; (-1, -1) = not applicable elsewhere."""
    if device.type != "cuda":
        return -1.0, -1.0
    free, total = torch.cuda.mem_get_info(device)  # CUDA only: the driver's view
    return float(torch.cuda.max_memory_reserved(device)), float(total - free)


def device_memory_bytes(device: torch.device, hardware: HardwareProfile | None = None) -> float:
    """The device's memory: read from the device on CUDA (an H200 has 141 GB, not a profile's
    80), else the hardware profile's (None: the "cpu" profile)."""
    if device.type == "cuda":  # CUDA only: the real capacity
        return float(torch.cuda.get_device_properties(device).total_memory)
    return (hardware if hardware is not None else get_hardware("cpu")).memory_bytes


def memory_capacity_bytes(
    device: torch.device, hardware: HardwareProfile | None, budget_gb: float, margin: float
) -> float:
    """Bytes a plan may use per rank: (budget_gb·1e9 if > 0, else the device's memory) · (1 −
    margin). The margin covers what the memory model does not count: the CUDA context, NCCL
    buffers, allocator fragmentation."""
    capacity = budget_gb * 1e9 if budget_gb > 0 else device_memory_bytes(device, hardware)
    return capacity * (1.0 - margin)


def wait_for_device(device: torch.device) -> None:
    """Block until the device's queued work (the optimizer's kernels) is done, so a wall-clock
    step time includes it; on CPU the work is already done when the call returns."""
    if device.type == "cuda":  # CUDA only: kernels run asynchronously
        torch.cuda.synchronize(device)


def runtime_memory_model(cfg, shape: ModelShape, device_type: str):
    """The memory model (`core/cost/memory.py`) of copus's runtime under `cfg`: bf16 parameters
    through FSDP2's MixedPrecisionPolicy (fp32 master weights and reductions; no autocast) when
    train.dtype is "bf16", or "auto" on CUDA (runtime/engine/parallelize.py), else fp32; the configured
    activation checkpointing, resharding and pipeline schedule; loss parallel as configured
    (it applies at tp > 1), the measured 12 bytes per logit, unsharded gradient accumulation in
    gns.small = "rank" only (`engine.py`), and on CUDA the fitted allocator overhead and NCCL's
    communicator buffers (0 on CPU: glibc frees large blocks, gloo keeps no standing buffers)."""
    from copus.core.cost.memory import (
        ALLOCATOR_OVERHEAD,
        NCCL_COMM_BYTES,
        RUNTIME_LOGIT_BYTES,
        MemoryModel,
    )

    dtype = cfg.train.dtype
    mixed = dtype == "bf16" or (dtype == "auto" and device_type == "cuda")
    cuda = device_type == "cuda"
    return MemoryModel(
        shape,
        mixed_precision=mixed,
        autocast=False,
        activation_checkpointing=cfg.parallel.activation_checkpointing,
        reshard_after_forward=cfg.parallel.reshard_after_forward,
        pp_schedule=cfg.parallel.pp_schedule,
        loss_parallel=cfg.parallel.loss_parallel,
        logit_bytes=RUNTIME_LOGIT_BYTES,
        unsharded_accumulation=cfg.gns.small == "rank",
        allocator_overhead=ALLOCATOR_OVERHEAD if cuda else 0.0,
        comm_bytes_per_group=NCCL_COMM_BYTES if cuda else 0.0,
    )


def predicted_memory_bytes(model, plan) -> float:
    """The memory model's peak bytes per rank of `plan`."""
    return float(model.bytes_per_rank(plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches))
