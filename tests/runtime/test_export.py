"""copus export in one process: a tied-embedding GQA shape with rope_theta 500000 (as Llama 3.2)
→ transformers gives the same logits; the RoPE permutation is what makes them agree."""

from __future__ import annotations

import json

import pytest
import torch

from copus.core.specs.models import ModelShape
from copus.runtime.state import checkpoint as ckpt
from copus.runtime.state import export as export_mod
from copus.runtime.engine.model import build_model, materialize

TIED = ModelShape(name="tied-test", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96,
                  vocab_size=128, seq_len=32, tie_embeddings=True, rope_theta=500000.0,
                  norm_eps=1e-6)


def test_tied_gqa_export_matches_transformers(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    model = materialize(build_model(TIED, "meta"), "cpu", seed=3)
    with torch.no_grad():                      # non-trivial norms: eps and weights both matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if name.endswith(("wq.weight", "wk.weight")):
                p.mul_(10.0)                   # peaked attention: positions (RoPE) matter
    ckpt.save(tmp_path / "run" / "checkpoints", 7, {"model": model.state_dict()},
              {"model": TIED.name})
    monkeypatch.setattr(export_mod, "get_model_shape", lambda name: TIED)
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
    monkeypatch.setattr(export_mod, "_permute_rope", lambda w, head_dim: w)
    export_mod.export(tmp_path / "run", tmp_path / "hf-unpermuted")
    bad = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf-unpermuted").eval()
    with torch.no_grad():
        assert (bad(tokens).logits - a).abs().max() > 1e-2   # measured ~0.1
