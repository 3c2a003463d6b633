"""Tensor parallel, activation checkpointing, torch.compile and FSDP2, applied in this order.

    parallelize(model, mesh, ...) = apply_tp (mesh["tp"]) → apply_ac → apply_compile
                                    → apply_fsdp (mesh["dp"], MixedPrecisionPolicy)

as torchtitan does (TP first so that FSDP shards DTensor parameters into 2D (dp, tp) ones; AC and
compile wrap each block's forward before FSDP groups it). The model may be a pipeline stage:
modules that are `None` are skipped. FSDP2 is always applied, also at dp = 1, so every parameter
is a DTensor on a mesh that contains "dp" (one code path for norms, clipping and state dicts).

TP plan (Megatron-LM; cpu-notes c): column-wise `wq, wk, wv, w1, w3`, row-wise `wo, w2`, the
embedding row-wise (vocab-sharded, replicated output), the head column-wise (vocab-sharded);
tied embeddings share one vocab-sharded weight. Norm weights stay replicated. With
`sequence_parallel` the norms run on sequence shards (`SequenceParallel`) and the block inputs
are all-gathered at attention / MLP. With
`loss_parallel` the head's logits stay vocab-sharded (`Shard(-1)` DTensor) and the loss is taken
under `torch.distributed.tensor.parallel.loss_parallel` (no full-vocab all-gather); without it
the logits are all-gathered (`Replicate`).

Activation checkpointing (`AC_MODES`), per transformer block, with names unchanged (the block's
`forward` is replaced by a checkpointed call of the original, no wrapper module):
- "none": autograd keeps every tensor the block's ops save for backward.
- "full": only the block's inputs are kept; the whole block is recomputed in backward.
- "selective": an op-level policy (torchtitan's `_custom_policy`,
  `torch.utils.checkpoint.create_selective_checkpoint_contexts`). Kept per block: its input
  `x`, the outputs of the 1st, 3rd, 5th and 7th matmul of the block (`wq`, `wv`, `w1`, `w2`
  in this model's order: "every other mm"), the scaled-dot-product-attention outputs
  (attention output and log-sum-exp) and the outputs of TP collectives (all-reduce,
  all-gather, reduce-scatter: never re-communicated). Recomputed in backward: the `wk`, `wo`
  and `w3` matmuls and every pointwise / norm / RoPE / SiLU / layout op. On `small`
  (bench/activation_checkpointing.py) it keeps 35.9 % of "none"'s activation bytes (full:
  6.5 %). Eager, the policy runs as a Python dispatch mode on every op of the block (forward
  and recompute); under torch.compile the policy tags the traced graph once (no per-op
  Python at run time). Step time selective / none on `small`, micro-batch 4: 1.06–1.35 eager
  over 3 runs, 1.13 compiled; micro-batch 1: 1.22–1.29 (shared CPU).
"""

from __future__ import annotations

import collections
import functools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from copus.runtime.engine.model import Transformer

AC_MODES = ("none", "selective", "full")
RECOMPILE_LIMIT = 64  # graphs per compiled block code object (2 per layout; module docstring)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def ac_mode(value: bool | str) -> str:
    """`parallel.activation_checkpointing` as a mode: booleans read as "full" / "none"."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in AC_MODES:
        raise ValueError(
            f"activation_checkpointing={value!r} is invalid; allowed: {', '.join(AC_MODES)} (or true / false)"
        )
    return value


def apply_tp(
    model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool = False, loss_parallel: bool = False
) -> None:
    """Shard the projections over `tp_mesh` (no-op when its size is 1)."""
    if tp_mesh.size() == 1:
        return
    sp = sequence_parallel
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()
        )
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    if model.shape.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # both weights are vocab-sharded (Shard(0)): the head takes the embedding's DTensor back
        model.output.weight = model.tok_embeddings.weight
    if model.output is not None and not loss_parallel:
        # after TP's own output hook, so it sees the local logits
        model.output.register_forward_hook(_plain_output)
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_plain_output)
    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
        }
        if sp:
            plan.update(
                {
                    "attention_norm": SequenceParallel(),
                    "ffn_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
        parallelize_module(block, tp_mesh, plan)


def _plain_output(_module: object, _inputs: object, output: torch.Tensor) -> torch.Tensor:
    """A TP module's local output as a plain tensor, not a view. `DTensor.to_local()` returns
    `local.view_as(local)`. For the head: the model returns those logits, so FSDP2's root module
    would warn "returned a view tensor ... wrong gradients" on every forward (an in-place op on
    a view would bypass its pre-backward hook; copus never does one). For the embedding: its
    output is the first block's input, and a compiled block (torch 2.13) returned NO gradient
    for an input that is such a view (embedding gradient 0 under tp=2; test_compile.py).
    `aten._unsafe_view` re-exposes the same storage as a non-view, with the same gradient (no
    copy), which removes both causes."""
    if isinstance(output, torch.Tensor) and output._base is not None:
        return torch.ops.aten._unsafe_view(output, output.shape)
    return output


def _saved_ops() -> set:
    """Ops whose outputs selective AC keeps (torchtitan's `_save_list`, CPU SDPA added)."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    ops = {
        aten.mm.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_cudnn_attention.default,
        c10d.all_reduce.default,
        c10d.all_gather_into_tensor.default,
        c10d.reduce_scatter_tensor.default,
    }
    return ops


