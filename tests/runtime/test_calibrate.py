"""Branching from a staged state (runtime/train/branching.py), the auto probe (runtime/train/probe.py) and
`copus calibrate`'s refusals. Tiny model, 2 gloo ranks, a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from copus.config import load_config
from tests.runtime._workers import run_ranks

BASE = [
    "data.max_chars=300000",
    "eval.interval_steps=0",
    "eval.num_samples=8",
    "log.progress=false",
    "log.tensorboard=false",
    "batch.initial=8",
    "batch.min=4",
    "parallel.micro_batch_size=2",
    "train.lr_schedule=constant",
    "train.warmup_tokens=0",
    "checkpoint.interval_steps=0",
    "parallel.reshard_after_forward=false",
]


def _cfg(*overrides: str):
    return load_config(None, [*BASE, *overrides])


def _tensors(trainer) -> dict:
    """This rank's model and optimizer shards as plain CPU tensors (for exact comparisons)."""
    import torch
    from torch.distributed.tensor import DTensor

    model_sd, optim_sd = trainer.engine.state_dicts()
    out = {}
    for prefix, sd in (("model", model_sd), ("optim", optim_sd)):
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                out[f"{prefix}.{k}"] = (v.to_local() if isinstance(v, DTensor) else v).clone()
            else:
                out[f"{prefix}.{k}"] = v
    return out


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def branch_worker(run_dir: str) -> dict:
    """3 ordinary steps, then branches k = 0.5, 1, 2 from the staged state (ids recorded), the
    k = 2 branch again (bit-identical?), and the state after a final restore (= staged?)."""
    import torch

    from copus.runtime.train import branching as br
    from copus.runtime.train.trainer import Trainer

    trainer = Trainer(
        _cfg("parallel.nproc=2", "batch.policy='constant'", "train.max_steps=20"), run_dir, torch.device("cpu")
    )
    for _ in range(3):
        trainer.train_step()
    staged = br.stage(trainer)
    before = _tensors(trainer)
    n = br.branch_samples([4, 8, 16], 10 * 128, 128)  # 16 samples: 4, 2, 1 steps
    marks = br.mark_samples(n, [4, 8, 16], 2)
    rows = br.fixed_eval_rows(trainer)
    ids: dict[str, list[int]] = {}
    results = {}
    for name, k in (("k0.5", 0.5), ("k1", 1.0), ("k2", 2.0), ("k2-again", 2.0)):
        seen: list[int] = []
        spec = br.BranchSpec(
            multiplier=k, global_batch_size=int(8 * k), repeat=0, offset=staged.progress["samples"], num_samples=n
        )
        res = br.run_branch(
            trainer, staged, spec, marks=marks, eval_rows=rows, on_samples=lambda g, seen=seen: seen.extend(g.tolist())
        )
        ids[name] = seen
        results[name] = {
            "val": res.val_losses,
            "train": [r.loss for r in res.records],
            "steps": res.steps,
            "lr_factor": res.lr_factor,
            "tokens": res.tokens,
            "samples_after": trainer.progress.samples,
        }
    br.restore(trainer, staged)
    restored_same = _same(before, _tensors(trainer))
    expected = trainer.sampler.ids(staged.progress["samples"], n).tolist()
    trainer.close()
    return {
        "ids": ids,
        "results": results,
        "expected_ids": expected,
        "restored_same": restored_same,
        "offset": staged.progress["samples"],
        "n": n,
    }


@pytest.mark.slow
def test_branches_share_samples_and_repeat_bit_identically(tmp_path):
    out = run_ranks(branch_worker, 2, str(tmp_path / "run"))[0]
    ids, res = out["ids"], out["results"]
    assert out["offset"] == 24 and out["n"] == 16
    for name in ids:  # every branch consumed exactly the run's next 16 sample ids, in order
        assert ids[name] == out["expected_ids"], name
    assert [res[k]["steps"] for k in ("k0.5", "k1", "k2")] == [4, 2, 1]
    assert len({res[k]["tokens"] for k in res}) == 1
    # the LR rule (sqrt, relative to batch.initial = 8) applied to k
    assert [res[k]["lr_factor"] for k in ("k0.5", "k1", "k2")] == pytest.approx([np.sqrt(0.5), 1.0, np.sqrt(2.0)])
    # the same branch from the same staged state: bit-identical losses (no tolerance)
    assert res["k2"]["val"] == res["k2-again"]["val"] and np.isfinite(res["k2"]["val"]).all()
    assert res["k2"]["train"] == res["k2-again"]["train"]
    # different batches really train differently
    assert res["k0.5"]["val"] != res["k2"]["val"]
    assert all(res[k]["samples_after"] == 24 + 16 for k in res)
    assert out["restored_same"]


