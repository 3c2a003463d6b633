"""Real multi-process runs of the planning controller: a fresh 4-rank run starts on the
controller's plan, and every decision point leaves its "considered" row in decisions.jsonl."""

from __future__ import annotations

import json
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
def test_a_fresh_goodput_run_starts_on_the_controllers_fastest_plan(tmp_path):
    """controller.start = "planned" (default): the first step runs the controller's fastest plan
    at batch.initial, which on 4 ranks is not the configured pure-FSDP dp4; "initial" keeps dp4."""
    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.train.setup import initial_plan, make_run_policy

    overrides = [*BASE, "parallel.nproc=4", "train.max_steps=12", "batch.max=16"]
    cfg = load_config(None, overrides)
    shape = get_model_shape(cfg.model.name, cfg.model.seq_len)
    configured = initial_plan(cfg, 4, shape)
    planned = make_run_policy(cfg, configured, 4, shape).start_plan()
    assert configured.layout == (4, 1, 1) and planned.layout != configured.layout
    for start, want in (("planned", planned), ("initial", configured)):
        run = tmp_path / start
        _launch(load_config(None, [*overrides, f"controller.start='{start}'"]), run)
        steps = _rows(run, "metrics.jsonl")
        first = steps[0]
        assert (first["dp"], first["tp"], first["pp"]) == want.layout
        assert first["micro_batch_size"] == want.micro_batch_size
        _every_sample_once(steps)
        considered = [d for d in _rows(run, "decisions.jsonl") if d.get("event") == "considered"]
        assert considered and considered[0]["step"] == 10 and considered[0]["refused"]
