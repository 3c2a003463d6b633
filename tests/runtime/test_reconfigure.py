"""In-process layout switches (runtime/reconfigure.py) on 4 gloo ranks, one process launch.

Engine level: dp4 → dp2·tp2 → pp2·dp2. After each switch the next two losses must equal those of
a fresh engine that loads the same state (saved just before the switch) straight into the new
plan; tolerance: exact (same plan, same state, same data → same floats). The full AdamW state
(exp_avg, exp_avg_sq, step) and the weights gathered after the switch equal those before.

Trainer level: a scripted policy switches dp4 → dp2·tp2 (after step 1) → pp2·dp2 with B 8 → 16
(after step 2), once with controller.switch="in-process" and once with "checkpoint": identical
losses, every sample id consumed exactly once, dp slices tile each batch, switch costs reach the
policy and decisions.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from copus.core.models import ModelShape
from copus.core.plan import ParallelPlan

from ._workers import run_ranks

SHAPE = ModelShape(name="switch-test", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128,
                   vocab_size=64, seq_len=16)
DP4 = ParallelPlan(dp=4, tp=1, pp=1, micro_batch_size=1, num_microbatches=2)
DP2TP2 = ParallelPlan(dp=2, tp=2, pp=1, micro_batch_size=2, num_microbatches=2)
PP2DP2 = ParallelPlan(dp=2, tp=1, pp=2, micro_batch_size=2, num_microbatches=2)
LR = 1e-2


# ------------------------------------------------------------------------------ rank code

def _tokens(step: int, engine) -> "torch.Tensor":  # noqa: F821
    """This dp rank's rows of step `step`'s fixed global batch (8 sequences)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    full = torch.randint(0, SHAPE.vocab_size, (8, SHAPE.seq_len + 1), generator=g)
    per = 8 // engine.plan.dp
    return full[engine.dp_rank * per:(engine.dp_rank + 1) * per]


def _steps(engine, steps: range) -> list[float]:
    return [engine.train_step(_tokens(s, engine), LR).loss for s in steps]


def _full_state(engine) -> dict:
    """Every weight and optimizer entry this rank's stage holds, as full numpy arrays."""
    import torch
    from torch.distributed.tensor import DTensor

    model_sd, optim_sd = engine.state_dicts()
    out = {}
    for prefix, sd in (("model.", model_sd), ("optim.", optim_sd)):
        for key in sorted(sd):
            v = sd[key]
            if isinstance(v, DTensor):
                v = v.full_tensor()
            out[prefix + key] = v.detach().cpu().clone().numpy() if isinstance(v, torch.Tensor) \
                else v
    return out


def _engine_switches(root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from copus.runtime.dist import MeshCache
    from copus.runtime.engine import Engine, EngineSettings
    from copus.runtime.reconfigure import switch_engine

    cache = MeshCache("cpu")

    def build(plan):
        return Engine(SHAPE, plan, EngineSettings(), "cpu", cache, seed=0)

    def save(engine, name):
        model_sd, optim_sd = engine.state_dicts()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/{name}")

    engine = build(DP4)
    losses = _steps(engine, range(0, 2))
    save(engine, "before-1")
    before = _full_state(engine)
    engine, rep1 = switch_engine(engine, DP2TP2, build, fallback_root=root)
    after = _full_state(engine)
    losses += _steps(engine, range(2, 4))
    save(engine, "before-2")
    engine, rep2 = switch_engine(engine, PP2DP2, build, fallback_root=root, prefer_shm=False)
    after2 = _full_state(engine)
    losses += _steps(engine, range(4, 6))
    engine.close()
    reference = []
    for name, plan, steps in (("before-1", DP2TP2, range(2, 4)), ("before-2", PP2DP2, range(4, 6))):
        ref = build(plan)
        model_sd, optim_sd = ref.state_dicts()
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=f"{root}/{name}")
        ref.load_state(state["model"], state["optim"])
        reference += _steps(ref, steps)
        ref.close()
    return {"losses": losses, "reference": reference, "before": before, "after": after,
            "after2": after2, "reports": [rep1.to_dict(), rep2.to_dict()], "meshes": len(cache)}


class ScriptedLayouts:
    """Test policy: at the given steps switch to the given plan; records the switch costs."""

    def __init__(self, plan, script):
        self.plan, self.script, self.costs = plan, dict(script), []

    def observe(self, record):
        from copus.core.records import Decision

        if record.step not in self.script:
            return None
        self.plan = self.script[record.step]
        return Decision(kind="reconfigure", plan=self.plan, reason="scripted", step=record.step)

    def record_switch_cost(self, seconds):
        self.costs.append(seconds)

    def state_dict(self):
        return {"costs": self.costs}

    def load_state_dict(self, d):
        self.costs = list(d["costs"])


