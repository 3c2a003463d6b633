"""Tensor parallel, activation checkpointing and FSDP2, applied to a plain model in this order.

    parallelize(model, mesh, ...) = apply_tp (mesh["tp"]) → apply_ac → apply_fsdp (mesh["dp"])

as torchtitan does (TP first so that FSDP shards DTensor parameters into 2D (dp, tp) ones; AC
wraps each block before FSDP groups it). The model may be a pipeline stage: modules that are
`None` are skipped. FSDP2 is always applied, also at dp = 1, so every parameter is a DTensor on a
mesh that contains "dp" (one code path for norms, clipping and state dicts).

TP plan (Megatron-LM; cpu-notes c): column-wise `wq, wk, wv, w1, w3`, row-wise `wo, w2`, the
embedding row-wise (vocab-sharded, replicated output), the head column-wise (vocab-sharded,
replicated logits); tied embeddings share one vocab-sharded weight. Norm weights stay
replicated. With `sequence_parallel` the norms run on sequence shards (`SequenceParallel`) and
the block inputs are all-gathered at attention / MLP.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from copus.runtime.engine.model import Transformer


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard the projections over `tp_mesh` (no-op when its size is 1)."""
    if tp_mesh.size() == 1:
        return
    sp = sequence_parallel
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                output_layouts=Shard(1) if sp else Replicate())
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                        output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    if model.shape.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # both weights are vocab-sharded (Shard(0)): the head takes the embedding's DTensor back
        model.output.weight = model.tok_embeddings.weight
    if model.output is not None:    # after TP's own output hook, so it sees the local logits
        model.output.register_forward_hook(_plain_logits)
    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
        }
        if sp:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)


def _plain_logits(_module: object, _inputs: object, output: torch.Tensor) -> torch.Tensor:
    """The TP head's logits as a plain tensor, not a view. `DTensor.to_local()` returns
    `local.view_as(local)`; the model returns those logits, so FSDP2's root module would warn
    "returned a view tensor ... wrong gradients" on every forward (an in-place op on a view
    would bypass its pre-backward hook; copus never does one). `aten._unsafe_view` re-exposes
    the same storage as a non-view, with the same gradient (no copy), which removes the cause."""
    if isinstance(output, torch.Tensor) and output._base is not None:
        return torch.ops.aten._unsafe_view(output, output.shape)
    return output


def apply_ac(model: Transformer) -> None:
    """Recompute each block's activations in backward (composable `checkpoint`, names unchanged)."""
    from torch.distributed._composable import checkpoint

    for block in model.layers.values():
        checkpoint(block)


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, reshard_after_forward: bool = True) -> None:
    """`fully_shard` each block, then the root (embeddings, final norm, head) over `dp_mesh`."""
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def parallelize(model: Transformer, mesh: DeviceMesh, *, sequence_parallel: bool = False,
                activation_checkpointing: bool = False,
                reshard_after_forward: bool = True) -> Transformer:
    """TP → AC → FSDP2 on a (possibly meta, possibly stage-split) model; returns it."""
    apply_tp(model, mesh["tp"], sequence_parallel)
    if activation_checkpointing:
        apply_ac(model)
    apply_fsdp(model, mesh["dp"], reshard_after_forward)
    return model


__all__ = ["apply_tp", "apply_ac", "apply_fsdp", "parallelize"]
