"""Nothing a run reads can execute code: checkpoints (DCP metadata, non-tensor items, trainer
state), config files and --set values, and the token cache.

An attacker who can write a checkpoint folder can also rewrite its manifest, so every attack here
comes with a correct manifest: checksums detect accidents, the safe loader stops malice.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from copus.runtime.state import checkpoint as ckpt

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Payload:
    """Unpickling this runs `touch <marker>` (what an attacker would put in a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt, options=OPTIONS)
    return {"model": msd, "optim": osd}


def _checkpoint(root: Path, step: int = 1) -> Path:
    model, opt = _model_opt()
    return ckpt.save(root, step, _state(model, opt), {"step": step})


def _reseal(path: Path, step: int) -> None:
    """Rewrite the manifest so checksums match the tampered files (as an attacker could)."""
    ckpt.write_manifest(path, step)
    assert ckpt.verify(path) is None or "metadata" in ckpt.verify(path)


def test_safe_loader_restores_optimizer_hyperparameters(tmp_path):
    """The safe loader still reads the non-tensor items DCP stores (param-group lr, betas)."""
    path = _checkpoint(tmp_path)
    model, opt = _model_opt(seed=1)
    opt.param_groups[0]["lr"], opt.param_groups[0]["betas"] = 0.5, (0.1, 0.2)
    state = _state(model, opt)
    ckpt.load(path, state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)
    assert tuple(opt.param_groups[0]["betas"]) == (0.8, 0.9)
    ref, _ = _model_opt()
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_malicious_dcp_metadata_is_not_executed(tmp_path):
    path = _checkpoint(tmp_path / "ck", 1)
    marker = tmp_path / "PWNED"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _reseal(path, 1)
    problem = ckpt.verify(path)
    assert problem is not None and ".metadata" in problem
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata"):
        ckpt.load(path, _state(*_model_opt()))
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata"):
        ckpt.load(path, _state(*_model_opt()), check=False)  # the loader itself refuses too
    assert not marker.exists()


def test_malicious_metadata_falls_back_to_previous_checkpoint(tmp_path):
    _checkpoint(tmp_path, 1)
    bad = _checkpoint(tmp_path, 2)
    marker = tmp_path / "PWNED"
    (bad / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _reseal(bad, 2)
    messages: list[str] = []
    assert ckpt.find_latest(tmp_path, log=messages.append) == tmp_path / "step-1"
    assert any(".metadata" in m and "step-1" in m for m in messages), messages
    assert not marker.exists()


def test_malicious_non_tensor_item_is_not_executed(tmp_path):
    """DCP writes non-tensor values with torch.save and its default planner reads them back with
    `torch.load(weights_only=False)`: a checkpoint must not be able to smuggle an object in."""
    marker = tmp_path / "PWNED"
    model, opt = _model_opt()
    state = {**_state(model, opt), "extra": {"note": Payload(marker)}}
    path = ckpt.save(tmp_path / "ck", 1, state, {"step": 1})
    assert not marker.exists()
    target = {**_state(*_model_opt()), "extra": {"note": "placeholder"}}
    with pytest.raises(ckpt.CheckpointError, match="step-1"):
        ckpt.load(path, target)
    assert not marker.exists()


def test_trainer_state_is_plain_json(tmp_path):
    path = _checkpoint(tmp_path)
    raw = (path / ckpt.TRAINER_STATE).read_text()
    assert raw.lstrip().startswith("{")
    (path / ckpt.TRAINER_STATE).write_text('{"step": 1, "__reduce__": "os.system"}')
    _reseal(path, 1)
    state = ckpt.load(path, _state(*_model_opt()))
    assert state == {"step": 1, "__reduce__": "os.system"}  # data, never code


def test_config_module_cannot_run_code():
    """Configs are TOML parsed by tomllib; nothing in the config path evaluates text."""
    import copus.commands.train as train_cmd
    import copus.config as config

    for module in (config, train_cmd):
        source = Path(module.__file__).read_text()
        for banned in (
            "eval(",
            "exec(",
            "pickle",
            "yaml",
            "import_module",
            "__import__",
            "runpy",
            "subprocess",
            "os.system",
        ):
            assert banned not in source, (module.__name__, banned)


def test_set_values_are_data(tmp_path, monkeypatch):
    from copus.config import load_config

    monkeypatch.chdir(tmp_path)
    for text in ("__import__('os').system('touch PWNED')", "$(touch PWNED)", "`touch PWNED`"):
        with pytest.raises(ValueError, match="allowed"):
            load_config(None, [f"batch.policy={text}"])
        cfg = load_config(None, [f"data.source={text}"])  # a string, used as a path
        assert cfg.data.source == text
    assert not (tmp_path / "PWNED").exists()


def test_pickled_token_cache_is_ignored(tmp_path):
    """The BPE token cache is read with allow_pickle=False; a poisoned entry is re-encoded."""
    from copus.runtime.data.stream import encode_cached

    class FakeBpe:
        kind, name = "bpe", "fake"

        def encode(self, text: str) -> np.ndarray:
            return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)

    text = "hello world"
    tokens = encode_cached(FakeBpe(), text, cache_dir=tmp_path)
    (cache_file,) = tmp_path.glob("fake-tokens-*.npy")
    marker = tmp_path / "PWNED"
    np.save(cache_file, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    again = encode_cached(FakeBpe(), text, cache_dir=tmp_path)
    assert np.array_equal(tokens, again) and not marker.exists()
