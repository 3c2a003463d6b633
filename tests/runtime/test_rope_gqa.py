"""Attention's numerics under FSDP2 mixed precision: the RoPE table stays fp32 inside every
block, and grouped-query attention through SDPA's `enable_gqa` equals the repeated-K/V path."""

import pytest
import torch
import torch.nn.functional as F

from copus.core.specs.models import ModelShape
from copus.runtime.engine.model import apply_rope, build_model, materialize, rope_cache
from tests.runtime._workers import run_ranks

SHAPE = ModelShape(name="t", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, seq_len=16)
SHAPE_MHA = ModelShape(name="t", n_layers=1, dim=32, n_heads=4, n_kv_heads=4, ffn_dim=64, vocab_size=50, seq_len=16)


def _rope_dtypes_under_bf16() -> dict:
    """One rank: FSDP2 bf16 (MixedPrecisionPolicy, cast_forward_inputs=True), record the dtype
    of every table `apply_rope` receives in the model's forward; then the old wiring (the table
    passed as a block input) for contrast."""
    from torch.distributed.device_mesh import init_device_mesh

    from copus.runtime.engine import model as model_mod
    from copus.runtime.engine.parallelize import parallelize

    seen: list[torch.dtype] = []
    inner = model_mod.apply_rope

    def spy(x, cache):
        seen.append(cache.dtype)
        return inner(x, cache)

    model_mod.apply_rope = spy
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = parallelize(build_model(SHAPE, "meta"), mesh, dtype="bf16")
    materialize(model, "cpu", seed=0)
    tokens = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.seq_len))
    model(tokens).float().sum().backward()
    in_model = list(seen)
    param_dtype = model.layers["0"].attention.wq.weight.dtype  # after forward: resharded fp32
    seen.clear()
    h = torch.randn(2, SHAPE.seq_len, SHAPE.dim)
    model.layers["0"](h, model.rope)  # the table as a forward input: FSDP casts it
    as_input = list(seen)
    shared = all(b.attention.rope is model.rope for b in model.layers.values())
    model_mod.apply_rope = inner
    return {
        "in_model": [str(d) for d in in_model],
        "as_input": [str(d) for d in as_input],
        "buffer": str(model.rope.dtype),
        "shared": shared,
        "param_dtype": str(param_dtype),
    }


def test_rope_table_stays_fp32_in_every_block_under_fsdp2_bf16():
    """Under bf16 mixed precision every call of `apply_rope` in the model's forward (and the
    non-reentrant recompute, if any) gets the fp32 table; the same block given the table as a
    forward input gets bf16 (what the model did before), so the check can fail."""
    (res,) = run_ranks(_rope_dtypes_under_bf16, 1, timeout=300)
    assert res["buffer"] == "torch.float32" and res["shared"]
    assert len(res["in_model"]) == 2 * SHAPE.n_layers  # q and k of each block
    assert set(res["in_model"]) == {"torch.float32"}
    assert set(res["as_input"]) == {"torch.bfloat16"}


def test_rope_buffer_shared_by_blocks_after_materialize():
    m = materialize(build_model(SHAPE), "cpu", seed=0)
    assert all(b.attention.rope is m.rope for b in m.layers.values())
    assert torch.equal(m.rope, rope_cache(SHAPE.head_dim, SHAPE.seq_len, SHAPE.rope_theta))
    assert not any("rope" in k for k in m.state_dict())


def _repeat_kv_attention(attn, x, rope):
    """The former path: K and V repeated to n_heads with `repeat_interleave`, then SDPA."""
    b, s = x.shape[0], x.shape[1]
    q = attn.wq(x).view(b, s, -1, attn.head_dim)
    k = attn.wk(x).view(b, s, -1, attn.head_dim)
    v = attn.wv(x).view(b, s, -1, attn.head_dim)
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return attn.wo(y.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [SHAPE, SHAPE_MHA], ids=["gqa", "mha"])
def test_enable_gqa_equals_repeat_interleave(shape, dtype):
    """Forward output and every gradient of `enable_gqa=True` equal the repeat_interleave path
    (fp32: 1e-6; bf16: the same kernel order, so within bf16 rounding)."""
    m = materialize(build_model(shape), "cpu", seed=0).to(dtype)
    attn = m.layers["0"].attention
    x = torch.randn(3, shape.seq_len, shape.dim, dtype=dtype, requires_grad=True)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    outs, grads = [], []
    for fn in (lambda: attn(x), lambda: _repeat_kv_attention(attn, x, m.rope)):
        attn.zero_grad()
        x.grad = None
        y = fn()
        y.float().pow(2).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad.clone()] + [p.grad.clone() for p in attn.parameters()])
    torch.testing.assert_close(outs[0], outs[1], **tol)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, **tol)


def test_gqa_attention_keeps_no_repeated_kv_copy():
    """The backward keeps K and V at n_kv heads: no saved tensor has n_heads·head_dim columns
    from a repeat (the repeat_interleave path saved two such copies per block)."""
    m = materialize(build_model(SHAPE), "cpu", seed=0)
    attn = m.layers["0"].attention
    x = torch.randn(2, SHAPE.seq_len, SHAPE.dim, requires_grad=True)

    def saved_bytes(fn) -> int:
        seen: dict = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(seen.values())

    gqa = saved_bytes(lambda: attn(x))
    rep = saved_bytes(lambda: _repeat_kv_attention(attn, x, m.rope))
    # the repeated path keeps K and V at n_heads: (n_heads − n_kv) extra heads of each, fp32
    extra = 2 * x.shape[0] * SHAPE.seq_len * (SHAPE.n_heads - SHAPE.n_kv_heads) * SHAPE.head_dim * 4
    assert rep - gqa >= extra
