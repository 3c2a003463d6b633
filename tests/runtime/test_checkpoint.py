"""Checkpoint atomicity, corruption detection, retention and RNG round trip (single process)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from copus.runtime.state import checkpoint as ckpt


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": msd, "optim": osd}


def _save(root, step, seed=0, keep=0):
    model, opt = _model_and_opt(seed)
    return ckpt.save(root, step, _state(model, opt), {"step": step, "seed": seed}, keep=keep), model


def test_save_then_load_roundtrip(tmp_path):
    path, model = _save(tmp_path, 3, seed=1)
    assert path.name == "step-3" and ckpt.verify(path) is None
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    assert ckpt.TRAINER_STATE in manifest["files"] and ".metadata" in manifest["files"]
    fresh, fresh_opt = _model_and_opt(seed=99)
    state = _state(fresh, fresh_opt)
    trainer_state = ckpt.load(path, state)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        fresh,
        fresh_opt,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(flatten_optimizer_state_dict=True),
    )
    assert trainer_state == {"step": 3, "seed": 1}
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_exception_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def boom(folder, step, known=None):
        raise OSError("simulated crash while writing the manifest")

    monkeypatch.setattr(ckpt, "write_manifest", boom)  # read by checkpoint.finalize
    with pytest.raises(ckpt.CheckpointError, match="step-2 not saved .OSError: simulated crash"):
        _save(tmp_path, 2)
    assert not (tmp_path / "tmp-step-2").exists()  # the half-written one was removed
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-1"
    monkeypatch.undo()
    (tmp_path / "tmp-step-2").mkdir()  # as a kill mid-save would leave it
    _save(tmp_path, 3)  # the next save removes the stale tmp
    assert not (tmp_path / "tmp-step-2").exists()
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-3"


def test_crash_before_manifest_is_not_loadable(tmp_path):
    path, _ = _save(tmp_path, 5)
    (path / ckpt.MANIFEST).unlink()  # as if killed between the rename of files and the manifest
    assert "missing" in ckpt.verify(path)
    assert ckpt.find_latest(tmp_path) is None


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_file_detected_and_previous_used(tmp_path, damage):
    _save(tmp_path, 10)
    bad, _ = _save(tmp_path, 20)
    data_file = next(p for p in bad.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    if damage == "truncate":
        data_file.write_bytes(raw[: len(raw) // 2])
    else:
        raw[len(raw) // 2] ^= 0xFF
        data_file.write_bytes(raw)
    messages: list[str] = []
    assert ckpt.find_latest(tmp_path, log=messages.append) == tmp_path / "step-10"
    assert len(messages) == 1 and data_file.name in messages[0] and "step-10" in messages[0]
    with pytest.raises(ckpt.CheckpointError, match=data_file.name):
        ckpt.load(bad, _state(*_model_and_opt(0)))


def test_retention_keeps_newest(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert [s for s, _ in ckpt.step_dirs(tmp_path)] == [4, 3]


def test_rng_state_roundtrip_is_json():
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    state = json.loads(json.dumps(ckpt.rng_state()))
    expect = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5)
    np.random.rand(5)
    random.random()
    ckpt.set_rng_state(state)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expect[0], got[0]) and np.array_equal(expect[1], got[1])
    assert expect[2] == got[2]


def test_background_saves_reuse_the_staged_host_tensors_until_the_structure_changes(tmp_path):
    """The second background save copies into the first one's staged tensors (one allocation)
    and still holds its own values; another structure (a layout switch) is staged afresh."""
    from copus.runtime.state.async_checkpoint import AsyncCheckpointer

    saver = AsyncCheckpointer()
    model, opt = _model_and_opt(0)
    try:
        saver.save(tmp_path, 1, _state(model, opt), {"step": 1})
        saver.wait()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # new values, same structure
        saver.save(tmp_path, 2, _state(model, opt), {"step": 2})
        saver.wait()
        assert saver.staging.allocations == 1
        other, other_opt = _model_and_opt(1)
        other[0] = torch.nn.Linear(8, 16, bias=False)  # another structure
        saver.save(tmp_path, 3, {"model": other.state_dict()}, {"step": 3})
        saver.wait()
        assert saver.staging.allocations == 2
    finally:
        saver.close()
    for step in (1, 2, 3):
        assert ckpt.verify(tmp_path / f"step-{step}") is None
    loaded, _ = _model_and_opt(5)
    fresh = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    loaded(torch.randn(3, 8)).sum().backward()
    fresh.step()
    ckpt.load(tmp_path / "step-2", state := _state(loaded, fresh))
    for name, value in model.state_dict().items():
        assert torch.equal(state["model"][name], value), name