def _scripted(cfg, plan, world, shape):
    return ScriptedLayouts(plan, {
        1: ParallelPlan(dp=2, tp=2, pp=1, micro_batch_size=2, num_microbatches=2),
        2: ParallelPlan(dp=2, tp=1, pp=2, micro_batch_size=2, num_microbatches=4)})


def _trainer_run(run_dir: str, switch: str) -> dict:
    import torch

    from copus.config import load_config
    from copus.runtime.trainer import Trainer

    cfg = load_config(None, [
        "data.max_chars=40000", "eval.interval_steps=0", "log.progress=false",
        "log.tensorboard=false", "batch.initial=8", "batch.min=4", "train.max_steps=3",
        "checkpoint.interval_steps=0", "train.lr_schedule='constant'",
        "parallel.micro_batch_size=1", f"controller.switch='{switch}'"])
    seen: list[dict] = []

    def on_batch(step, global_ids, local_ids):
        seen.append({"step": step, "global": global_ids.tolist(), "local": local_ids.tolist()})

    trainer = Trainer(cfg, run_dir, torch.device("cpu"), on_batch=on_batch,
                      policy_factory=_scripted)
    try:
        trainer.run()
        costs = list(getattr(trainer.policy, "costs", []))
        plan = trainer.plan
        sampler = (trainer.sampler.num_samples, trainer.sampler.seed)
    finally:
        trainer.close()
    return {"seen": seen, "costs": costs, "layout": plan.layout,
            "batch": plan.global_batch_size, "sampler": sampler}


def _all_checks(root: str) -> dict:
    return {"engine": _engine_switches(f"{root}/engine"),
            "in-process": _trainer_run(f"{root}/in-process", "in-process"),
            "checkpoint": _trainer_run(f"{root}/checkpoint", "checkpoint")}


# ------------------------------------------------------------------------------ the test

@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("reconfigure")
    return root, run_ranks(_all_checks, 4, str(root), timeout=240)


def _union(states: list[dict]) -> dict:
    out: dict = {}
    for state in states:
        for key, value in state.items():
            if key in out:
                assert np.array_equal(out[key], value), key     # replicas agree
            out[key] = value
    return out


def test_losses_after_switch_equal_a_straight_load(four_ranks):
    _, results = four_ranks
    r = results[0]["engine"]
    assert all(np.isfinite(r["losses"]))
    assert r["losses"][2:] == r["reference"]                   # tolerance: exact
    assert [x["engine"]["losses"] for x in results] == [r["losses"]] * 4
    assert r["meshes"] == 3                                     # one cached mesh per layout


def test_weights_and_adam_moments_survive_the_reshard(four_ranks):
    _, results = four_ranks
    before = results[0]["engine"]["before"]                     # dp4: every rank holds all keys
    after = _union([x["engine"]["after"] for x in results])     # dp2·tp2
    after2 = _union([x["engine"]["after2"] for x in results])   # pp2·dp2: stages hold halves
    assert set(before) == set(after) == set(after2)
    moments = [k for k in before if k.endswith((".exp_avg", ".exp_avg_sq"))]
    steps = [k for k in before if k.endswith(".step")]
    assert len(moments) == 2 * len(steps) > 0
    for key in before:
        assert np.array_equal(np.asarray(before[key]), np.asarray(after[key])), key
    assert all(float(before[k]) == 2.0 for k in steps)
    assert all(float(after2[k]) == 4.0 for k in steps)          # 2 more steps under dp2·tp2
    assert any(np.abs(before[k]).sum() > 0 for k in moments)


def test_switch_reports_are_measured_and_agree_across_ranks(four_ranks):
    _, results = four_ranks
    reports = results[0]["engine"]["reports"]
    assert [x["engine"]["reports"] for x in results] == [reports] * 4
    for rep in reports:
        assert rep["method"] == "in-process"
        phases = [rep[k] for k in ("stage_s", "teardown_s", "build_s", "load_s")]
        assert all(0 <= x <= rep["wall_s"] for x in phases) and sum(phases) > 0
        assert rep["staged_bytes"] > 0 and rep["rss_peak_mb"] >= rep["rss_before_mb"] > 0
    assert [rep["staging"] for rep in reports] == ["shm", "disk"]
    assert reports[0]["old_plan"] == DP4.describe() and reports[1]["new_plan"] == \
        PP2DP2.describe()


def _by_step(seen_per_rank: list[list[dict]]) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for seen in seen_per_rank:
        for r in seen:
            entry = by_step.setdefault(r["step"], {"global": r["global"], "locals": []})
            assert entry["global"] == r["global"]
            entry["locals"].append(r["local"])
    return by_step


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


