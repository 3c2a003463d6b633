"""Training from a prepared folder (2 processes, gloo): exactly-once samples across a batch change
and a dp change on resume, a BPE tokenizer on the CPU `tiny` model (its vocabulary follows the
tokenizer), and `copus export` of a dp2 and a pp2 checkpoint checked against transformers'
LlamaForCausalLM on the same tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from copus.config import load_config
from copus.core.specs.resolve import get_model_shape
from copus.runtime.data.stream import load_text
from copus.runtime.data.prepare import prepare
from tests.runtime.test_trainer import recording_worker

BASE = [
    "eval.interval_steps=0",
    "log.progress=false",
    "log.tensorboard=false",
    "batch.initial=8",
    "batch.min=4",
    "checkpoint.keep=5",
    "train.lr_schedule=constant",
    "train.warmup_tokens=2048",
]
LOGIT_ATOL = 1e-4  # fp32; the two models reduce in a different order (measured ~1e-6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The first 300k characters of the embedded corpus, BPE 300 tokens, 2% held out."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "corpus.txt").write_text(load_text("embedded", 300_000))
    prepare(
        [str(root / "corpus.txt")],
        root / "p",
        tokenizer="bpe:300",
        val_fraction=0.02,
        progress=False,
        log=lambda _: None,
    )
    return root / "p"


def _cfg(folder: Path, *overrides: str):
    return load_config(None, [*BASE, f"data.source='{folder}'", *overrides])


def _launch(cfg, run_dir, resume=False, entry=None):
    from copus.runtime.train.launch import launch

    result = launch(cfg, str(run_dir), resume=resume, max_restarts=0, entry=entry)
    assert not result.get("error"), result
    return result


def _check_export(run_dir: Path, step: int, out: Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Export step-N; transformers' logits equal copus's model with the same weights."""
    transformers = pytest.importorskip("transformers")
    from copus.runtime.state.export import export, find_checkpoint, load_full_model_state
    from copus.runtime.engine.model import build_model, materialize

    export(run_dir, out, step=step, max_shard_bytes=max_shard_bytes)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 320 and (out / "tokenizer.json").is_file()
    sd = load_full_model_state(find_checkpoint(run_dir, step))
    shape = dataclasses.replace(get_model_shape("tiny"), vocab_size=320)
    ours = materialize(build_model(shape, "meta"), "cpu", seed=123)
    ours.load_state_dict(sd)
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours.eval()(tokens), hf(tokens).logits
    assert a.abs().max() > 0.1  # trained weights, not zeros
    assert torch.allclose(a, b, atol=LOGIT_ATOL, rtol=0), (a - b).abs().max()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    assert tok.decode(tok("to be or not")["input_ids"]) == "to be or not"


@pytest.mark.slow
def test_prepared_folder_exactly_once_across_batch_and_dp_changes_and_dp2_export(folder, tmp_path):
    """B 8 → 16 (step 2) → 24 mb3 (step 4) at dp2, resume at dp1: the consumed ids are the
    Feistel stream, each once; the dp2 checkpoint exports to a model transformers agrees with."""
    from copus.runtime.data.sampler import FeistelSampler
    from copus.runtime.data.shards import open_split

    run = tmp_path / "run"
    _launch(
        _cfg(folder, "parallel.nproc=2", "train.max_steps=5", "checkpoint.interval_steps=0"),
        run,
        entry=recording_worker,
    )
    _launch(
        _cfg(folder, "parallel.nproc=1", "train.max_steps=7", "checkpoint.interval_steps=0"),
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
    assert [len(by_step[s]["global"]) for s in range(1, 8)] == [8, 8, 16, 16, 24, 24, 24]
    for entry in by_step.values():
        assert sorted(i for loc in entry["locals"] for i in loc) == sorted(entry["global"])
    consumed = [i for s in range(1, 8) for i in by_step[s]["global"]]
    n = len(open_split(folder, "train", 128))
    assert consumed == FeistelSampler(n, 0).ids(0, len(consumed)).tolist()
    assert len(set(consumed)) == len(consumed)
    state = json.loads((run / "checkpoints" / "step-5" / "trainer_state.json").read_text())
    assert state["plan"]["dp"] == 2 and state["tokenizer"]["model_vocab_size"] == 320
    _check_export(run, 5, tmp_path / "hf-dp2")


@pytest.mark.slow
def test_pp2_checkpoint_exports_to_the_same_logits(folder, tmp_path):
    """pp2 (two stages, each saving its layers) → sharded safetensors → the same logits."""
    run = tmp_path / "run"
    _launch(
        _cfg(
            folder,
            "parallel.nproc=2",
            "parallel.pp=2",
            "parallel.dp=1",
            "batch.policy='constant'",
            "train.max_steps=2",
            "checkpoint.interval_steps=0",
        ),
        run,
    )
    state = json.loads((run / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["plan"]["pp"] == 2
    _check_export(run, 2, tmp_path / "hf-pp2", max_shard_bytes=1_000_000)  # ~8 shards
    index = json.loads((tmp_path / "hf-pp2" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 4
    assert np.isfinite([json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]).all()
