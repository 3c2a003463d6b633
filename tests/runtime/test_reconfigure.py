"""In-process layout switches (runtime/state/reconfigure.py, runtime/state/redistribute.py) on 4 gloo ranks.

Engine level, one chain: dp4 → dp2·tp2 → dp2·pp2 → tp2·pp2 → dp4 by the DIRECT path (shards
moved between the layouts in memory), then dp4 → dp2·tp2 by DCP staging in /dev/shm (path="dcp")
and dp2·tp2 → dp2·pp2 by the automatic choice when the direct path cannot apply (the optimizer
holds an entry it cannot map) — DCP staging on disk. After each switch the next loss must equal
that of a fresh engine that loads the state saved just before the switch straight into the new
plan (tolerance: exact). Around every direct switch the full weights and AdamW state (exp_avg,
exp_avg_sq, step) gathered before and after are equal, and the moved state held at once stays
within the stated bound.

Trainer level: a scripted policy switches dp4 → dp2·tp2 (after step 1) → pp2·dp2 with B 8 → 16
(after step 2), once with controller.switch="in-process" (direct) and once with "checkpoint":
identical losses, every sample id consumed exactly once, dp slices tile each batch, switch costs
reach the policy and decisions.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from copus.core.specs.models import ModelShape
from copus.core.plan.plan import ParallelPlan

from ._workers import run_ranks

SHAPE = ModelShape(
    name="switch-test", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64, seq_len=16
)
DP4 = ParallelPlan(dp=4, tp=1, pp=1, micro_batch_size=1, num_microbatches=2)
DP2TP2 = ParallelPlan(dp=2, tp=2, pp=1, micro_batch_size=2, num_microbatches=2)
PP2DP2 = ParallelPlan(dp=2, tp=1, pp=2, micro_batch_size=2, num_microbatches=2)
TP2PP2 = ParallelPlan(dp=1, tp=2, pp=2, micro_batch_size=2, num_microbatches=4)
# (how, plan): the engine-level chain of switches
CHAIN = (
    ("direct", DP2TP2),
    ("direct", PP2DP2),
    ("direct", TP2PP2),
    ("direct", DP4),
    ("dcp", DP2TP2),
    ("fallback", PP2DP2),
)
LR = 1e-2


# ------------------------------------------------------------------------------ rank code


def _tokens(step: int, engine) -> "torch.Tensor":  # noqa: F821
    """This dp rank's rows of step `step`'s fixed global batch (8 sequences)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    full = torch.randint(0, SHAPE.vocab_size, (8, SHAPE.seq_len + 1), generator=g)
    per = 8 // engine.plan.dp
    return full[engine.dp_rank * per : (engine.dp_rank + 1) * per]


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
            out[prefix + key] = v.detach().cpu().clone().numpy() if isinstance(v, torch.Tensor) else v
    return out


def _unmappable_entry(engine) -> None:
    """Give one parameter an optimizer entry the direct path cannot map (a plain 1-D tensor, as
    a factored-moment optimizer keeps): the automatic choice must fall back to DCP staging."""
    import torch

    p = next(iter(engine.model.parameters()))
    engine.optimizer.state[p]["row_factor"] = torch.zeros(3)


def _engine_switches(root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.engine import Engine, EngineSettings
    from copus.runtime.state.reconfigure import switch_engine

    cache = MeshCache("cpu")

    def build(plan, allocate=True, init=True):
        return Engine(SHAPE, plan, EngineSettings(), "cpu", cache, seed=0, allocate=allocate, init=init)

    engine = build(DP4)
    losses = _steps(engine, range(0, 2))
    states, reports = [], []
    for i, (how, plan) in enumerate(CHAIN):
        model_sd, optim_sd = engine.state_dicts()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/before-{i}")
        before = _full_state(engine) if how == "direct" else None
        if how == "fallback":
            _unmappable_entry(engine)
        engine, rep = switch_engine(
            engine,
            plan,
            build,
            fallback_root=root,
            path="dcp" if how == "dcp" else "auto",
            prefer_shm=how != "fallback",
        )
        if how == "direct":
            states.append((before, _full_state(engine)))
        reports.append(rep.to_dict())
        losses += _steps(engine, range(2 + i, 3 + i))
    engine.close()
    reference = []
    for i, (_, plan) in enumerate(CHAIN):
        ref = build(plan)
        model_sd, optim_sd = ref.state_dicts()
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=f"{root}/before-{i}")
        ref.load_state(state["model"], state["optim"])
        reference += _steps(ref, range(2 + i, 3 + i))
        ref.close()
    return {"losses": losses, "reference": reference, "states": states, "reports": reports, "meshes": len(cache)}


