"""Non-finite numbers never train the model or steer the controller.

- core: the GNS estimator, the step-time fitter and every policy ignore non-finite / skipped
  steps (their state is unchanged); a gradient spike (what a loss spike looks like to the
  statistics) does not make the goodput controller flap between plans;
- runtime: a non-finite loss skips the optimizer step (weights and Adam state untouched, gradients
  dropped); a run with a few NaN steps continues and counts them; a burst of
  `train.max_nonfinite_steps` consecutive ones stops `copus train` with one clear line.
NaNs are injected by wrapping the engine's loss function for chosen optimizer steps.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from copus.core.cost.fit import OnlineFitter
from copus.core.stats.gns import DecaySchedule, GnsEstimator
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan
from copus.core.control.policies import POLICY_NAMES, PolicySettings, make_policy
from copus.core.plan.records import StepRecord

NAN, INF = float("nan"), float("inf")
SHAPE = get_model_shape("tiny")


# ------------------------------------------------------------------------------------- core


def test_gns_estimator_state_is_untouched_by_non_finite_input():
    gns = GnsEstimator(DecaySchedule())
    for t in range(1, 6):
        assert gns.update(13.0 + 0.1 * t, 4, 4.0 + 0.01 * t, 16, tokens=t * 1000)
    before = gns.state_dict()
    bad_inputs = [
        (NAN, 4, 2.0, 16),
        (10.0, 4, INF, 16),
        (-INF, 4, 2.0, 16),
        (10.0, NAN, 2.0, 16),
        (1e308, 4, 1e-308, 16),
    ]  # overflows to a non-finite estimate
    for args in bad_inputs:
        assert gns.update(*args, tokens=9999) is False
    after = gns.state_dict()
    assert after.pop("num_skipped") == before.pop("num_skipped") + len(bad_inputs)
    assert after == before
    assert math.isfinite(gns.b_noise)


def test_step_time_fitter_drops_non_finite_times():
    fitter = OnlineFitter(SHAPE, "cpu", 2, refit_every=10**6)
    plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=2)
    for s in (0.5, 0.52, 0.51):
        fitter.observe(plan, s)
    before = copy.deepcopy(fitter.state_dict())
    for s in (NAN, INF, -INF, 0.0, -1.0):
        assert fitter.observe(plan, s) is False
    assert fitter.state_dict() == before


def _settings(**kw) -> PolicySettings:
    base = dict(initial=8, min=8, max=256, interval_steps=2, warmup_steps=2, ramp_samples=64, max_rel_err=10.0)
    return PolicySettings(**{**base, **kw})


def _record(
    step: int,
    plan: ParallelPlan,
    *,
    skipped: bool = False,
    scale: float = 1.0,
    step_s: float = 0.5,
    b_noise: float = 64.0,
) -> StepRecord:
    B = plan.global_batch_size
    return StepRecord(
        step=step,
        samples=step * B,
        tokens=step * B * SHAPE.seq_len,
        plan=plan,
        step_s=step_s,
        loss=4.0 * scale,
        lr=1e-3,
        small_sqnorm=20.0 * scale,
        small_batch=float(plan.micro_batch_size),
        num_small=plan.dp * plan.num_microbatches,
        big_sqnorm=4.0 * scale,
        ip_sq_mean=30.0 * scale,
        grad_sqnorm=2.0,
        grad_trace_cov=2.0 * b_noise,
        b_noise=b_noise,
        b_noise_rel_err=0.1,
        skipped=skipped,
    )


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_ignores_skipped_steps(name):
    """A skipped step carrying absurd (even finite) statistics changes no policy's state."""
    plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=2)
    policy = make_policy(name, _settings(), plan, 2, SHAPE)
    for step in range(1, 4):
        decision = policy.observe(_record(step, plan))
        if decision is not None:
            plan = decision.plan
    before = json.dumps(policy.state_dict(), sort_keys=True, default=str)
    for step, stats in ((4, dict(scale=1e6, step_s=1e4, b_noise=1e9)), (5, dict(scale=NAN, step_s=NAN, b_noise=NAN))):
        assert policy.observe(_record(step, plan, skipped=True, **stats)) is None
    after = json.loads(json.dumps(policy.state_dict(), sort_keys=True, default=str))
    before = json.loads(before)
    # the goodput controller counts wall time (a skipped step still took time); nothing else moves
    for state in (before, after):
        state.pop("elapsed_s", None)
        if isinstance(state.get("seen_plan"), list):
            state.pop("seen_plan")
    assert after == before, name


