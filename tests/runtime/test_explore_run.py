"""Real multi-process runs of the goodput controller's probes and audits (issue 15):
a 4-rank run probes another layout in the running processes and keeps every sample exactly
once; a 2-rank run undoes a batch growth whose realised step time misses its prediction."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from copus.config import load_config

BASE = [
    "data.max_chars=300000",
    "eval.interval_steps=0",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.interval_steps=0",
    "train.lr_schedule=constant",
    "batch.initial=8",
    "batch.min=8",
    "batch.max=8",
    "batch.ramp_to=8",
]


def _rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines() if x.strip()]


def _launch(cfg, run_dir, entry=None):
    from copus.runtime.train.launch import launch

    result = launch(cfg, str(run_dir), max_restarts=0, entry=entry)
    assert not result.get("error"), result
    return result


def _every_sample_once(steps: list[dict]) -> None:
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))  # one lineage
    samples = 0
    for r in steps:
        samples += r["global_batch_size"]
        assert r["samples"] == samples


@pytest.mark.slow
def test_four_rank_run_probes_a_layout_in_process(tmp_path):
    """Forced exploration: one probe of the model's best other layout after one measured step
    of dp4; one warm-up + one measured step under it, then keep or go back, on measurements."""
    cfg = load_config(
        None,
        [
            *BASE,
            "parallel.nproc=4",
            "train.max_steps=6",
            "controller.start='initial'",
            "batch.warmup_steps=0",
            "controller.explore_max_probes=1",
            "controller.explore_steps=1",
            "controller.explore_interval_steps=0",
            "controller.explore_top_k=1",
            # a switch prior too dear to amortise: only the probe moves the layout
            "controller.reconfig_cost_s=1000",
        ],
    )
    run = tmp_path / "run"
    _launch(cfg, run)
    steps, rows = _rows(run, "metrics.jsonl"), _rows(run, "decisions.jsonl")
    _every_sample_once(steps)
    layouts = [(r["dp"], r["tp"], r["pp"]) for r in steps]
    probes = [d for d in rows if d.get("purpose") == "probe"]
    results = [d for d in rows if d.get("event") == "probe_result"]
    assert len(probes) == 1 and len(results) == 1  # bounded: one probe
    probe = probes[0]
    assert probe["applied"] and probe["switch"]["method"] == "direct"
    assert probe["reason"].startswith("probe 1/1: ") and probe["step"] == 2
    probed = (probe["dp"], probe["tp"], probe["pp"])
    assert layouts[:2] == [(4, 1, 1)] * 2 and layouts[2:4] == [probed] * 2 and probed != (4, 1, 1)
    result = results[0]
    assert result["step"] == 4 and result["measured_step_s"] > 0 and result["before_step_s"] > 0
    if result["verdict"] == "keep":
        assert result["gain"] > 0.10 and layouts[4:] == [probed] * 2
    else:
        assert result["verdict"] == "revert" and layouts[4:] == [(4, 1, 1)] * 2
        (back,) = [d for d in rows if d.get("purpose") == "revert"]
        assert back["applied"] and back["step"] == 4


def wrong_prior_factory(cfg, plan, world, shape):
    """The goodput controller with a prior whose fixed per-step cost (100 s) dwarfs the compute,
    so it predicts that 8x the batch costs about the same step time, and grows B 4 -> 32 at
    once. On the real machine compute grows with the samples (8 micro-batches instead of 1 per
    rank), so B=32 takes several times longer: throughput is no higher while the statistical
    efficiency E(B) falls ((b+4)/(b+32) < 0.9 for any b_noise below ~250), and the audit must
    undo the growth. One micro-batch size and no layout changes: the batch is what differs."""
    from copus.core.cost.fit import prior_model
    from copus.core.control.policies import PolicySettings, make_policy

    base = prior_model(shape, None, world)
    wrong = base.with_params(replace(base.params, step_overhead_s=100.0))
    return make_policy(
        "goodput",
        PolicySettings.from_config(cfg),
        plan,
        world,
        shape,
        step_time_model=wrong,
        audit_steps=cfg.controller.audit_steps,
        margin=cfg.controller.margin,
        lr_aware=False,
        micro_batch_sizes=[2],
        allow_reconfigure=False,
    )


def wrong_prior_worker(cfg, run_dir, resume):
    from copus.runtime.train.launch import worker

    return worker(cfg, run_dir, resume, policy_factory=wrong_prior_factory)


@pytest.mark.slow
def test_two_rank_run_undoes_a_decision_that_missed_its_prediction(tmp_path):
    # B=4 runs 3 measured steps before the decision (step 4); B=32 one warm-up + 3 measured
    cfg = load_config(
        None,
        [
            *BASE,
            "parallel.nproc=2",
            "train.max_steps=9",
            "batch.initial=4",
            "batch.min=4",
            "batch.max=32",
            "batch.ramp_to=32",
            "batch.max_growth=8",
            "parallel.micro_batch_size=2",
            "batch.warmup_steps=4",
            "batch.interval_steps=4",
            "gns.max_rel_err=1e9",
            # a fixed, large c: the growth must look worth it from this model's small measured
            # b_noise (~0.14 at init: c·b_noise ≈ 5.6), so that the audit has a decision to undo
            "gns.calibration=40",
            "controller.audit_steps=3",
        ],
    )
    run = tmp_path / "run"
    _launch(cfg, run, entry=wrong_prior_worker)
    steps, rows = _rows(run, "metrics.jsonl"), _rows(run, "decisions.jsonl")
    _every_sample_once(steps)
    grow = next(d for d in rows if d.get("purpose") == "decide")
    assert grow["kind"] == "batch" and grow["global_batch_size"] == 32 and grow["applied"]
    audit = next(d for d in rows if d.get("event") == "audit")
    assert audit["decision_step"] == grow["step"] == 4 and audit["verdict"] == "undo"
    assert audit["realised_step_s"] > 2 * audit["predicted_step_s"]  # the miss
    assert audit["realised_goodput"] < (1 - 0.10) * audit["before_goodput"]
    undo = next(d for d in rows if d.get("purpose") == "undo")
    assert undo["applied"] and undo["global_batch_size"] == 4  # shrinks back
    assert undo["step"] == audit["step"] == 4 + 1 + 3  # warm-up + audit_steps
    batch = {r["step"]: r["global_batch_size"] for r in steps}
    assert [batch[s] for s in range(1, 10)] == [4] * 4 + [32] * 4 + [4]


@pytest.mark.slow
def test_a_fresh_goodput_run_starts_on_the_controllers_fastest_plan(tmp_path):
    """controller.start = "planned" (default): the first step runs the controller's fastest plan
    at batch.initial, which on 4 ranks is not the configured pure-FSDP dp4; "initial" keeps dp4."""
    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.train.setup import initial_plan, make_run_policy

    overrides = [*BASE, "parallel.nproc=4", "train.max_steps=2", "controller.explore_max_probes=0"]
    cfg = load_config(None, overrides)
    shape = get_model_shape(cfg.model.name, cfg.model.seq_len)
    configured = initial_plan(cfg, 4, shape)
    planned = make_run_policy(cfg, configured, 4, shape).start_plan()
    assert configured.layout == (4, 1, 1) and planned.layout != configured.layout
    for start, want in (("planned", planned), ("initial", configured)):
        run = tmp_path / start
        _launch(load_config(None, [*overrides, f"controller.start='{start}'"]), run)
        first = _rows(run, "metrics.jsonl")[0]
        assert (first["dp"], first["tp"], first["pp"]) == want.layout
        assert first["micro_batch_size"] == want.micro_batch_size