class ScriptedLayouts:
    """Test policy: at the given steps switch to the given plan; records the switch costs."""

    def __init__(self, plan, script):
        self.plan, self.script, self.costs = plan, dict(script), []

    def observe(self, record):
        from copus.core.plan.records import Decision

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
    return ScriptedLayouts(
        plan,
        {
            1: ParallelPlan(dp=2, tp=2, pp=1, micro_batch_size=2, num_microbatches=2),
            2: ParallelPlan(dp=2, tp=1, pp=2, micro_batch_size=2, num_microbatches=4),
        },
    )


def _trainer_run(run_dir: str, switch: str) -> dict:
    import torch

    from copus.config import load_config
    from copus.runtime.train.trainer import Trainer

    cfg = load_config(
        None,
        [
            "data.max_chars=40000",
            "eval.interval_steps=0",
            "log.progress=false",
            "log.tensorboard=false",
            "batch.initial=8",
            "batch.min=4",
            "train.max_steps=3",
            "checkpoint.interval_steps=0",
            "train.lr_schedule='constant'",
            "parallel.micro_batch_size=1",
            f"controller.switch='{switch}'",
        ],
    )
    seen: list[dict] = []

    def on_batch(step, global_ids, local_ids):
        seen.append({"step": step, "global": global_ids.tolist(), "local": local_ids.tolist()})

    trainer = Trainer(cfg, run_dir, torch.device("cpu"), on_batch=on_batch, policy_factory=_scripted)
    try:
        trainer.run()
        costs = list(getattr(trainer.policy, "costs", []))
        plan = trainer.plan
        sampler = (trainer.sampler.num_samples, trainer.sampler.seed)
    finally:
        trainer.close()
    return {"seen": seen, "costs": costs, "layout": plan.layout, "batch": plan.global_batch_size, "sampler": sampler}


def _all_checks(root: str) -> dict:
    return {
        "engine": _engine_switches(f"{root}/engine"),
        "in-process": _trainer_run(f"{root}/in-process", "in-process"),
        "checkpoint": _trainer_run(f"{root}/checkpoint", "checkpoint"),
    }


# ------------------------------------------------------------------------------ the test


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("reconfigure")
    return root, run_ranks(_all_checks, 4, str(root), timeout=600)  # loaded 2-core hosts


def _union(states: list[dict]) -> dict:
    out: dict = {}
    for state in states:
        for key, value in state.items():
            if key in out:
                assert np.array_equal(out[key], value), key  # replicas agree
            out[key] = value
    return out


def test_losses_after_switch_equal_a_straight_load(four_ranks):
    _, results = four_ranks
    r = results[0]["engine"]
    assert len(r["losses"]) == 2 + len(CHAIN) and all(np.isfinite(r["losses"]))
    assert r["losses"][2:] == r["reference"]  # tolerance: exact
    assert [x["engine"]["losses"] for x in results] == [r["losses"]] * 4
    assert r["meshes"] == 4  # one cached mesh per layout


