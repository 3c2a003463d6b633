"""Interleaved 1F1B in the runtime (issue 25): 2 gloo ranks × 2 chunks each of the 4-block tiny
model give the single-process losses and gradients (mean over micro-batches)."""

import pytest

from tests.runtime._workers import run_ranks

torch = pytest.importorskip("torch")


def _interleaved(num_microbatches: int):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.engine.model import build_model
    from copus.runtime.engine.pipeline import Pipeline, split_chunks

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    shape = get_model_shape("tiny")
    torch.manual_seed(0)
    model = build_model(shape, "cpu")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape.vocab_size, (num_microbatches, shape.seq_len + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # reference: the whole model, one micro-batch at a time, loss mean over micro-batches
    ref_losses = []
    for i in range(num_microbatches):
        loss = loss_fn(model(inputs[i : i + 1]), targets[i : i + 1])
        (loss / num_microbatches).backward()
        ref_losses.append(float(loss))
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    chunks = split_chunks(model, mesh.get_local_rank(), 2, 2)
    for c in chunks:
        c.zero_grad(set_to_none=True)
    pipe = Pipeline(chunks, mesh["pp"], torch.device("cpu"), "interleaved-1f1b", loss_fn)
    losses = pipe.run(inputs, targets, num_microbatches)
    grads = {n: p.grad for c in chunks for n, p in c.named_parameters()}
    err = max(float((grads[n] - ref_grads[n]).abs().max() / (ref_grads[n].abs().max() + 1e-12)) for n in grads)
    return {
        "stage_ids": pipe.stage_ids,
        "first": pipe.is_first,
        "last": pipe.is_last,
        "losses": [float(x) for x in losses],
        "ref_losses": ref_losses,
        "blocks": sorted({n.split(".")[1] for n in grads if n.startswith("layers.")}),
        "grad_rel_err": err,
    }


def test_interleaved_1f1b_matches_single_process():
    r0, r1 = run_ranks(_interleaved, 2, 4)
    assert r0["stage_ids"] == [0, 2] and r1["stage_ids"] == [1, 3]
    assert r0["first"] and not r0["last"] and r1["last"] and not r1["first"]
    # 4 blocks over 4 chunks: rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3
    assert r0["blocks"] == ["0", "2"] and r1["blocks"] == ["1", "3"]
    assert r1["losses"] == pytest.approx(r1["ref_losses"], rel=1e-5)
    assert r0["grad_rel_err"] < 1e-4 and r1["grad_rel_err"] < 1e-4


def test_interleaved_needs_chunks():
    from copus.runtime.engine.pipeline import chunk_stage_ids

    assert chunk_stage_ids(1, 4, 3) == [1, 5, 9]
    with pytest.raises(ValueError, match="rank=4"):
        chunk_stage_ids(4, 4, 2)
