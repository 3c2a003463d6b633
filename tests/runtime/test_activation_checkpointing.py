"""Activation checkpointing modes: exact activation bytes kept per mode, equal losses and grads.

Single process, plain model (`apply_ac` only). Bytes from `runtime/engine/activation_memory.py`:
`saved_bytes` (saved_tensors_hooks) and `live_bytes` (storages created by the forward and alive
after it). Without checkpointing they agree; with full AC too (the checkpoint saves its inputs
through autograd); with selective AC the extra live bytes are exactly the kept matmul and
attention outputs, by formula.
"""

import pytest
import torch
import torch.nn.functional as F

from copus.core.specs.models import ModelShape
from copus.runtime.engine.activation_memory import measure_activation_bytes
from copus.runtime.engine.model import build_model, materialize
from copus.runtime.engine.parallelize import AC_MODES, ac_mode, apply_ac

SHAPE = ModelShape(name="t", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, seq_len=16)
ROWS = 3


def _run(mode: str) -> dict:
    model = materialize(build_model(SHAPE, "cpu"), "cpu", 0)
    apply_ac(model, mode)
    tokens = torch.randint(0, SHAPE.vocab_size, (ROWS, SHAPE.seq_len + 1), generator=torch.Generator().manual_seed(0))
    logits, nbytes = measure_activation_bytes(model, lambda: model(tokens[:, :-1]), (tokens,))
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return {"bytes": nbytes, "loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def runs():
    return {mode: _run(mode) for mode in AC_MODES}


def test_losses_and_gradients_equal_across_modes(runs):
    base = runs["none"]
    for mode in ("selective", "full"):
        assert runs[mode]["loss"] == base["loss"]
        for name, g in base["grads"].items():
            assert torch.allclose(runs[mode]["grads"][name], g, rtol=1e-6, atol=1e-7), (mode, name)


def test_bytes_exact_per_mode(runs):
    none, full, sel = (runs[m]["bytes"] for m in ("none", "full", "selective"))
    # no checkpoint: every kept activation is an autograd-saved tensor
    assert none.live_bytes == none.saved_bytes > 0
    # full: the checkpoint keeps only block inputs, saved through autograd as well
    assert full.live_bytes == full.saved_bytes
    # selective keeps, per block, on top of full's: outputs of wq, wv, w1, w2 (every other mm)
    # and of SDPA (attention output + fp32 log-sum-exp); 4 bytes per fp32 element
    s = SHAPE
    tokens = ROWS * s.seq_len
    per_block = (
        tokens
        * (s.n_heads * s.head_dim + s.n_kv_heads * s.head_dim + s.ffn_dim + s.dim + s.n_heads * s.head_dim + s.n_heads)
        * 4
    )
    assert sel.live_bytes - full.live_bytes == s.n_layers * per_block
    assert sel.saved_bytes == full.saved_bytes  # the SAC cache is not autograd-saved
    assert full.live_bytes < sel.live_bytes < 0.6 * none.live_bytes


def test_mode_names_and_booleans():
    assert (ac_mode(True), ac_mode(False), ac_mode("selective")) == ("full", "none", "selective")
    with pytest.raises(ValueError, match="activation_checkpointing='partial' is invalid"):
        ac_mode("partial")