def test_direct_switch_moves_weights_and_adam_moments_unchanged(four_ranks):
    _, results = four_ranks
    per_rank = [x["engine"]["states"] for x in results]
    assert len(per_rank[0]) == 4  # the four direct switches
    for k, _ in enumerate(per_rank[0]):
        before = _union([states[k][0] for states in per_rank])
        after = _union([states[k][1] for states in per_rank])
        assert set(before) == set(after)
        moments = [key for key in before if key.endswith((".exp_avg", ".exp_avg_sq"))]
        steps = [key for key in before if key.endswith(".step")]
        assert len(moments) == 2 * len(steps) > 0
        for key in before:
            assert np.array_equal(np.asarray(before[key]), np.asarray(after[key])), (k, key)
        assert all(float(before[key]) == 2.0 + k for key in steps)
        assert any(np.abs(before[key]).sum() > 0 for key in moments)


def test_switch_reports_are_measured_and_agree_across_ranks(four_ranks):
    _, results = four_ranks
    reports = results[0]["engine"]["reports"]
    assert [x["engine"]["reports"] for x in results] == [reports] * 4
    assert [rep["method"] for rep in reports] == ["direct"] * 4 + ["in-process"] * 2
    for rep in reports:
        phases = [rep[k] for k in ("stage_s", "teardown_s", "build_s", "load_s", "plan_s", "move_s")]
        assert all(0 <= x <= rep["wall_s"] for x in phases) and sum(phases) > 0
        assert rep["rss_peak_mb"] >= rep["rss_before_mb"] > 0
    for rep in reports[:4]:
        assert rep["staged_bytes"] == 0 and rep["moved_bytes"] > 0 and rep["move_s"] > 0
        assert rep["collectives"] <= rep["buckets"] and rep["fallback_reason"] == ""
        # the stated bound: moved state held at once <= max(old, new) + 3 buckets in flight
        assert rep["state_mb"] < rep["state_peak_mb"] <= rep["state_mb"] + 3 * rep["cap_bytes"] / 2**20
    assert [rep["staging"] for rep in reports[4:]] == ["shm", "disk"]
    assert all(rep["staged_bytes"] > 0 for rep in reports[4:])
    assert reports[4]["fallback_reason"] == ""  # forced: path="dcp"
    assert "row_factor" in reports[5]["fallback_reason"]  # automatic fallback
    assert reports[0]["old_plan"] == DP4.describe() and reports[2]["new_plan"] == TP2PP2.describe()


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
    from copus.runtime.data.stream import GlobalSampler

    by_step = _by_step([x[switch]["seen"] for x in results])
    assert sorted(by_step) == [1, 2, 3]
    for s, entry in by_step.items():
        dp = 4 if s == 1 else 2
        assert len(entry["locals"]) == 4 and len({tuple(x) for x in entry["locals"]}) == dp, s
        tiled = sorted(i for local in {tuple(x) for x in entry["locals"]} for i in local)
        assert tiled == sorted(entry["global"]), s  # dp slices partition the batch
    assert [len(by_step[s]["global"]) for s in (1, 2, 3)] == [8, 8, 16]
    consumed = [i for s in range(1, 4) for i in by_step[s]["global"]]
    num_samples, seed = results[0][switch]["sampler"]
    assert num_samples > len(consumed)  # one epoch: each id at most once
    assert consumed == GlobalSampler(num_samples, seed).ids(0, len(consumed)).tolist()
    assert len(set(consumed)) == len(consumed)
    final = results[0][switch]
    assert (final["layout"], final["batch"]) == (PP2DP2.layout, 16)
    costs = results[0][switch]["costs"]
    assert len(costs) == 2 and all(c > 0 for c in costs)
    decisions = [json.loads(x) for x in (root / switch / "decisions.jsonl").read_text().splitlines()]
    method = "direct" if switch == "in-process" else switch
    assert [d["switch"]["method"] for d in decisions] == [method, method]
    assert [d["switch_s"] for d in decisions] == costs


def test_in_process_and_checkpoint_switches_give_the_same_losses(four_ranks):
    root, _ = four_ranks
    a, b = _losses(root / "in-process"), _losses(root / "checkpoint")
    assert len(a) == 3 and np.isfinite(a).all()
    assert a == b  # tolerance: exact