def scripted_growth(cfg, plan, world, shape):
    from tests.runtime.test_trainer import ScriptedPolicy

    policy = ScriptedPolicy(plan, {3: (16, 2)})
    policy.calibration = 1.0  # as the goodput controller's: the probe sets the measured c
    return policy


def probe_worker(run_dir: str) -> dict:
    """Grow wanted at step 3 → probe (k = 1, 2, 4); compare the trainer's state after the
    probe with the chosen branch re-run from the same staged state."""
    import torch

    from copus.runtime.train import branching as br
    from copus.runtime.train.trainer import Trainer

    cfg = _cfg(
        "parallel.nproc=2",
        "train.max_steps=40",
        "gns.calibration='probe'",
        "gns.probe_tokens=2048",
        "gns.probe_multipliers='1,2,4'",
    )
    trainer = Trainer(cfg, run_dir, torch.device("cpu"), policy_factory=scripted_growth)
    for _ in range(3):
        record = trainer.train_step()
    decision = trainer.decide(record)
    assert trainer.prober.due(trainer, decision)
    staged = br.stage(trainer)
    entry = trainer.prober.run(trainer, decision)
    after = {
        "tensors": _tensors(trainer),
        "progress": dict(vars_progress(trainer)),
        "gns": trainer.gns.state_dict(),
        "lr": trainer.lr.state_dict(),
        "plan": trainer.plan,
    }
    chosen_k = entry["chosen_multiplier"]
    n = entry["branch_tokens"] // 128
    spec = br.BranchSpec(
        multiplier=chosen_k,
        global_batch_size=int(8 * chosen_k),
        repeat=0,
        offset=staged.progress["samples"],
        num_samples=n,
    )
    batches = [b["global_batch_size"] for b in entry["branches"]]
    br.run_branch(trainer, staged, spec, marks=br.mark_samples(n, batches, 4), eval_rows=br.fixed_eval_rows(trainer))
    rerun = {
        "tensors": _tensors(trainer),
        "progress": dict(vars_progress(trainer)),
        "gns": trainer.gns.state_dict(),
        "lr": trainer.lr.state_dict(),
        "plan": trainer.plan,
    }
    for _ in range(2):  # the run goes on from the kept branch
        trainer.train_step()
    calibration = trainer.policy.__dict__.get("calibration")
    trainer.close()
    return {
        "entry": entry,
        "same_tensors": _same(after["tensors"], rerun["tensors"]),
        "after": {k: v for k, v in after.items() if k != "tensors"},
        "rerun": {k: v for k, v in rerun.items() if k != "tensors"},
        "staged_samples": staged.progress["samples"],
        "n": n,
        "calibration": calibration,
        "prober_c": trainer.prober.c,
    }


def vars_progress(trainer) -> dict:
    from dataclasses import asdict

    p = asdict(trainer.progress)
    p.pop("train_s")  # wall time differs between two runs of the same branch
    return p


