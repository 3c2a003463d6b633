"""bench/gpu.sh: its CPU dry run end to end (the same code as the GPU check), and the
time-to-target policy default it once failed on."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
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
    args = types.SimpleNamespace(
        initial_batch=8,
        static=[8, 32, 128],
        model="tiny",
        nproc=8,
        max_tokens=1_000_000,
        warmup_tokens=50_000,
        lr=3e-3,
        eval_samples=32,
        set=[],
    )
    best = {b: {"dp": 8, "tp": 1, "pp": 1, "micro_batch_size": 1} for b in args.static}
    specs = ttt.run_specs(args, best, 256)
    policies = ttt.default_policies(args.static)
    assert set(policies) <= set(specs)
    assert {"static-8", "static-32", "static-128", "goodput"} <= set(policies)
    assert "static-16" not in policies
    assert ttt.default_policies(args.static, "static-8,goodput") == ["static-8", "goodput"]


def _env(**extra):
    return {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        # generous caps: the legs' own limits are sized for a GPU / an idle CPU, and this
        # machine is shared (the timeout itself is tested with a hang below)
        "BUDGET_S": "1800",
        "LEG_TIMEOUT_S": "600",
        **extra,
    }


def _own_processes(tag: str) -> list[int]:
    """Processes still alive whose environment carries `tag` (the check's ranks)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if tag.encode() in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


@pytest.mark.slow
def test_gpu_sh_dry_run_every_leg_and_a_failing_leg(tmp_path):
    """`bash bench/gpu.sh --dry-run`: one JSON with a row per leg. The growth leg's ranks are
    made to raise: its row carries the error and the later legs still run: the switch leg
    (batch growth + layout switch in the running processes), the throughput leg (memory-model
    micro-batch, selective AC) with the GNS overhead, and the torchtitan peer, skipped with
    its reason on this CPU host."""
    out = tmp_path / "gpu"
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu.sh"), "--dry-run", "--out", str(out)],
        env=_env(GPU_CHECK_FAIL_LEG="growth"),
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert (out / "gpu_check.md").read_text().startswith("# gpu_check (dry run")
    assert res["dry_run"] and res["nproc"] == 2 and res["nccl_timeout_s"] == 120
    legs = {leg["leg"]: leg for leg in res["legs"]}
    assert list(legs) == ["eager", "growth", "switch", "throughput", "torchtitan"]
    assert legs["growth"]["status"] == "error"
    assert "injected failure (GPU_CHECK_FAIL_LEG=growth)" in legs["growth"]["error"]
    for name in ("eager", "switch", "throughput"):
        leg = legs[name]
        assert leg["status"] == "ok", leg
        assert leg["summary"]["steps"] == 8
        for seg in leg["segments"]:
            assert seg["median_step_s"] > 0 and seg["median_tokens_per_s"] > 0
            assert 0 < seg["median_mfu"] < 1
            assert seg["peak_allocated_bytes"] > 0 and seg["predicted_memory_bytes"] > 0
            assert seg["peak_reserved_bytes"] is None and seg["device_used_bytes"] is None
            assert seg["peak_over_predicted"] is None  # RSS: not comparable
        assert "VmHWM" in leg["memory_note"]
    eager = legs["eager"]
    assert [s["global_batch_size"] for s in eager["segments"]] == [8]
    g = eager["gns"]
    assert g["median_step_s_with_stats"] > 0 and g["median_step_s_without_stats"] > 0
    assert math.isfinite(g["overhead"])
    sw = legs["switch"]
    assert [s["global_batch_size"] for s in sw["segments"]] == [8, 16] and sw["batch_grew"]
    assert [(s["plan"]["dp"], s["plan"]["tp"]) for s in sw["segments"]] == [(2, 1), (1, 2)]
    (switch,) = sw["switches"]
    assert switch["to"] == "dp1.tp2.pp1" and switch["switch_s"] > 0
    assert switch["groups_released"] >= 1  # the dp2 layout's sub-groups were destroyed
    thr = legs["throughput"]
    pick = thr["micro_batch_pick"]
    assert thr["micro_batch_size"] == pick["micro_batch_size"] >= 1
    assert thr["activation_checkpointing"] == "selective"
    fits = [int(b) for b, v in pick["predicted_bytes_by_micro_batch"].items() if v <= pick["limit_bytes"]]
    assert pick["micro_batch_size"] == max(fits)
    assert [s["plan"]["micro_batch_size"] for s in thr["segments"]] == [pick["micro_batch_size"]]
    assert thr["gns"] is not None
    tt = legs["torchtitan"]
    assert tt["status"] == "skipped" and tt["reason"]
    assert res["peer"]["status"] == "n/a" and "torchtitan: skipped" in res["peer"]["reason"]


@pytest.mark.slow
def test_gpu_sh_leg_timeout_kills_the_ranks_and_is_recorded(tmp_path):
    """A leg whose ranks hang is stopped by its `timeout`: its row says so, both ranks were up
    (each wrote its hanging-rank marker) and none of its processes survive gpu.sh. 30 s: the
    leg's start and its ranks' imports take ~12 s on 2 cores at load 5 (before: 40 s of waiting;
    too short a limit fails on the markers instead of passing without ranks)."""
    out = tmp_path / "gpu"
    tag = f"GPU_CHECK_TEST_TAG={os.getpid()}-{time.monotonic_ns()}"
    key, value = tag.split("=")
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu.sh"), "--dry-run", "--legs", "eager", "--out", str(out)],
        env=_env(GPU_CHECK_HANG_LEG="eager", LEG_TIMEOUT_S="30", **{key: value}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    eager = res["legs"][0]
    assert eager["status"] == "error" and eager["error"].startswith("timed out after 30 s")
    hanging = sorted(p.name for p in (out / "runs" / "eager").glob("hanging-rank*"))
    assert hanging == ["hanging-rank0", "hanging-rank1"], proc.stdout[-3000:]
    assert [leg["status"] for leg in res["legs"][1:]] == ["skipped"] * 4
    assert _own_processes(tag) == []


def test_nproc_above_the_device_count_is_one_line():
    gc = _load("gpu_check")
    msg = gc.check_nproc(3, 2)
    assert msg.startswith("gpu_check: --nproc 3 is invalid") and "allowed: 1..2" in msg
    assert "device_count() = 2" in msg and len(msg.splitlines()) == 1
    assert gc.check_nproc(2, 2) is None and gc.check_nproc(1, 8) is None
    assert "no CUDA device" in gc.check_nproc(1, 0)


def test_gpu_sh_without_cuda_is_one_line_and_exit_2(tmp_path):
    """On this CPU host torch sees no CUDA device: one line, exit 2, no traceback."""
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu.sh"), "--nproc", "2", "--out", str(tmp_path / "gpu")],
        env=_env(CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "no CUDA device" in err[0] and "Traceback" not in proc.stderr


def test_gpu_sh_refuses_unknown_arguments():
    proc = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--bogus"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "unknown argument '--bogus'" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_report_reads_legs_timeouts_and_the_peer(tmp_path):
    """gpu_check_report on leg files as gpu.sh leaves them: copus legs from a dry run's JSON, a
    torchtitan row as its worker returns it (the path a CPU host never runs), a leg `timeout`
    stopped after writing nothing, and one stopped after writing a partial row: the JSON and
    the table carry the copus / torchtitan ratios and the timeouts."""
    rep = _load("gpu_check_report")
    gc = _load("gpu_check")
    dry = json.loads((ROOT / "bench/results/gpu_dry_run/gpu_check.json").read_text())
    legs = {leg["leg"]: leg for leg in dry["legs"]}
    out = tmp_path / "gpu"
    (out / "legs").mkdir(parents=True)
    (out / "devices.json").write_text(json.dumps({"count": 2, "nproc": 2, "name": "cpu"}))
    for name in ("eager", "throughput"):
        (out / "legs" / f"{name}.json").write_text(json.dumps(legs[name]))
        (out / "legs" / f"{name}.rc").write_text("0 90\n")
    copus = legs["throughput"]["segments"][-1]
    titan = {
        "leg": "torchtitan",
        "status": "ok",
        "nproc": 2,
        "micro_batch_size": 16,
        "step_s": [9.0, 0.2, 0.25, 0.2],
        "median_step_s": 0.2,
        "first_step_s": 9.0,
        "median_tokens_per_s": 5000.0,
        "peak_allocated_bytes": 2.0e8,
        "peak_reserved_bytes": 3.0e8,
        "device_used_bytes": 4.0e8,
        "build_s": 3.0,
    }
    (out / "legs" / "torchtitan.json").write_text(json.dumps(titan))
    (out / "legs" / "torchtitan.rc").write_text("0 200\n")
    (out / "legs" / "growth.rc").write_text("124 100\n")  # killed, no JSON
    (out / "legs" / "growth.log").write_text("step 3\n")
    (out / "legs" / "switch.json").write_text(
        json.dumps({"leg": "switch", "status": "error", "error": "KeyboardInterrupt"})
    )
    (out / "legs" / "switch.rc").write_text("137 140\n")  # SIGKILLed after writing
    s = gc.settings(True, 2)
    res = rep.collect(out, s, 300.0, 480.0)
    by = {leg["leg"]: leg for leg in res["legs"]}
    assert by["growth"] == {
        "leg": "growth",
        "status": "error",
        "rc": 124,
        "error": "timed out after 100 s (timeout exit 124); the leg's ranks were killed",
    }
    assert by["switch"]["error"].startswith("timed out after 140 s")
    peer = res["peer"]
    assert peer["status"] == "ok"
    assert peer["step_time_ratio"] == pytest.approx(copus["median_step_s"] / 0.2)
    assert peer["peak_allocated_ratio"] == pytest.approx(copus["peak_allocated_bytes"] / 2.0e8)
    assert peer["peak_reserved_ratio"] is None  # CPU: no reserved figure
    table = rep.markdown(res)
    assert f"step time {peer['step_time_ratio']:.3f}" in table
    assert "| torchtitan | dp2 mb16 | 32 | 4 | 0.200 | 5,000 |" in table
    assert "**error**: timed out after 100 s" in table
    json.dumps(res)  # serialisable as written
