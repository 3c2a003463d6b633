"""copus.runtime.state.metrics: the run folder files, NaN → null, timelines and the summary."""

import json
import math
import tomllib

import numpy as np

from copus.config import load_config
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Candidate, Decision, StepRecord
from copus.reporting.runs import load_run
from copus.runtime.state.metrics import METRIC_KEYS, RunWriter, json_line

SEQ = 16


def record(step: int, plan: ParallelPlan, samples: int, **kw) -> StepRecord:
    return StepRecord(
        step=step,
        samples=samples,
        tokens=samples * SEQ,
        plan=plan,
        step_s=0.5,
        loss=kw.pop("loss", 3.0 - 0.1 * step),
        lr=1e-3,
        **kw,
    )


def plan(dp=1, tp=1, pp=1, mbs=4, n=2) -> ParallelPlan:
    return ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=n)


def write_run(run_dir) -> RunWriter:
    w = RunWriter(run_dir, rank0=True, tensorboard=False, progress=True, total_steps=4)
    w.write_config(load_config(None, ["batch.policy=gns"]))
    p1, p2 = plan(), plan(dp=2, mbs=4, n=2)
    w.log_step(record(1, p1, 8), wall_s=0.5)  # GNS not warm: NaN
    w.log_step(record(2, p1, 16, grad_sqnorm=2.0, grad_trace_cov=40.0, b_noise=20.0), wall_s=1.0)
    d = Decision(
        kind="reconfigure",
        plan=p2,
        reason="goodput +25%",
        step=2,
        b_noise=20.0,
        candidates=(Candidate(plan=p2, step_s=0.4, goodput=50.0),),
    )
    w.log_decision(d, switch_s=0.75, wall_s=1.8)
    w.log_step(record(3, p2, 32, b_noise=21.0), wall_s=2.3)
    w.log_eval(3, 2.5, samples=32, tokens=32 * SEQ, wall_s=2.4)
    w.log_step(record(4, p2, 48, loss=float("nan"), skipped=True), wall_s=2.8)
    return w


def test_metrics_lines_have_the_required_keys_and_nan_is_null(tmp_path):
    w = write_run(tmp_path)
    w.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert set(METRIC_KEYS) <= set(row), set(METRIC_KEYS) - set(row)
    assert rows[0]["b_noise"] is None and rows[0]["grad_sqnorm"] is None  # NaN → null
    assert rows[1]["b_noise"] == 20.0 and rows[1]["grad_trace_cov"] == 40.0
    assert rows[3]["loss"] is None and rows[3]["skipped"] is True
    assert rows[0]["tokens_per_s"] == 8 * SEQ / 0.5  # B·seq_len / step_s
    assert (rows[2]["dp"], rows[2]["global_batch_size"], rows[2]["micro_batch_size"]) == (2, 16, 4)
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()


def test_eval_decisions_config_and_report_can_read_them(tmp_path):
    w = write_run(tmp_path)
    w.close()
    evals = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert evals == [{"step": 3, "samples": 32, "tokens": 512, "wall_s": 2.4, "val_loss": 2.5}]
    (dec,) = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert dec["kind"] == "reconfigure" and dec["switch_s"] == 0.75 and dec["dp"] == 2
    assert dec["candidates"][0]["goodput"] == 50.0
    cfg = tomllib.loads((tmp_path / "config.toml").read_text())
    assert cfg["batch"]["policy"] == "gns"
    run = load_run(tmp_path)  # copus report's reader
    assert run.policy == "gns" and len(run.steps) == 4 and len(run.decisions) == 1
    assert math.isnan(run.series("b_noise")[0])


def test_summary_timelines_and_switch_costs(tmp_path, capsys):
    w = write_run(tmp_path)
    s = w.summary(wall_s=3.0)
    w.close()
    assert s["steps"] == 4 and s["tokens"] == 48 * SEQ and s["wall_s"] == 3.0
    assert s["final_loss"] is None and s["final_val_loss"] == 2.5
    assert [(b["step"], b["global_batch_size"]) for b in s["batch_timeline"]] == [(1, 8), (3, 16)]
    assert [(p["step"], p["dp"]) for p in s["plan_timeline"]] == [(1, 1), (3, 2)]
    assert s["switches"][0]["switch_s"] == 0.75 and s["switch_s_total"] == 0.75
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    text = (tmp_path / "summary.txt").read_text()
    assert "4 steps" in text and "val loss 2.5000" in text and "cost 0.75 s" in text
    assert text in capsys.readouterr().err


def test_appends_across_writers_and_non_rank0_writes_nothing(tmp_path):
    write_run(tmp_path / "a").close()
    with open(tmp_path / "a" / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "wall_s": 99')  # a line cut short by a crash
    w = RunWriter(tmp_path / "a")  # after a restart: appends, clock continues
    assert 2.8 <= w.wall_s() < 60.0
    w.log_step(record(5, plan(), 56))
    w.close()
    rows = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 6 and json.loads(rows[-1])["wall_s"] >= 2.8
    assert len(load_run(tmp_path / "a").steps) == 5  # the cut line is skipped
    other = RunWriter(tmp_path / "b", rank0=False, tensorboard=True, progress=True)
    other.write_config("x = 1\n")
    assert other.log_step(record(1, plan(), 8)) is None
    other.log_eval(1, 1.0)
    assert other.summary() == {}
    other.close()
    assert not (tmp_path / "b").exists()


def test_lines_are_flushed_before_close(tmp_path):
    w = RunWriter(tmp_path)
    w.log_step(record(1, plan(), 8), wall_s=0.1)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1
    w.close()


def test_json_line_handles_numpy_and_infinities():
    line = json_line(
        {"a": np.float32(1.5), "b": np.int64(3), "c": float("inf"), "d": [float("nan"), 1.0], "e": np.float64("nan")}
    )
    assert json.loads(line) == {"a": 1.5, "b": 3, "c": None, "d": [None, 1.0], "e": None}


def test_tensorboard_scalars(tmp_path):
    w = RunWriter(tmp_path, tensorboard=True)
    w.log_step(record(1, plan(), 8, b_noise=5.0), wall_s=0.1)
    w.log_eval(1, 2.0, wall_s=0.2)
    w.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
