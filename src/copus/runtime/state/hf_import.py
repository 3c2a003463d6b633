"""Hugging Face in: a transformers folder (config.json + safetensors) → copus's model weights.

`load_hf_weights(model, folder)` fills every parameter of `model` — a full model, a pipeline stage
(modules set to None are skipped), FSDP2 / TP DTensor shards alike — from the folder's
`model.safetensors` or `model.safetensors.index.json` shards. Each rank reads only its own rows
and columns (`safe_open(...).get_slice`, memory-mapped): the bytes read per rank are its shard of
each tensor, widened to whole heads for wq / wk (the RoPE row permutation of `hf_weights` stays
inside a head). Names and layouts: `copus.runtime.state.hf_weights`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from copus.core.specs.models import ModelShape
from copus.runtime.state import hf_weights

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_files(folder: str | Path) -> dict[str, Path]:
    """transformers tensor name → the safetensors file holding it; ValueError (one line) when
    the folder has no safetensors weights."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())
        return {k: folder / v for k, v in index["weight_map"].items()}
    if (folder / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE), framework="pt") as fh:
            return {k: folder / SINGLE for k in fh.keys()}
    raise ValueError(
        f"--init-from {str(folder)!r}: holds no {SINGLE} or {INDEX}; allowed: a "
        "Hugging Face folder with safetensors weights (save_pretrained)"
    )


def _local_box(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of a DTensor shard or a plain tensor (offset 0)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return tuple(p.shape), (0,) * p.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(shape), tuple(offset)


def read_local(fh, hf_key: str, name: str, p: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """This rank's box of copus tensor `name`, read from open safetensors file `fh`."""
    local, offset = _local_box(p)
    full = tuple(fh.get_slice(hf_key).get_shape())
    if full != tuple(p.shape):
        raise ValueError(
            f"--init-from: {hf_key} has shape {list(full)}, the model expects "
            f"{list(p.shape)}; allowed: a folder whose config.json matches its weights"
        )
    if 0 in local:
        return torch.empty(local)
    sl = fh.get_slice(hf_key)
    r0, r1 = offset[0], offset[0] + local[0]
    rope = any(k in name for k in ("attention.wq.", "attention.wk."))
    if rope:  # whole heads: the permutation stays inside one head
        hd = shape.head_dim
        h0, h1 = r0 // hd * hd, -(-r1 // hd) * hd
        rows = sl[h0:h1] if len(full) == 1 else sl[h0:h1, offset[1] : offset[1] + local[1]]
        return hf_weights.from_hf(name, rows, shape)[r0 - h0 : r1 - h0].contiguous()
    if len(full) == 1:
        return sl[r0:r1].contiguous()
    return sl[r0:r1, offset[1] : offset[1] + local[1]].contiguous()


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str | Path) -> int:
    """Copy every parameter of `model` (its `shape` attribute: copus's Transformer) from the
    Hugging Face folder; return the bytes read. Tied output weights are filled through the
    embedding they share."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    shape: ModelShape = model.shape
    files = weight_files(folder)
    handles: dict[Path, object] = {}
    read = 0
    try:
        for name, p in model.named_parameters():
            key = hf_weights.hf_name(name)
            if key not in files:
                raise ValueError(
                    f"--init-from {str(folder)!r}: has no tensor {key}; allowed: a "
                    "folder whose config.json matches its weights"
                )
            if files[key] not in handles:
                handles[files[key]] = safe_open(str(files[key]), framework="pt").__enter__()
            box = read_local(handles[files[key]], key, name, p, shape)
            read += box.numel() * box.element_size()
            target = p.to_local() if isinstance(p, DTensor) else p
            target.copy_(box.to(target.dtype))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return read