def test_release_tensors_frees_weights_grads_and_adam_state():
    import torch

    from copus.runtime.state.reconfigure import release_tensors

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    shared = model[1].bias.detach().numpy()  # numpy-shared storages cannot be shrunk
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

    from copus.runtime.state.reconfigure import switch_engine

    engine = SimpleNamespace(plan=DP4, device="cpu")
    with pytest.raises(ValueError, match=r"layout \(4, 1, 1\) is unchanged"):
        switch_engine(engine, DP4.with_batch(16), lambda plan, allocate=True: None)


def test_stage_dir_needs_room_and_falls_back_to_the_shared_folder(tmp_path, monkeypatch):
    import torch

    from copus.runtime.state import reconfigure as rc

    cpu = torch.device("cpu")
    monkeypatch.setattr(rc, "SHM_ROOT", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    path, kind = rc.make_stage_dir(tmp_path / "shared", cpu, local_bytes=1000)
    assert kind == "shm" and path.parent == tmp_path / "shm" and path.is_dir()
    path, kind = rc.make_stage_dir(tmp_path / "shared", cpu, prefer_shm=False)
    assert kind == "disk" and path.parent == tmp_path / "shared"
    with pytest.raises(ValueError, match="no staging folder with"):
        rc.make_stage_dir(tmp_path / "shared", cpu, local_bytes=1 << 60)  # no disk that big
    assert rc.state_bytes({"w": torch.zeros(3, 4), "step": 7}, {"m": torch.zeros(2)}) == 56


def test_a_staging_folder_left_by_a_killed_process_is_removed_by_the_next_switch(tmp_path, monkeypatch):
    import subprocess
    import sys

    import torch

    from copus.runtime.state import reconfigure as rc

    monkeypatch.setattr(rc, "SHM_ROOT", tmp_path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)  # exited: its pid names no live process
    own = rc._stage_prefix()
    stale = tmp_path / f"{rc._host_prefix()}{dead_pid}-abc"
    live = tmp_path / f"{own}xyz"  # this process: still in use
    other_host = tmp_path / f"{rc.STAGE_PREFIX}otherhost-{dead_pid}-abc"
    unrelated = tmp_path / "notes"
    for folder in (stale, live, other_host, unrelated):
        folder.mkdir()
        (folder / "shard.distcp").write_bytes(b"x" * 100)
    path, kind = rc.make_stage_dir(None, torch.device("cpu"), local_bytes=10)
    assert kind == "shm" and path.name.startswith(own)
    assert not stale.exists()
    assert live.exists() and other_host.exists() and unrelated.exists()


def test_controller_prior_is_the_direct_switch_cost_model_unless_configured():
    from copus.config import load_config
    from copus.core.specs.hardware import get_hardware
    from copus.core.specs.resolve import get_model_shape
    from copus.core.plan.reshard import direct_switch_cost_s
    from copus.runtime.train.setup import make_run_policy, switch_cost_prior_s

    tiny = get_model_shape("tiny")
    auto = switch_cost_prior_s(-1.0, tiny, 4, None)
    assert auto == direct_switch_cost_s(12.0 * tiny.num_params())
    assert switch_cost_prior_s(5.0, tiny, 4, None) == 5.0
    h100 = get_hardware("h100-sxm")
    assert switch_cost_prior_s(-1.0, tiny, 8, h100) == direct_switch_cost_s(
        12.0 * tiny.num_params(), 8 * h100.intra_node_bw
    )
    cfg = load_config(None, ["batch.policy='goodput'"])
    assert cfg.controller.reconfig_cost_s == -1.0
    policy = make_run_policy(cfg, DP4.with_batch(8), 4, tiny)
    assert policy.reconfig_cost_s == pytest.approx(auto)  # before any measured switch
    policy.record_switch_cost(0.5)
    assert policy.reconfig_cost_s == 0.5  # then the measured cost
    with pytest.raises(ValueError, match="reconfig_cost_s"):
        load_config(None, ["controller.reconfig_cost_s=-2"])