@pytest.mark.slow
def test_probe_continues_from_the_chosen_branch_exactly_once(tmp_path):
    run = tmp_path / "run"
    out = run_ranks(probe_worker, 2, str(run))[0]
    e = out["entry"]
    assert [b["global_batch_size"] for b in e["branches"]] == [8, 16, 32]
    losses = {b["global_batch_size"]: b["smoothed_loss"] for b in e["branches"]}
    assert e["chosen_batch"] == min(losses, key=losses.get)
    # the state after the probe is the chosen branch's: model, optimizer, sampler offset, GNS, LR
    assert out["same_tensors"]
    assert out["after"] == out["rerun"]
    assert out["after"]["progress"]["samples"] == out["staged_samples"] + out["n"]
    assert e["cost_tokens"] == 2 * out["n"] * 128 and e["cost_s"] > 0
    # run accounting: metrics.jsonl steps are consecutive and samples advance by each step's batch
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    prev = 0
    for r in rows:
        assert r["samples"] == prev + r["global_batch_size"]
        prev = r["samples"]
    assert rows[-1]["samples"] == out["staged_samples"] + out["n"] + 2 * e["chosen_batch"]
    # decisions.jsonl: the probe line (when, measured, chosen, cost)
    probes = [json.loads(x) for x in (run / "decisions.jsonl").read_text().splitlines() if "probe" in json.loads(x)]
    assert len(probes) == 1 and probes[0]["probe"]["chosen_batch"] == e["chosen_batch"]
    assert probes[0]["global_batch_size"] == e["chosen_batch"]
    if out["prober_c"] is not None:  # a finite fit: the policy decides with it from now on
        assert out["calibration"] == pytest.approx(out["prober_c"]) != 1.0
    else:
        assert out["calibration"] == 1.0


# ------------------------------------------------------------------------------------ bad input


def _fake_checkpoint(run_dir: Path, step: int, model: str = "tiny", plan=None) -> None:
    """A real (verifiable) DCP checkpoint folder with a small tensor and a trainer state."""
    import torch

    from copus.runtime.state import checkpoint as ckpt

    plan = plan or {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 4, "num_microbatches": 1}
    state = {
        "plan": plan,
        "world_size": 2,
        "model": model,
        "progress": {"step": step, "samples": 8 * step, "tokens": 1024 * step},
    }
    ckpt.save(run_dir / "checkpoints", step, {"model": {"w": torch.zeros(2)}}, state)


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.toml").write_text('[model]\nname = "tiny"\n[parallel]\nnproc = 2\n')
    return d


@pytest.fixture(autouse=True)
def _no_launch(monkeypatch, request):
    """In the refusal tests a worker start is a failure: the input must be rejected up front."""
    if "refuses" in request.node.name:
        from copus.runtime.train import launch

        def refuse(*_a, **_k):
            raise AssertionError("a worker was about to start")

        monkeypatch.setattr(launch, "launch", refuse)


def _calibrate(capsys, *args) -> tuple[int, str]:
    from copus.cli import main

    rc = main(["calibrate", *map(str, args)])
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize(
    "args, needle",
    [
        ((), "no valid checkpoint"),
        (("--tokens", "0"), "--tokens=0"),
    ],
)
def test_calibrate_refuses_without_checkpoints_or_tokens(run_dir, capsys, args, needle):
    rc, err = _calibrate(capsys, run_dir, *args)
    assert rc == 2 and needle in err and len(err.splitlines()) == 1
    assert not (run_dir / "calibration").exists()


@pytest.mark.parametrize(
    "multipliers, needle",
    [
        ("0,1,2", "not allowed"),
        ("-1,1", "not allowed"),
        ("1,abc", "comma-separated numbers"),
        ("0.1,1", "positive integer"),  # 0.8 samples
        ("0.375,1", "multiple of dp=2"),  # 3 samples on 2 ranks
    ],
)
def test_calibrate_refuses_bad_multipliers(run_dir, capsys, multipliers, needle):
    _fake_checkpoint(run_dir, 10)
    rc, err = _calibrate(capsys, run_dir, f"--multipliers={multipliers}")
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, err
    assert not (run_dir / "calibration").exists()


def test_calibrate_refuses_other_model_and_missing_step(run_dir, capsys):
    _fake_checkpoint(run_dir, 10, model="small")
    rc, err = _calibrate(capsys, run_dir)
    assert rc == 2 and "model 'small'" in err and "'tiny'" in err
    _fake_checkpoint(run_dir, 20)
    rc, err = _calibrate(capsys, run_dir, "--steps", "20,30")
    assert rc == 2 and "step 30" in err and "10, 20" in err
    assert not (run_dir / "calibration").exists()
