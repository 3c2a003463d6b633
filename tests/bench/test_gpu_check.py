"""bench/gpu.sh: its CPU dry run end to end (the same code as the GPU check), and the
time-to-target policy default it once failed on."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


def test_time_to_target_default_policies_have_specs():
    """gpu.sh's static batches 8,32,128: every default leg has a spec (before: static-16 and
    static-64 were in the default and raised `--policies ... unknown`)."""
    ttt = _load("time_to_target")
    args = types.SimpleNamespace(initial_batch=8, static=[8, 32, 128], model="tiny", nproc=8,
                                 max_tokens=1_000_000, warmup_tokens=50_000, lr=3e-3,
                                 eval_samples=32, set=[])
    best = {b: {"dp": 8, "tp": 1, "pp": 1, "micro_batch_size": 1} for b in args.static}
    specs = ttt.run_specs(args, best, 256)
    policies = ttt.default_policies(args.static)
    assert set(policies) <= set(specs)
    assert {"static-8", "static-32", "static-128", "goodput"} <= set(policies)
    assert "static-16" not in policies
    assert ttt.default_policies(args.static, "static-8,goodput") == ["static-8", "goodput"]


@pytest.mark.slow
def test_gpu_sh_dry_run_end_to_end(tmp_path):
    """`bash bench/gpu.sh --dry-run --out DIR`: 2 CPU ranks train the config.json model through
    a batch growth and a layout switch, then the GNS overhead leg; the JSON has every figure."""
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--dry-run", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert (out / "gpu_check.md").read_text().startswith("# gpu_check (dry run")
    assert res["dry_run"] and res["nproc"] == 2 and res["batch_grew"]
    assert res["summary"]["steps"] == 8
    segs = res["segments"]
    assert [s["global_batch_size"] for s in segs] == [8, 16]
    assert [(s["plan"]["dp"], s["plan"]["tp"]) for s in segs] == [(2, 1), (1, 2)]
    for s in segs:
        assert 0 < s["median_mfu"] < 1 and s["median_step_s"] > 0
        assert s["peak_memory_bytes"] > 0 and s["predicted_memory_bytes"] > 0
    (switch,) = res["switches"]
    assert switch["to"] == "dp1.tp2.pp1" and switch["switch_s"] > 0
    assert switch["groups_released"] >= 1       # the dp2 layout's sub-groups were destroyed
    g = res["gns"]
    assert g["median_step_s_with_stats"] > 0 and g["median_step_s_without_stats"] > 0
    assert math.isfinite(g["overhead"])


def test_gpu_sh_refuses_unknown_arguments():
    proc = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--bogus"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2
    assert "unknown argument '--bogus'" in proc.stderr and len(proc.stderr.splitlines()) == 1
