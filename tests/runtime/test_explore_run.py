"""Real multi-process runs of the goodput controller's probes and audits (issue 15):
a 4-rank run probes another layout in the running processes and keeps every sample exactly
once; a 2-rank run undoes a layout change whose realised step time misses its prediction."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from copus.config import load_config

BASE = ["data.max_chars=300000", "eval.interval_steps=0", "log.progress=false",
        "log.tensorboard=false", "checkpoint.interval_steps=0", "train.lr_schedule=constant",
        "batch.initial=8", "batch.min=8", "batch.max=8", "batch.ramp_to=8"]


def _rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines() if x.strip()]


def _launch(cfg, run_dir, entry=None):
    from copus.runtime.launch import launch

    result = launch(cfg, str(run_dir), max_restarts=0, entry=entry)
    assert not result.get("error"), result
    return result


def _every_sample_once(steps: list[dict]) -> None:
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))   # one lineage
    samples = 0
    for r in steps:
        samples += r["global_batch_size"]
        assert r["samples"] == samples


@pytest.mark.slow
def test_four_rank_run_probes_a_layout_in_process(tmp_path):
    """Forced exploration: one probe of the model's best other layout after one measured step
    of dp4; one warm-up + one measured step under it, then keep or go back, on measurements."""
    cfg = load_config(None, [*BASE, "parallel.nproc=4", "train.max_steps=6",
                             "batch.warmup_steps=0", "controller.explore_max_probes=1",
                             "controller.explore_steps=1", "controller.explore_interval_steps=0",
                             "controller.explore_top_k=1"])
    run = tmp_path / "run"
    _launch(cfg, run)
    steps, rows = _rows(run, "metrics.jsonl"), _rows(run, "decisions.jsonl")
    _every_sample_once(steps)
    layouts = [(r["dp"], r["tp"], r["pp"]) for r in steps]
    probes = [d for d in rows if d.get("purpose") == "probe"]
    results = [d for d in rows if d.get("event") == "probe_result"]
    assert len(probes) == 1 and len(results) == 1                # bounded: one probe
    probe = probes[0]
    assert probe["applied"] and probe["switch"]["method"] == "in-process"
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
    """The goodput controller with a prior that believes tensor parallelism is free and data
    parallelism expensive (on CPU/gloo the opposite is true: tp2 is 2.6-4x slower than dp2,
    cpu-notes §g), so it switches dp2 -> tp2 at once and the audit must catch the miss."""
    from copus.core.fit import prior_model
    from copus.core.policies import PolicySettings, make_policy

    base = prior_model(shape, None, world)
    wrong = base.with_params(replace(base.params, tp_latency_s=1e-9, tp_s_per_byte=1e-15,
                                     dp_latency_s=0.05, dp_s_per_byte=1e-6))
    return make_policy("goodput", PolicySettings.from_config(cfg), plan, world, shape,
                       step_time_model=wrong, audit_steps=cfg.controller.audit_steps,
                       margin=cfg.controller.margin)


def wrong_prior_worker(cfg, run_dir, resume):
    from copus.runtime.trainer import worker

    return worker(cfg, run_dir, resume, policy_factory=wrong_prior_factory)


@pytest.mark.slow
def test_two_rank_run_undoes_a_switch_that_missed_its_prediction(tmp_path):
    # dp2 runs 3 measured steps before the decision (step 4), tp2 one warm-up + 3 measured
    cfg = load_config(None, [*BASE, "parallel.nproc=2", "train.max_steps=9",
                             "parallel.micro_batch_size=2", "batch.warmup_steps=4",
                             "batch.interval_steps=4", "gns.max_rel_err=1e9",
                             "controller.audit_steps=3"])
    run = tmp_path / "run"
    _launch(cfg, run, entry=wrong_prior_worker)
    steps, rows = _rows(run, "metrics.jsonl"), _rows(run, "decisions.jsonl")
    _every_sample_once(steps)
    switch = next(d for d in rows if d.get("purpose") == "decide")
    assert switch["kind"] == "reconfigure" and switch["tp"] == 2 and switch["applied"]
    audit = next(d for d in rows if d.get("event") == "audit")
    assert audit["decision_step"] == switch["step"] and audit["verdict"] == "undo"
    assert audit["realised_step_s"] > 1.5 * audit["predicted_step_s"]
    assert audit["realised_goodput"] < (1 - 0.10) * audit["before_goodput"]
    undo = next(d for d in rows if d.get("purpose") == "undo")
    assert undo["applied"] and (undo["dp"], undo["tp"]) == (2, 1) and undo["step"] == audit["step"]
    assert switch["step"] == 4 and undo["step"] == 4 + 1 + 3       # warm-up + audit_steps
    by_step = {r["step"]: (r["dp"], r["tp"]) for r in steps}
    assert by_step[undo["step"]] == (1, 2) and by_step[undo["step"] + 1] == (2, 1)
