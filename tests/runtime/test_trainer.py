"""LR schedule, initial plan, and 2-process trainer runs: resume equality, sample accounting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from copus.config import load_config
from copus.core.specs.resolve import get_model_shape
from copus.runtime.engine.optim import LearningRate, LrSchedule
from copus.runtime.train.trainer import default_micro_batch_size, initial_plan

# ------------------------------------------------------------------------------ LR schedule


def test_schedule_warmup_then_cosine_to_min():
    s = LrSchedule(base_lr=1.0, kind="cosine", warmup_tokens=100, total_tokens=1100, min_lr_ratio=0.1)
    assert s.multiplier(0) == pytest.approx(0.01)
    assert s.multiplier(50) == pytest.approx(0.5)
    assert s.multiplier(100) == pytest.approx(1.0)
    assert s.multiplier(600) == pytest.approx(0.55)  # half-way: r + (1-r)/2
    assert s.multiplier(1100) == pytest.approx(0.1)
    assert s.multiplier(5000) == pytest.approx(0.1)  # stays at the floor


def test_schedule_linear_and_constant():
    lin = LrSchedule(base_lr=2.0, kind="linear", total_tokens=1000, min_lr_ratio=0.0)
    assert lin.multiplier(250) == pytest.approx(0.75)
    const = LrSchedule(base_lr=2.0, kind="constant", total_tokens=1000)
    assert const.multiplier(999) == 1.0


def test_schedule_is_in_tokens_not_steps():
    """The same tokens give the same LR whatever batch they came in."""
    lr = LearningRate(schedule=LrSchedule(base_lr=1e-3, total_tokens=10_000), rule="none", ref_batch=8)
    small_steps = [lr.lr(t) for t in range(0, 10_000, 1000)]
    assert small_steps == [lr.lr(t) for t in range(0, 10_000, 1000)]
    assert small_steps[0] > small_steps[-1]


def test_lr_rule_factor_is_absolute_and_serialisable():
    lr = LearningRate(schedule=LrSchedule(base_lr=1e-3, kind="constant"), rule="sqrt", ref_batch=8)
    assert lr.on_batch_change(32) == pytest.approx(2.0)
    assert lr.on_batch_change(128) == pytest.approx(4.0)
    assert lr.on_batch_change(8) == pytest.approx(1.0)  # back to the reference: no drift
    assert lr.lr(0) == pytest.approx(1e-3)
    lr.on_batch_change(72)
    state = json.loads(json.dumps(lr.state_dict()))
    other = LearningRate(schedule=lr.schedule, rule="sqrt", ref_batch=8)
    other.load_state_dict(state)
    assert other.lr(123) == lr.lr(123) and len(other.history) == 4


def test_lr_rules_linear_adascale():
    lin = LearningRate(schedule=LrSchedule(base_lr=1.0, kind="constant"), rule="linear", ref_batch=4)
    assert lin.on_batch_change(12) == pytest.approx(3.0)
    ada = LearningRate(schedule=LrSchedule(base_lr=1.0, kind="constant"), rule="adascale", ref_batch=4)
    assert ada.on_batch_change(16) == pytest.approx(1.0)  # no GNS estimate yet → 1
    # gain r = (σ² + μ²)/(σ²/S + μ²), σ² = tr(Σ)/B0: tr=40, B0=4 → σ²=10, μ²=1, S=4 → 11/3.5
    assert ada.on_batch_change(16, grad_sqnorm=1.0, grad_trace_cov=40.0) == pytest.approx(11 / 3.5)
    sg = LearningRate(
        schedule=LrSchedule(base_lr=1.0, kind="constant"), rule="sqrt-gain", ref_batch=4
    )  # AdaptDL AdamScale: sqrt of that gain
    assert sg.on_batch_change(16, grad_sqnorm=1.0, grad_trace_cov=40.0) == pytest.approx((11 / 3.5) ** 0.5)


def test_bad_schedule_values_are_value_errors():
    with pytest.raises(ValueError, match="lr_schedule"):
        LrSchedule(base_lr=1.0, kind="exp")
    with pytest.raises(ValueError, match="lr_rule"):
        LearningRate(schedule=LrSchedule(base_lr=1.0), rule="cube")


# ------------------------------------------------------------------------------ initial plan


def test_default_micro_batch_size():
    assert default_micro_batch_size(4, 1) == 4
    assert default_micro_batch_size(12, 1) == 4
    assert default_micro_batch_size(6, 1) == 3
    assert default_micro_batch_size(8, 4) == 2  # ≥ pp micro-batches
    assert default_micro_batch_size(7, 1) == 1


def test_initial_plan_defaults_to_pure_fsdp():
    shape = get_model_shape("tiny")
    plan = initial_plan(load_config(None, ["batch.initial=8"]), 2, shape)
    assert (plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches) == (2, 1, 1, 4, 1)
    plan = initial_plan(load_config(None, ["parallel.pp=2", "batch.initial=8"]), 4, shape)
    assert plan.layout == (2, 1, 2) and plan.num_microbatches >= 2


def test_initial_plan_rejects_bad_layouts():
    shape = get_model_shape("tiny")
    with pytest.raises(ValueError, match="tp=4 must divide n_heads=6"):
        initial_plan(load_config(None, ["parallel.tp=4"]), 4, shape)
    with pytest.raises(ValueError, match="does not divide the world size"):
        initial_plan(load_config(None, ["parallel.tp=3"]), 4, shape)
    with pytest.raises(ValueError, match="batch.initial=9"):
        initial_plan(load_config(None, ["batch.initial=9", "batch.min=1"]), 2, shape)


# ------------------------------------------------------------------------------ 2-process runs

BASE = [
    "data.max_chars=300000",
    "eval.interval_steps=0",
    "log.progress=false",
    "log.tensorboard=false",
    "batch.initial=8",
    "batch.min=4",
    "checkpoint.keep=5",
    "train.lr_schedule=constant",
    "train.warmup_tokens=2048",
]


def _cfg(*overrides: str):
    return load_config(None, [*BASE, *overrides])


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


class ScriptedPolicy:
    """Test policy: at the given steps switch to the given (global batch, micro batch)."""

    def __init__(self, plan, script):
        self.plan, self.script, self.seen = plan, dict(script), 0

    def observe(self, record):
        from copus.core.plan.records import Decision

        self.seen += 1
        if record.step in self.script:
            gbs, mbs = self.script[record.step]
            self.plan = record.plan.with_batch(gbs, mbs)
            return Decision(kind="batch", plan=self.plan, reason="scripted", step=record.step)
        return None

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, d):
        self.seen = d["seen"]


def scripted_factory(cfg, plan, world, shape):
    return ScriptedPolicy(plan, {2: (16, 4), 4: (24, 3)})


def recording_worker(cfg, run_dir, resume):
    """Entry for spawned ranks: the trainer with a scripted policy and an id-recording hook."""
    import os

    from copus.runtime.train.launch import worker

    path = Path(run_dir) / f"ids-rank{os.environ['RANK']}-resume{int(resume)}.jsonl"

    def on_batch(step, global_ids, local_ids):
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "global": global_ids.tolist(), "local": local_ids.tolist()}) + "\n")

    return worker(cfg, run_dir, resume, on_batch=on_batch, policy_factory=scripted_factory)


def _launch(cfg, run_dir, resume=False, entry=None):
    from copus.runtime.train.launch import launch

    result = launch(cfg, str(run_dir), resume=resume, max_restarts=0, entry=entry)
    assert not result.get("error"), result
    return result


@pytest.mark.slow
def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path):
    """Same plan (dp2): an uninterrupted 6-step run checkpoints at step 3; a second run folder
    holding only that checkpoint resumes and reproduces steps 4-6 bit for bit."""
    import shutil

    cfg = _cfg(
        "parallel.nproc=2",
        "train.max_tokens=" + str(6 * 8 * 128),
        "checkpoint.interval_steps=3",
        "batch.policy='constant'",
        "train.lr_schedule='cosine'",
    )
    full, cut = tmp_path / "full", tmp_path / "cut"
    _launch(cfg, full)
    shutil.copytree(full / "checkpoints" / "step-3", cut / "checkpoints" / "step-3")
    _launch(cfg, cut, resume=True)
    a, b = _losses(full), _losses(cut)
    assert sorted(a) == [1, 2, 3, 4, 5, 6] and sorted(b) == [4, 5, 6]
    assert all(math.isfinite(a[s]) for s in a)
    assert [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]  # tolerance: exact


@pytest.mark.slow
def test_every_sample_consumed_once_across_batch_and_dp_changes(tmp_path):
    """B 8 → 16 (step 2) → 24 with mb 3 (step 4) at dp2; resume at dp1 with B 24: the consumed ids
    are exactly the sampler stream, none skipped or repeated, and dp slices tile each batch."""
    run = tmp_path / "run"
    _launch(_cfg("parallel.nproc=2", "train.max_steps=5", "checkpoint.interval_steps=0"), run, entry=recording_worker)
    _launch(
        _cfg("parallel.nproc=1", "train.max_steps=7", "checkpoint.interval_steps=0"),
        run,
        resume=True,
        entry=recording_worker,
    )
    by_step: dict[int, dict] = {}
    for f in sorted(run.glob("ids-rank*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            entry = by_step.setdefault(r["step"], {"global": r["global"], "locals": []})
            assert entry["global"] == r["global"]
            entry["locals"].append(r["local"])
    assert sorted(by_step) == list(range(1, 8))
    sizes = [len(by_step[s]["global"]) for s in range(1, 8)]
    assert sizes == [8, 8, 16, 16, 24, 24, 24]
    for s, entry in by_step.items():
        tiled = sorted(i for local in entry["locals"] for i in local)
        assert tiled == sorted(entry["global"]), s  # dp slices partition the batch
    consumed = [i for s in range(1, 8) for i in by_step[s]["global"]]
    from copus.runtime.data.stream import GlobalSampler, build_datasets

    cfg = _cfg()
    train, _, _ = build_datasets(cfg.data, 128, 256)
    assert len(consumed) < len(train)  # one epoch: each id at most once
    assert consumed == GlobalSampler(len(train), cfg.train.seed).ids(0, len(consumed)).tolist()
    assert len(set(consumed)) == len(consumed)
    decisions = [json.loads(x) for x in (run / "decisions.jsonl").read_text().splitlines()]
    assert [d["global_batch_size"] for d in decisions] == [16, 24, 24]  # the last: resume
    assert decisions[-1]["reason"].startswith("world size changed from 2 to 1: global batch 24 kept; ")
    assert (decisions[-1]["dp"], decisions[-1]["micro_batch_size"]) == (1, 4)  # mb <= 4
    assert np.isfinite(list(_losses(run).values())).all()


@pytest.mark.slow
def test_nonfinite_steps_stop_the_run_with_a_clear_error(tmp_path):
    """lr = 1e30 blows the weights up; after train.max_nonfinite_steps consecutive non-finite
    steps (skipped, not applied) the worker stops and reports why instead of raising."""
    from copus.runtime.train.launch import launch

    cfg = _cfg(
        "parallel.nproc=1",
        "train.max_steps=30",
        "train.lr=1e30",
        "train.max_nonfinite_steps=3",
        "train.grad_clip=0.0",
        "batch.policy='constant'",
    )
    result = launch(cfg, str(tmp_path / "run"), max_restarts=0)
    assert result["kind"] == "training"
    assert "3 consecutive non-finite steps" in result["error"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows[-3:]] == [True, True, True]
    assert len(rows) < 30


@pytest.mark.parametrize(
    "dp,pp,mbs,nmb,rows",
    [
        (2, 1, 4, 1, 32),  # 64 samples over 2 ranks
        (2, 1, 64, 1, 32),  # micro-batch larger than the eval share: one eval micro-batch
        (1, 2, 8, 3, 64),
        (1, 2, 64, 2, 128),  # a pipeline needs >= pp eval micro-batches
        (4, 1, 3, 1, 15),  # 16 rows, rounded down to a multiple of 3
    ],
)
def test_eval_rows(dp, pp, mbs, nmb, rows):
    from types import SimpleNamespace

    from copus.core.plan.plan import ParallelPlan
    from copus.runtime.train.trainer import Trainer

    fake = SimpleNamespace(
        plan=ParallelPlan(dp=dp, tp=1, pp=pp, micro_batch_size=mbs, num_microbatches=nmb),
        cfg=load_config(None, ["eval.num_samples=64"]),
        val_set=range(1000),
    )
    assert Trainer.eval_rows(fake) == rows


# ------------------------------------------------------------------------------ elastic world size


def resume_report_worker(cfg, run_dir, resume):
    """Entry: the trainer as `worker` runs it, plus what it holds right after resuming (GNS
    state, progress, plan) and every step's sample ids."""
    import os

    from copus.runtime.engine.dist import init_distributed, shutdown
    from copus.runtime.train.trainer import Trainer

    rank = os.environ["RANK"]
    ids = Path(run_dir) / f"ids-rank{rank}-resume{int(resume)}.jsonl"

    def on_batch(step, global_ids, local_ids):
        with open(ids, "a") as f:
            f.write(json.dumps({"step": step, "global": global_ids.tolist()}) + "\n")

    from copus.runtime.engine.model import DrawCounter

    device = init_distributed(backend="gloo")
    drawn = DrawCounter.values
    trainer = Trainer(cfg, run_dir, device, resume=resume, on_batch=on_batch)
    try:
        report = {
            "drawn": DrawCounter.values - drawn,  # initial values drawn while building
            "gns": trainer.gns.state_dict(),
            "samples": trainer.progress.samples,
            "step": trainer.progress.step,
            "plan": trainer.plan.layout,
            "micro_batch_size": trainer.plan.micro_batch_size,
        }
        result = trainer.run()
    finally:
        trainer.close()
    shutdown()
    return {**result, "after_resume": report}


