"""The runtime's peak for MFU: the device's own datasheet figure, or "peak unknown"; the
launcher's OMP_NUM_THREADS for its workers."""

import math
import os

import torch

from copus.core.specs.models import ModelShape
from copus.runtime.train import perf
from copus.runtime.train.launch import omp_threads
from copus.runtime.train.setup import run_hardware

SHAPE = ModelShape(name="t", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, seq_len=16)


def test_pcie_part_gets_its_own_peak_and_unknown_gets_none(monkeypatch):
    """An H100 PCIe reports MFU against 756 TFLOP/s (not the SXM's 989, as before); an unknown
    GPU gets no peak and a NaN MFU (written as "peak unknown" by the GPU check)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H100 PCIe")
    hw = run_hardware("cuda", "NVIDIA H100 PCIe", env={})
    assert hw.peak_flops == 756e12
    assert perf.device_peak_flops(cuda, hw) == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA Mystery X1")
    hw = run_hardware("cuda", "NVIDIA Mystery X1", env={})
    assert perf.device_peak_flops(cuda, hw) is None
    assert math.isnan(perf.mfu(1e6, SHAPE, 1, None))
    assert perf.device_peak_flops(torch.device("cpu"), None) == perf.peak_flops(None) > 0


def test_omp_threads_is_cores_over_local_ranks_unless_set():
    assert omp_threads(4, env={}, cores=16) == "4"
    assert omp_threads(3, env={}, cores=16) == "5"
    assert omp_threads(8, env={}, cores=2) == "1"  # at least one
    assert omp_threads(2, env={"OMP_NUM_THREADS": "7"}, cores=16) is None  # the user's kept
    assert int(omp_threads(2, env={})) == max(1, len(os.sched_getaffinity(0)) // 2)


def _report_threads(cfg, run_dir, resume):
    """A launch entry: this worker's OMP_NUM_THREADS and torch's intra-op thread count."""
    return {"env": os.environ.get("OMP_NUM_THREADS"), "torch": torch.get_num_threads()}


def test_launcher_sets_omp_threads_for_its_workers(tmp_path, monkeypatch):
    """`copus train --nproc 2` (the elastic launcher): each worker starts with OMP_NUM_THREADS =
    cores // 2 and torch uses that many threads; the launcher's own environment is restored."""
    from copus.config import load_config
    from copus.runtime.train.launch import launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = load_config(None, ["parallel.nproc=2"])
    res = launch(cfg, str(tmp_path), max_restarts=0, entry=_report_threads)
    want = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert res == {"env": want, "torch": int(want)}
    assert "OMP_NUM_THREADS" not in os.environ
