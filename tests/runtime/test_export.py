"""copus export in one process: a tied-embedding GQA shape with rope_theta 500000 (as Llama 3.2)
→ transformers gives the same logits; the RoPE permutation is what makes them agree."""

from __future__ import annotations

import json

import pytest
import torch

from copus.core.specs.models import ModelShape
from copus.runtime.state import checkpoint as ckpt
from copus.runtime.state import export as export_mod
from copus.runtime.state import hf_weights
from copus.runtime.engine.model import build_model, materialize

TIED = ModelShape(
    name="tied-test",
    n_layers=2,
    dim=64,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=96,
    vocab_size=128,
    seq_len=32,
    tie_embeddings=True,
    rope_theta=500000.0,
    norm_eps=1e-6,
)


def test_tied_gqa_export_matches_transformers(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    model = materialize(build_model(TIED, "meta"), "cpu", seed=3)
    with torch.no_grad():  # non-trivial norms: eps and weights both matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if name.endswith(("wq.weight", "wk.weight")):
                p.mul_(10.0)  # peaked attention: positions (RoPE) matter
    ckpt.save(tmp_path / "run" / "checkpoints", 7, {"model": model.state_dict()}, {"model": TIED.name})
    monkeypatch.setattr(export_mod, "get_model_shape", lambda name, seq_len=None: TIED)
    out = tmp_path / "hf"
    export_mod.export(tmp_path / "run", out)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["rms_norm_eps"] == 1e-6
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.config.num_key_value_heads == 2
    tokens = torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model.eval()(tokens), hf(tokens).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=0), (a - b).abs().max()
    # without the wq/wk permutation the two models disagree: the mapping is not a no-op
    monkeypatch.setattr(hf_weights, "permute_rope", lambda w, head_dim: w)
    export_mod.export(tmp_path / "run", tmp_path / "hf-unpermuted")
    bad = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf-unpermuted").eval()
    with torch.no_grad():
        assert (bad(tokens).logits - a).abs().max() > 1e-2  # measured ~0.1


def _save_run(tmp_path, model, shape, monkeypatch, tokenizer_json: str | None = None):
    run = tmp_path / "run"
    ckpt.save(run / "checkpoints", 3, {"model": model.state_dict()}, {"model": shape.name})
    if tokenizer_json is not None:
        (run / "tokenizer.json").write_text(tokenizer_json)
    monkeypatch.setattr(export_mod, "get_model_shape", lambda name, seq_len=None: shape)
    return run


def _peaked(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if name.endswith(".bias"):
                p.normal_(0, 0.3)
            if name.endswith(("wq.weight", "wk.weight")):
                p.mul_(10.0)
    return model


@pytest.mark.parametrize("kind", ["llama-bias-head_dim-llama3", "qwen2"])
def test_fields_survive_export_in_bfloat16_sharded(tmp_path, monkeypatch, kind):
    """head_dim, biases and llama3 RoPE scaling exported in bf16 across several safetensors
    files: transformers (Auto classes) gives copus's logits for the same bf16-rounded weights."""
    transformers = pytest.importorskip("transformers")
    from copus.core.specs.models import RopeScaling

    extra = (
        dict(
            explicit_head_dim=24,
            qkv_bias=True,
            o_bias=True,
            rope_scaling=RopeScaling(
                factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8
            ),
        )
        if kind != "qwen2"
        else dict(qkv_bias=True, explicit_head_dim=8)
    )
    shape = ModelShape(
        name=kind,
        n_layers=2,
        dim=64,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        vocab_size=128,
        seq_len=32,
        rope_theta=10000.0,
        **extra,
    )
    model = _peaked(materialize(build_model(shape, "meta"), "cpu", seed=5))
    run = _save_run(tmp_path, model, shape, monkeypatch)
    out = tmp_path / "hf"
    export_mod.export(run, out, dtype="bfloat16", max_shard_bytes=20_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 3
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert sum(p.numel() for p in hf.parameters()) == shape.num_params()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())  # the weights the folder holds
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = model.eval()(tokens), hf(tokens).logits
    assert torch.allclose(a, b, atol=2e-4, rtol=0), (a - b).abs().max()


def test_dtype_halves_the_weights_and_bad_dtype_is_one_line(tmp_path, monkeypatch):
    model = materialize(build_model(TIED, "meta"), "cpu", seed=3)
    run = _save_run(tmp_path, model, TIED, monkeypatch)
    sizes = {}
    for dtype in ("float32", "bfloat16", "float16"):
        export_mod.export(run, tmp_path / dtype, dtype=dtype)
        sizes[dtype] = (tmp_path / dtype / "model.safetensors").stat().st_size
        from safetensors import safe_open

        with safe_open(str(tmp_path / dtype / "model.safetensors"), framework="pt") as fh:
            t = fh.get_tensor("model.embed_tokens.weight")
        assert t.dtype == getattr(torch, dtype)
        assert torch.equal(t, model.tok_embeddings.weight.detach().to(t.dtype))
    assert max(sizes["bfloat16"], sizes["float16"]) < 0.51 * sizes["float32"]
    from copus.cli import main

    assert main(["export", str(run), "--out", str(tmp_path / "x"), "--dtype", "fp8"]) == 2
    assert not (tmp_path / "x").exists()


def test_byte_model_gets_a_byte_level_tokenizer_and_generation_config(tmp_path, monkeypatch):
    """A byte model's folder loads in transformers with a tokenizer whose ids are the UTF-8 bytes
    (copus's ByteCodec), and a generation_config.json GenerationConfig reads."""
    transformers = pytest.importorskip("transformers")
    from copus.runtime.data.tokenizer import ByteCodec

    shape = ModelShape(
        name="bytes", n_layers=1, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=256, seq_len=16
    )
    model = materialize(build_model(shape, "meta"), "cpu", seed=1)
    run = _save_run(tmp_path, model, shape, monkeypatch)
    out = tmp_path / "hf"
    export_mod.export(run, out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "Hé, wörld!\n\tend"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ByteCodec().encode(text).tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text and len(tok) == 256
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert gen.max_length == 16 and gen.eos_token_id is None


def test_export_reads_the_dcp_metadata_once(tmp_path, monkeypatch):
    """Every tensor's load reuses the metadata read at the start: `.metadata` is opened a fixed
    number of times (the verification hashes and unpickles it, the export reads it once), not
    once per tensor (20 here: 23 opens before); the exported weights are the checkpoint's."""
    from pathlib import Path

    model = materialize(build_model(TIED, "meta"), "cpu", seed=3)
    run = _save_run(tmp_path, model, TIED, monkeypatch)
    opened: list[str] = []
    real_open = open

    def counting_open(file, *args, **kwargs):
        if Path(file).name == ".metadata":
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    export_mod.export(run, tmp_path / "hf")
    monkeypatch.setattr("builtins.open", real_open)
    tensors = len(hf_weights.copus_names(TIED))
    assert tensors == 20 and len(opened) == 3, opened
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as fh:
        assert torch.equal(fh.get_tensor("model.norm.weight"), model.norm.weight.detach())