def _drive_goodput(
    spike_steps: set[int],
    kind: str = "both",
    trace: float = 8.0,
    lr_aware: bool = True,
    num_steps: int = 200,
    seed: int = 0,
):
    """The goodput controller on 4 ranks fed by a real GnsEstimator over synthetic per-step
    gradient statistics (|G|² = 1, tr(Σ) = `trace`, so b_noise = `trace` samples); step times
    from the controller's own model (±5 % noise). At `spike_steps` the gradient is 100x larger in
    its signal, its noise, or both: what a loss spike looks like to the statistics.
    Returns the plan of every step."""
    rng = np.random.default_rng(seed)
    plan = ParallelPlan(dp=4, tp=1, pp=1, micro_batch_size=2, num_microbatches=1)
    settings = _settings(interval_steps=5, warmup_steps=10, max=1024, max_rel_err=0.5)
    policy = make_policy("goodput", settings, plan, 4, SHAPE, lr_aware=lr_aware)
    gns = GnsEstimator(DecaySchedule())
    plans = []
    for step in range(1, num_steps + 1):
        B, b = plan.global_batch_size, plan.micro_batch_size
        g2, tr = 1.0, trace
        if step in spike_steps:
            g2 *= 100.0 if kind in ("both", "signal") else 1.0
            tr *= 100.0 if kind in ("both", "noise") else 1.0
        n = B // b
        small = np.array([g2 + tr / b * rng.chisquare(50) / 50 for _ in range(n)])
        big = g2 + tr / B * rng.chisquare(50) / 50
        gns.update(float(small.mean()), b, float(big), B, step * B * SHAPE.seq_len)
        step_s = float(policy.model.predict_plans([plan])[0]) * rng.uniform(0.95, 1.05)
        record = StepRecord(
            step=step,
            samples=step * B,
            tokens=step * B * SHAPE.seq_len,
            plan=plan,
            step_s=step_s,
            loss=3.0,
            small_sqnorm=float(small.mean()),
            small_batch=float(b),
            num_small=n,
            big_sqnorm=float(big),
            grad_sqnorm=gns.grad_sqnorm,
            grad_trace_cov=gns.grad_trace_cov,
            b_noise=gns.b_noise,
            b_noise_rel_err=gns.rel_err,
        )
        plans.append(plan)
        decision = policy.observe(record)
        if decision is not None:
            plan = decision.plan
    return plans


def _switches(plans: list[ParallelPlan]) -> list[tuple[int, ParallelPlan]]:
    return [(i + 2, p) for i, (q, p) in enumerate(zip(plans, plans[1:])) if p != q]


@functools.cache
def _control(trace: float, lr_aware: bool) -> list:
    return _switches(_drive_goodput(set(), "both", trace, lr_aware))


# (trace, lr_aware): a steady state inside the batch range (B = 32, dp4), and one where the
# controller later moves to a pipeline layout (pp4) on its own
REGIMES = [(8.0, True), (2.0, False)]


@pytest.mark.parametrize("kind", ["both", "noise", "signal"])
@pytest.mark.parametrize("regime", REGIMES, ids=["dp-steady", "moves-to-pp"])
@pytest.mark.parametrize("spike", [(60, 61, 62), (40, 80, 120)], ids=["3-in-a-row", "3-apart"])
def test_gradient_spike_does_not_make_the_controller_flap(spike, regime, kind):
    trace, lr_aware = regime
    plans = _drive_goodput(set(spike), kind, trace, lr_aware)
    batches = [p.global_batch_size for p in plans]
    assert all(b2 >= b1 for b1, b2 in zip(batches, batches[1:])), "the batch shrank"
    layouts = [p.layout for p in plans]
    left: set = set()
    for prev, cur in zip(layouts, layouts[1:]):
        if cur != prev:
            assert cur not in left, f"layout {cur} left and re-entered: flapping"
            left.add(prev)
    control = _control(trace, lr_aware)
    assert len(_switches(plans)) <= len(control) + 1, (_switches(plans), control)
    assert len(control) >= 1  # the controller is not asleep


# ------------------------------------------------------------------------------------- runtime


class _Poison:
    """Makes the engine's loss NaN on chosen optimizer steps (1-based, counted per process)."""

    def __init__(self, monkeypatch, steps) -> None:
        from copus.runtime.engine import engine

        self.steps, self.calls, self.active = steps, 0, False
        real_loss, real_step = engine.token_loss, engine.Engine.train_step
        poison = self

        def token_loss(logits, targets):
            loss = real_loss(logits, targets)
            return loss * NAN if poison.active else loss

        def train_step(eng, tokens, lr):
            poison.calls += 1
            poison.active = poison.calls in poison.steps
            try:
                return real_step(eng, tokens, lr)
            finally:
                poison.active = False

        monkeypatch.setattr(engine, "token_loss", token_loss)
        monkeypatch.setattr(engine.Engine, "train_step", train_step)