@pytest.mark.parametrize("switch", ["in-process", "checkpoint"])
def test_trainer_switch_consumes_every_sample_once(four_ranks, switch):
    root, results = four_ranks
    from copus.runtime.data import GlobalSampler

    by_step = _by_step([x[switch]["seen"] for x in results])
    assert sorted(by_step) == [1, 2, 3]
    for s, entry in by_step.items():
        dp = 4 if s == 1 else 2
        assert len(entry["locals"]) == 4 and len({tuple(x) for x in entry["locals"]}) == dp, s
        tiled = sorted(i for local in {tuple(x) for x in entry["locals"]} for i in local)
        assert tiled == sorted(entry["global"]), s             # dp slices partition the batch
    assert [len(by_step[s]["global"]) for s in (1, 2, 3)] == [8, 8, 16]
    consumed = [i for s in range(1, 4) for i in by_step[s]["global"]]
    num_samples, seed = results[0][switch]["sampler"]
    assert num_samples > len(consumed)                          # one epoch: each id at most once
    assert consumed == GlobalSampler(num_samples, seed).ids(0, len(consumed)).tolist()
    assert len(set(consumed)) == len(consumed)
    final = results[0][switch]
    assert (final["layout"], final["batch"]) == (PP2DP2.layout, 16)
    costs = results[0][switch]["costs"]
    assert len(costs) == 2 and all(c > 0 for c in costs)
    decisions = [json.loads(x) for x in
                 (root / switch / "decisions.jsonl").read_text().splitlines()]
    assert [d["switch"]["method"] for d in decisions] == [switch, switch]
    assert [d["switch_s"] for d in decisions] == costs


def test_in_process_and_checkpoint_switches_give_the_same_losses(four_ranks):
    root, _ = four_ranks
    a, b = _losses(root / "in-process"), _losses(root / "checkpoint")
    assert len(a) == 3 and np.isfinite(a).all()
    assert a == b                                               # tolerance: exact


def test_release_tensors_frees_weights_grads_and_adam_state():
    import torch

    from copus.runtime.reconfigure import release_tensors

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    shared = model[1].bias.detach().numpy()          # numpy-shared storages cannot be shrunk
    freed, stuck = release_tensors(model, opt)
    n = sum(p.numel() for p in model.parameters())
    assert stuck == 1 and shared.size == 4
    # fp32 params (less the stuck bias: 4 floats) + grads + exp_avg + exp_avg_sq + 4 steps
    assert freed == 4 * (n - 4) + 3 * 4 * n + 4 * 4
    assert all(p.untyped_storage().nbytes() == 0 for p in model[0].parameters())
    assert all(p.grad.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(v.untyped_storage().nbytes() == 0 for st in opt.state.values() for v in st.values())


def test_same_layout_is_refused_before_any_work():
    from types import SimpleNamespace

    from copus.runtime.reconfigure import switch_engine

    engine = SimpleNamespace(plan=DP4, device="cpu")
    with pytest.raises(ValueError, match=r"layout \(4, 1, 1\) is unchanged"):
        switch_engine(engine, DP4.with_batch(16), lambda plan: None)


def test_stage_dir_needs_room_and_falls_back_to_the_shared_folder(tmp_path, monkeypatch):
    import torch

    from copus.runtime import reconfigure as rc

    cpu = torch.device("cpu")
    monkeypatch.setattr(rc, "SHM_ROOT", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    path, kind = rc.make_stage_dir(tmp_path / "shared", cpu, local_bytes=1000)
    assert kind == "shm" and path.parent == tmp_path / "shm" and path.is_dir()
    path, kind = rc.make_stage_dir(tmp_path / "shared", cpu, prefer_shm=False)
    assert kind == "disk" and path.parent == tmp_path / "shared"
    with pytest.raises(ValueError, match="no staging folder with"):
        rc.make_stage_dir(tmp_path / "shared", cpu, local_bytes=1 << 60)   # no disk that big
    assert rc.state_bytes({"w": torch.zeros(3, 4), "step": 7}, {"m": torch.zeros(2)}) == 56


def test_a_staging_folder_left_by_a_killed_process_is_removed_by_the_next_switch(tmp_path,
                                                                                 monkeypatch):
    import subprocess
    import sys

    import torch

    from copus.runtime import reconfigure as rc

    monkeypatch.setattr(rc, "SHM_ROOT", tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)                       # exited: its pid names no live process
    own = rc._stage_prefix()
    stale = tmp_path / f"{rc._host_prefix()}{dead_pid}-abc"
    live = tmp_path / f"{own}xyz"                     # this process: still in use
    other_host = tmp_path / f"{rc.STAGE_PREFIX}otherhost-{dead_pid}-abc"
    unrelated = tmp_path / "notes"
    for folder in (stale, live, other_host, unrelated):
        folder.mkdir()
        (folder / "shard.distcp").write_bytes(b"x" * 100)
    path, kind = rc.make_stage_dir(None, torch.device("cpu"), local_bytes=10)
    assert kind == "shm" and path.name.startswith(own)
    assert not stale.exists()
    assert live.exists() and other_host.exists() and unrelated.exists()
