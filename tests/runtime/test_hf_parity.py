"""Hugging Face config fields, with transformers as the reference: a tiny random transformers
model (built locally, no download) saved with save_pretrained, read into copus by config.json +
safetensors → the same logits. Each field also shows it matters: copus with the field dropped
disagrees (or cannot even load the weights)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from copus.core.specs.hf_config import load_shape
from copus.runtime.engine.model import build_model
from copus.runtime.state.hf_import import load_hf_weights

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SEQ = 48
BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=SEQ,
    rms_norm_eps=1e-6,
    initializer_range=0.3,
)  # a wide init: peaked attention, so positions (RoPE) matter
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}
CASES = {
    "head_dim": ("LlamaConfig", dict(head_dim=24)),
    "rope_scaling_llama3": ("LlamaConfig", dict(rope_parameters=LLAMA3)),
    "attention_bias": ("LlamaConfig", dict(attention_bias=True)),
    "qwen2_qkv_bias": ("Qwen2Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "tie_word_embeddings": ("LlamaConfig", dict(tie_word_embeddings=True)),
}
# what copus would build if it ignored the field
DROPPED = {
    "head_dim": dict(explicit_head_dim=None),
    "rope_scaling_llama3": dict(rope_scaling=None),
    "attention_bias": dict(qkv_bias=False, o_bias=False),
    "qwen2_qkv_bias": dict(qkv_bias=False),
    "tie_word_embeddings": dict(tie_embeddings=False),
}


def _hf_folder(tmp_path, case: str):
    cls, extra = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**BASE, **extra)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # transformers zero-inits biases and ones norms
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / case)
    return tmp_path / case, hf


def _copus(folder, **change):
    shape = dataclasses.replace(load_shape(folder / "config.json", seq_len=SEQ), **change)
    model = build_model(shape, "cpu").eval()
    load_hf_weights(model, folder)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_field_gives_transformers_logits(tmp_path, case):
    folder, hf = _hf_folder(tmp_path, case)
    shape = load_shape(folder / "config.json", seq_len=SEQ)
    assert sum(p.numel() for p in hf.parameters()) == shape.num_params()
    tokens = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model = _copus(folder)
    with torch.no_grad():
        ref, ours = hf(tokens).logits, model(tokens)
    assert torch.allclose(ours, ref, atol=2e-4, rtol=0), (ours - ref).abs().max()
    try:
        dropped = _copus(folder, **DROPPED[case])
    except (ValueError, RuntimeError):
        return  # the weights do not even fit without the field
    with torch.no_grad():
        assert (dropped(tokens) - ref).abs().max() > 1e-2


def test_shape_fields_are_read(tmp_path):
    folder, _ = _hf_folder(tmp_path, "rope_scaling_llama3")
    s = load_shape(folder / "config.json")
    assert s.rope_theta == 500000.0 and s.rope_scaling.factor == 8.0
    assert s.rope_scaling.original_max_position_embeddings == 16
    folder, _ = _hf_folder(tmp_path, "head_dim")
    assert load_shape(folder / "config.json").head_dim == 24
    folder, _ = _hf_folder(tmp_path, "qwen2_qkv_bias")
    s = load_shape(folder / "config.json")
    assert (s.qkv_bias, s.o_bias, s.rope_theta) == (True, False, 1e6)