@pytest.fixture()
def one_rank(monkeypatch):
    """A one-rank gloo process group in this process (torch threads restored afterwards)."""
    import torch

    from copus.runtime.train import launch
    from copus.runtime.engine.dist import init_distributed, shutdown

    threads = torch.get_num_threads()
    for key, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(launch.free_port())
    ).items():
        monkeypatch.setenv(key, value)
    yield init_distributed(backend="gloo")
    shutdown()
    torch.set_num_threads(threads)


def test_non_finite_step_changes_no_weight_and_no_adam_state(one_rank, monkeypatch):
    import torch

    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.engine import Engine, EngineSettings

    _Poison(monkeypatch, steps={2})
    plan = ParallelPlan(dp=1, tp=1, pp=1, micro_batch_size=2, num_microbatches=2)
    eng = Engine(SHAPE, plan, EngineSettings(), one_rank, MeshCache("cpu"), seed=0)
    tokens = torch.randint(0, SHAPE.vocab_size, (4, SHAPE.seq_len + 1), generator=torch.Generator().manual_seed(0))

    def snapshot():
        weights = {n: p.detach().full_tensor().clone() for n, p in eng.model.named_parameters()}
        adam = {
            id(p): {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone() for k, v in s.items()}
            for p, s in eng.optimizer.state.items()
        }
        return weights, adam

    assert eng.train_step(tokens, 1e-3).finite
    weights, adam = snapshot()
    out = eng.train_step(tokens, 1e-3)  # poisoned
    assert not out.finite and math.isnan(out.loss)
    weights2, adam2 = snapshot()
    assert all(torch.equal(weights[n], weights2[n]) for n in weights)
    assert adam.keys() == adam2.keys() and all(torch.equal(adam[i][k], adam2[i][k]) for i in adam for k in adam[i])
    assert all(p.grad is None for p in eng.model.parameters())
    out = eng.train_step(tokens, 1e-3)  # clean again: it trains
    assert out.finite and math.isfinite(out.loss)
    assert any(not torch.equal(weights[n], p.detach().full_tensor()) for n, p in eng.model.named_parameters())
    eng.close()


RUN_ARGS = [
    "--nproc",
    "1",
    "--policy",
    "constant",
    "--set",
    "data.max_chars=60000",
    "--set",
    "eval.interval_steps=0",
    "--set",
    "checkpoint.interval_steps=2",
    "--set",
    "log.progress=false",
    "--set",
    "log.tensorboard=false",
    "--set",
    "train.warmup_tokens=0",
    "--set",
    "batch.initial=8",
]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_few_nan_steps_are_skipped_counted_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    from copus.cli import main

    _Poison(monkeypatch, steps={3, 4})
    run = tmp_path / "run"
    assert main(["train", *RUN_ARGS, "--max-steps", "7", "--run-dir", str(run)]) == 0, capsys.readouterr().err
    rows = _lines(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["skipped"] for r in rows] == [False, False, True, True, False, False, False]
    assert all(r["loss"] is None for r in rows[2:4])
    assert all(math.isfinite(r["loss"]) for r in rows[:2] + rows[4:])
    # the GNS EMAs ignored the skipped steps: b_noise stands still through them
    assert rows[1]["b_noise"] == rows[2]["b_noise"] == rows[3]["b_noise"]
    assert rows[4]["b_noise"] != rows[3]["b_noise"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary.get("num_skipped") == 2, summary


def test_a_burst_of_nan_steps_stops_the_run_with_one_clear_line(tmp_path, monkeypatch, capsys):
    from copus.cli import main

    _Poison(monkeypatch, steps=set(range(3, 100)))
    run = tmp_path / "run"
    code = main(
        ["train", *RUN_ARGS, "--max-steps", "20", "--run-dir", str(run), "--set", "train.max_nonfinite_steps=3"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("copus train: error: 3 consecutive non-finite steps"), err[-1]
    assert "train.max_nonfinite_steps=3" in err[-1] and "at step 5" in err[-1]
    rows = _lines(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # stopped, did not go on
    from copus.runtime.state import checkpoint as ckpt

    # checkpoints exist only up to the burst's last step-boundary save; none after the stop
    assert max(s for s, _ in ckpt.step_dirs(run / "checkpoints")) <= 4