@pytest.mark.slow
def test_resume_at_a_smaller_world_replans_and_keeps_samples_and_gns(tmp_path):
    """goodput policy, micro-batch fixed at 2: 4 steps at world 2 (dp2 mb2x2), checkpoint;
    resume at world 1: the controller's replan (B=8 kept, mb2x4) is logged as a reconfigure
    decision with its reason and candidates; GNS state and the sample offset are the
    checkpoint's; the ids of all 7 steps are the sampler stream, none repeated."""
    run = tmp_path / "run"
    fixed = [
        "parallel.micro_batch_size=2",
        "batch.policy='goodput'",
        "checkpoint.interval_steps=0",
        "controller.start='initial'",
    ]  # start on dp2
    first = _launch(_cfg("parallel.nproc=2", "train.max_steps=4", *fixed), run, entry=resume_report_worker)
    assert first["final_plan"]["dp"] == 2 and first["final_plan"]["micro_batch_size"] == 2
    second = _launch(
        _cfg("parallel.nproc=1", "train.max_steps=7", *fixed), run, resume=True, entry=resume_report_worker
    )
    saved = json.loads((run / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    after = second["after_resume"]
    assert first["after_resume"]["drawn"] > 0 and after["drawn"] == 0  # resume draws nothing
    assert after["gns"] == json.loads(json.dumps(saved["gns"]))  # GNS state equal
    assert saved["gns"]["num_updates"] == 4
    assert (after["step"], after["samples"]) == (4, 32) == (saved["progress"]["step"], saved["sampler"]["offset"])
    assert after["plan"] == (1, 1, 1) and after["micro_batch_size"] == 2  # configured mb kept
    decisions = [json.loads(x) for x in (run / "decisions.jsonl").read_text().splitlines()]
    replans = [d for d in decisions if d.get("resumed_from")]
    assert len(replans) == 1, decisions
    d = replans[0]
    assert d["kind"] == "reconfigure" and d["step"] == 4 and d["resumed_from"] == "step-4"
    assert d["reason"].startswith("world size changed from 2 to 1: global batch 8 kept; ")
    assert "goodput controller's" in d["reason"] and d["world_size"] == 1
    assert (d["dp"], d["micro_batch_size"], d["num_microbatches"]) == (1, 2, 4)
    assert d["candidates"] and all(
        c["dp"] * c["tp"] * c["pp"] == 1 and c["micro_batch_size"] == 2 and c["global_batch_size"] == 8
        for c in d["candidates"]
    )
    by_step: dict[int, list[int]] = {}
    for f in sorted(run.glob("ids-rank*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            assert by_step.setdefault(r["step"], r["global"]) == r["global"]
    assert sorted(by_step) == list(range(1, 8))
    consumed = [i for s in range(1, 8) for i in by_step[s]]
    from copus.runtime.data.stream import GlobalSampler, build_datasets

    train, _, _ = build_datasets(_cfg().data, 128, 256)
    assert consumed == GlobalSampler(len(train), 0).ids(0, 7 * 8).tolist()
    assert len(set(consumed)) == len(consumed) and second["samples"] == 7 * 8


def test_auto_resume_only_continues_the_same_run():
    """Under an elastic launcher a checkpoint is continued when it carries this run id (host
    died or joined); one of another run only after a failure restart and without an id."""
    from types import SimpleNamespace

    from copus.runtime.train.trainer import Trainer

    def same(run_id, restarted, saved):
        return Trainer.same_run(
            SimpleNamespace(run_id=run_id, restarted=restarted), {"run_id": saved} if saved != "-" else {}
        )

    assert same("job-1", False, "job-1")  # membership change: restart count stays 0
    assert not same("job-1", True, "job-2")  # another job's checkpoint in this folder
    assert same("job-1", True, "-") and not same("job-1", False, "-")  # pre-run-id checkpoints
    assert same(None, True, None) and not same(None, False, None)


def test_elastic_env_helpers():
    from copus.runtime.train.setup import elastic_run_id, restart_count

    assert elastic_run_id({"TORCHELASTIC_RUN_ID": "my-run"}) == "my-run"
    assert elastic_run_id({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default id
    assert elastic_run_id({}) is None
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2 and restart_count({}) == 0


def test_run_hardware_prices_groups_across_launched_nodes():
    """CPU: no profile (the calibrated cpu prior). GPUs: the matching profile with the
    launcher's node shape: on 2 nodes x 8, tp=16 crosses nodes and is priced much slower than
    on one 16-GPU node; dp2·tp8 keeps tp inside nodes and slows down far less."""
    from copus.core.cost.fit import prior_model
    from copus.runtime.train.setup import run_hardware

    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"}
    assert run_hardware("cpu", "", env) is None
    hw = run_hardware("cuda", "NVIDIA H200", env)
    assert hw.name == "h200" and hw.gpus_per_node == 8  # 141 GB, not an 80 GB H100
    assert hw.memory_bytes == 141e9 and hw.memory_bw == 4.8e12
    assert run_hardware("cuda", "NVIDIA A100-SXM4-80GB", env).name == "a100-80gb"
    one_node = run_hardware("cuda", "NVIDIA H100 80GB HBM3", {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "16"})
    assert one_node.gpus_per_node == 16
    shape = get_model_shape("tinyllama-1.1b")  # 32 heads
    two, one = prior_model(shape, hw, 16), prior_model(shape, one_node, 16)
    tp16 = [np.array([v]) for v in (1, 16, 1, 1, 8)]
    tp8 = [np.array([v]) for v in (2, 8, 1, 1, 8)]
    slowdown16 = two.predict(*tp16)[0] / one.predict(*tp16)[0]
    slowdown8 = two.predict(*tp8)[0] / one.predict(*tp8)[0]  # only its dp pairs cross nodes
    assert slowdown16 > 1.5 > slowdown8 > 1.0


def _failing_saves(monkeypatch, fail_steps):
    """Make `checkpoint.save` fail (as on a full disk) at the given steps."""
    from copus.runtime.state import checkpoint as ck

    real = ck.save

    def save(root, step, *args, **kwargs):
        if step in fail_steps:
            raise ck.CheckpointError(
                f"checkpoint {root}/step-{step} not saved (OSError: "
                "[Errno 28] No space left on device); earlier checkpoints "
                "are intact"
            )
        return real(root, step, *args, **kwargs)

    monkeypatch.setattr(ck, "save", save)


def test_a_failed_interval_save_is_skipped_and_training_goes_on(tmp_path, monkeypatch, capsys):
    from copus.runtime.train.launch import launch

    _failing_saves(monkeypatch, {2})
    cfg = _cfg("parallel.nproc=1", "train.max_steps=6", "checkpoint.interval_steps=2", "batch.policy='constant'")
    result = launch(cfg, str(tmp_path / "run"), max_restarts=0)
    assert not result.get("error"), result
    assert result["steps"] == 6 and result["failed_saves"] == 1
    assert "step 2: checkpoint" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-4", "step-6"]


def test_failed_saves_in_a_row_stop_the_run_with_a_clear_error(tmp_path, monkeypatch):
    from copus.runtime.train.launch import launch

    _failing_saves(monkeypatch, {2, 4, 6, 8})
    cfg = _cfg(
        "parallel.nproc=1",
        "train.max_steps=10",
        "checkpoint.interval_steps=2",
        "checkpoint.max_failed_saves=2",
        "batch.policy='constant'",
    )
    result = launch(cfg, str(tmp_path / "run"), max_restarts=0)
    assert "2 checkpoint saves failed in a row (checkpoint.max_failed_saves=2)" in result["error"]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 4  # stopped at the second failure


@pytest.mark.slow
def test_a_background_checkpoint_resumes_bit_for_bit(tmp_path):
    """checkpoint.background: the step-3 checkpoint is written while steps 4-6 train (from the
    staged copy of step 3's state); resuming from it reproduces steps 4-6 exactly, as a
    synchronous one does."""
    import shutil

    from copus.runtime.state import checkpoint as ckpt

    cfg = _cfg(
        "parallel.nproc=2",
        "train.max_tokens=" + str(6 * 8 * 128),
        "checkpoint.interval_steps=3",
        "checkpoint.background=true",
        "batch.policy='constant'",
        "train.lr_schedule='cosine'",
    )
    full, cut = tmp_path / "full", tmp_path / "cut"
    _launch(cfg, full)
    for step in (3, 6):
        assert ckpt.verify(full / "checkpoints" / f"step-{step}") is None
    assert not list((full / "checkpoints").glob("tmp-step-*"))
    shutil.copytree(full / "checkpoints" / "step-3", cut / "checkpoints" / "step-3")
    _launch(cfg, cut, resume=True)
    a, b = _losses(full), _losses(cut)
    assert sorted(b) == [4, 5, 6] and [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]