def selective_policy_contexts():
    """A fresh (forward, recompute) context pair per checkpointed call: keep every SDPA and
    collective output and the odd-numbered `aten.mm` outputs, recompute the rest (module
    docstring). The mm counter is per call and per pass, so forward and recompute agree."""
    saved = _saved_ops()
    count: collections.Counter = collections.Counter()

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        key = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            count[key] += 1
            if count[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(forward, mode: str):
    """`forward` run under non-reentrant `torch.utils.checkpoint` (traceable by torch.compile)."""
    kwargs = {"context_fn": selective_policy_contexts} if mode == "selective" else {}

    @functools.wraps(forward)
    def run(*args, **kw):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kw, **kwargs)

    return run


def apply_ac(model: Transformer, mode: bool | str = "full") -> None:
    """Checkpoint every block's forward in `mode` (`AC_MODES`; booleans read as full / none)."""
    mode = ac_mode(mode)
    if mode == "none":
        return
    for block in model.layers.values():
        block.forward = _checkpointed(block.forward, mode)


def apply_compile(model: Transformer) -> None:
    """`torch.compile` (inductor) of each block's forward, in place (names unchanged).

    Only the block's own computation is compiled: the block-level hooks (FSDP2's unshard /
    reshard, the noise-scale pre-hook that registers gradient hooks) run eagerly around it; the
    submodules' TP redistribution hooks are traced. Batch dimension: marked dynamic before each
    call (`maybe_mark_dynamic`), so one graph serves every micro-batch size ≥ 2; size 1 is
    specialised by dynamo (0/1 specialisation), one more graph. All blocks share one graph
    (parameters are graph inputs; measured: 1 graph for 3 blocks). Graphs per block code object
    are thus bounded by 2 per layout and AC mode (measured: tests/runtime/test_compile.py); the
    limit is raised from dynamo's default 8 to `RECOMPILE_LIMIT` so that a run visiting many
    layouts in one process keeps compiling instead of silently falling back to eager."""
    check_compile_available()
    for block in model.layers.values():
        block.forward = _dynamic_batch(torch.compile(block.forward, recompile_limit=RECOMPILE_LIMIT))


def _dynamic_batch(compiled):
    """Call `compiled(x, ...)` with x's batch dimension marked dynamic (no recompile per size)."""

    @functools.wraps(compiled)
    def run(x: torch.Tensor, *args, **kwargs):
        torch._dynamo.maybe_mark_dynamic(x, 0)
        return compiled(x, *args, **kwargs)

    return run


def check_compile_available() -> None:
    """Raise ValueError (one line) when inductor cannot compile here: no working C++ compiler
    (its CPU backend; `CXX` / `torch._inductor.config.cpp.cxx`), or CUDA without Triton."""
    try:
        from torch._inductor import cpp_builder

        cpp_builder.get_cpp_compiler()
        if torch.cuda.is_available():
            from torch.utils._triton import has_triton

            if not has_triton():
                raise RuntimeError("CUDA without a working Triton")
    except Exception as exc:  # noqa: BLE001 - any failure means "unavailable"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(
            f"train.compile=true is unavailable here (inductor: {first}); allowed: train.compile=false"
        ) from None


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for `dtype`: "bf16" = bf16 compute and all-gathers, fp32 reduce-scatters
    and fp32 sharded master weights (torchtitan's `MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)`); "fp32" = no casts."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid; allowed: {', '.join(DTYPES)}")
    if dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_fsdp(
    model: Transformer, dp_mesh: DeviceMesh, reshard_after_forward: bool = True, dtype: str = "fp32"
) -> None:
    """`fully_shard` over `dp_mesh`: the token embedding, each block and the output head as their
    own units (torchtitan's wrapping), then the root (final norm). Each unit is gathered only
    around its own forward and backward: with `reshard_after_forward` the embedding's V·h/tp
    parameters are freed before the first block runs and the head's after the loss, instead of
    both staying gathered from the first forward to the end of the backward as part of the
    root (FSDP2 keeps the root unit unsharded after forward). Tied embeddings share one weight,
    which can live in one unit only: they stay in the root."""
    mp = mixed_precision(dtype)
    tied = model.shape.tie_embeddings and model.tok_embeddings is not None and model.output is not None
    if model.tok_embeddings is not None and not tied:
        fully_shard(model.tok_embeddings, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    if model.output is not None and not tied:
        fully_shard(model.output, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)


def parallelize(
    model: Transformer,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    activation_checkpointing: bool | str = "none",
    reshard_after_forward: bool = True,
    dtype: str = "fp32",
    compile: bool = False,
    loss_parallel: bool = False,
) -> Transformer:
    """TP → AC → compile → FSDP2 on a (possibly meta, possibly stage-split) model; returns it."""
    apply_tp(model, mesh["tp"], sequence_parallel, loss_parallel)
    apply_ac(model, activation_checkpointing)
    if compile:
        apply_compile(model)
    apply_fsdp(model, mesh["dp"], reshard_after_forward, dtype)
    return model


__all__ = [
    "AC_MODES",
    "DTYPES",
    "ac_mode",
    "apply_tp",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "check_compile_available",
    "mixed_precision",
    "parallelize",
    "selective_policy_contexts",
]
