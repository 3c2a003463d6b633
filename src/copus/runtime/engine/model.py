"""A Llama-style decoder (no distributed code): RMSNorm, rotary embeddings, SwiGLU, GQA.

Names follow torchtitan's Llama so that TP plans, FSDP wrapping and checkpoints read the same:
`tok_embeddings`, `layers` (an `nn.ModuleDict` "0".."L-1" of `TransformerBlock`s holding
`attention.{wq,wk,wv,wo}`, `feed_forward.{w1,w2,w3}`, `attention_norm`, `ffn_norm`), `norm`,
`output`. `forward` skips modules set to `None`, so a pipeline stage is the same class with some
modules removed: a stage without `tok_embeddings` receives hidden states, one without `output`
returns hidden states.

Lifecycle: build on the meta device (`build_model(shape, "meta")`), split / parallelize / shard,
then `materialize(model, device, seed)` = `to_empty` + `init_weights` + `reset_rope`.

Initialisation is layout-independent by construction and costs each rank its own shard only
(`init_weights`): a weight's full tensor is defined as a grid of fixed tiles of `TILE_ROWS` ×
`TILE_COLS` elements (fixed by the full shape, never by the layout), tile (i, j) drawn from its
own CPU `torch.Generator` seeded by (seed, parameter name, i, j) (`tile_seed`: a counter-based
definition; any rank can draw any tile). A rank finds the global row and column indices of its
local data (FSDP2 / TP placements, `_StridedShard` included: `local_indices`), draws only the
tiles they touch and copies the covered part into its shard. Values drawn per rank = its shard
+ the partial tiles at its shard's edges; peak extra memory = one local parameter. Any split, TP
or FSDP layout holds the same logical weights for the same seed. `materialize(..., init=False)`
draws nothing (the caller loads a checkpoint or Hugging Face weights right after).
Distributions (GPT-2 / torchtitan): linear and embedding weights N(0, 0.02²) (output head
included), the residual projections `wo`, `w2` N(0, (0.02/√(2L))²), norm weights 1, attention
biases (when the shape has them) 0.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from copus.core.specs.models import ModelShape, RopeScaling

__all__ = [
    "RMSNorm",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Transformer",
    "rope_cache",
    "llama3_inv_freq",
    "apply_rope",
    "build_model",
    "init_weights",
    "reset_rope",
    "materialize",
    "param_seed",
    "tile_seed",
    "init_local",
    "local_indices",
    "DrawCounter",
]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · w (Zhang & Sennrich 2019), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def llama3_inv_freq(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency scaling (transformers `_compute_llama3_parameters`): with
    λ = 2π/f, L = original_max_position_embeddings, f/factor where λ > L/low_freq_factor, f where
    λ < L/high_freq_factor, else (1-a)·f/factor + a·f with a = (L/λ - low) / (high - low)."""
    wavelen = 2 * math.pi / inv
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_wl, inv / s.factor, inv)
    a = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smooth = (1 - a) * scaled / s.factor + a * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(medium, smooth, scaled)


def rope_cache(
    head_dim: int, seq_len: int, theta: float, device=None, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """cos/sin table [seq_len, head_dim/2, 2] of RoPE (Su et al. 2021): angle_{t,i} = t·θ^(-2i/d),
    the frequencies scaled by `llama3_inv_freq` when `scaling` is given."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if scaling is not None:
        inv = llama3_inv_freq(inv, scaling)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv)
    return torch.stack((ang.cos(), ang.sin()), dim=-1)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x_{2i}, x_{2i+1}) of x [b, s, h, d] by the angles in `cache`."""
    s = x.shape[1]
    xf = x.float().unflatten(-1, (-1, 2))
    cos = cache[:s, None, :, 0]
    sin = cache[:s, None, :, 1]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention. Heads are inferred from the projection outputs
    (`view(b, s, -1, head_dim)`), so a tensor-parallel shard runs its local heads unchanged.

    K and V keep their n_kv heads: SDPA's `enable_gqa=True` lets each group of n_heads/n_kv
    query heads read one K/V head (no `repeat_interleave` copy of K and V, which the backward
    would also keep). The RoPE table is the non-persistent buffer `rope`, shared by every block
    (`Transformer.share_rope`) and read here, not passed as a forward input: FSDP2's
    `MixedPrecisionPolicy(cast_forward_inputs=True)` casts every floating-point input of a
    wrapped block to the parameter dtype, which would hand attention a bf16 table."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        hd = shape.head_dim
        self.head_dim = hd
        self.wq = nn.Linear(shape.dim, shape.n_heads * hd, bias=shape.qkv_bias)
        self.wk = nn.Linear(shape.dim, shape.n_kv_heads * hd, bias=shape.qkv_bias)
        self.wv = nn.Linear(shape.dim, shape.n_kv_heads * hd, bias=shape.qkv_bias)
        self.wo = nn.Linear(shape.n_heads * hd, shape.dim, bias=shape.o_bias)
        self.register_buffer("rope", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        """`rope`: a table for a standalone call (tests); the model's blocks use `self.rope`."""
        table = self.rope if rope is None else rope
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, table), apply_rope(k, table)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=q.shape[2] != k.shape[2]
        )
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer 2020): w2(silu(w1 x) · w3 x)."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: h = x + attn(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.feed_forward = FeedForward(shape.dim, shape.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        """`rope`: a table for a standalone call (tests); None reads the shared buffer."""
        a = self.attention_norm(x)  # one input when the table is the buffer (TP's SP hooks)
        h = x + (self.attention(a) if rope is None else self.attention(a, rope))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens [b, s] → logits [b, s, vocab]; any of tok_embeddings / norm / output may be None."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(shape) for i in range(shape.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(shape.dim, shape.norm_eps)
        self.output: nn.Linear | None = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer(
            "rope",
            rope_cache(shape.head_dim, shape.seq_len, shape.rope_theta, scaling=shape.rope_scaling),
            persistent=False,
        )
        self.share_rope()

    def share_rope(self) -> None:
        """Point every block's `attention.rope` at the model's one fp32 table (no copy per block;
        buffers are not cast by FSDP2's mixed precision, only forward inputs are)."""
        for layer in self.layers.values():
            layer.attention.rope = self.rope

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def build_model(shape: ModelShape, device: torch.device | str = "meta") -> Transformer:
    """Construct the module tree on `device` (default meta: no memory, weights uninitialised);
    ValueError (one line) for a shape copus's model cannot represent (`ModelShape.unsupported`)."""
    if shape.unsupported:
        raise ValueError(shape.unsupported)
    with torch.device(device):
        return Transformer(shape)


TILE_ROWS = 16  # rows per initialisation tile (part of the weights' definition: fixed)
TILE_COLS = 256  # columns per initialisation tile


class DrawCounter:
    """Values drawn by `init_weights` in this process (for tests and bench/init_scale.py)."""

    values = 0


def param_seed(seed: int, name: str) -> int:
    """Seed of one parameter's generator: crc32 of the name mixed with the run seed (63-bit)."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def tile_seed(seed: int, name: str, row_tile: int, col_tile: int) -> int:
    """Seed of tile (row_tile, col_tile) of parameter `name`: a 63-bit mix (splitmix64-style
    multiply-xorshift) of the parameter's seed and the tile coordinates."""
    x = param_seed(seed, name) ^ (row_tile * 0x9E3779B97F4A7C15) ^ (col_tile * 0xC2B2AE3D27D4EB4F)
    x &= 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) % (2**63 - 1)


def init_std(name: str, shape: ModelShape) -> float | None:
    """N(0, std²) of a drawn weight; None for norm weights (1) and biases (0)."""
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return None
    leaf = name.split(".")[-2]
    return 0.02 / math.sqrt(2 * shape.n_layers) if leaf in ("wo", "w2") else 0.02


def local_indices(p: torch.Tensor) -> list[torch.Tensor]:
    """Per dimension of `p`, the global indices of this rank's local data along it, in local
    order (all indices for a plain tensor). Each is computed by sharding `arange(size)` with the
    placements that act on that dimension (O(size) memory, no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if not isinstance(p, DTensor):
        return [torch.arange(n) for n in p.shape]
    out = []
    for d, n in enumerate(p.shape):
        placements = []
        for pl in p.placements:
            if isinstance(pl, _StridedShard) and pl.dim == d:
                placements.append(_StridedShard(0, split_factor=pl.split_factor))
            elif isinstance(pl, Shard) and not isinstance(pl, _StridedShard) and pl.dim == d:
                placements.append(Shard(0))
            else:
                placements.append(Replicate())
        idx = distribute_tensor(torch.arange(n), p.device_mesh, placements, src_data_rank=None)
        out.append(idx.to_local())
    return out


def _runs(idx: torch.Tensor, tile: int) -> list[tuple[int, slice, slice]]:
    """Split local indices `idx` into runs inside one tile each: (tile number, slice of local
    positions, slice inside the tile). Local data under Shard / _StridedShard is made of
    contiguous ascending runs of global indices."""
    if idx.numel() == 0:
        return []
    tiles = idx // tile
    breaks = (idx[1:] != idx[:-1] + 1) | (tiles[1:] != tiles[:-1])
    starts = [0, *(breaks.nonzero().flatten() + 1).tolist()]
    ends = [*starts[1:], idx.numel()]
    first = idx[starts].tolist()
    out = []
    for a, b, g in zip(starts, ends, first):
        t = g // tile
        out.append((t, slice(a, b), slice(g - t * tile, g - t * tile + b - a)))
    return out


def _tile(seed: int, name: str, full: tuple[int, int], i: int, j: int, std: float) -> torch.Tensor:
    """Tile (i, j) of parameter `name` (full 2-D shape `full`), N(0, std²), fp32 on CPU."""
    rows = min(TILE_ROWS, full[0] - i * TILE_ROWS)
    cols = min(TILE_COLS, full[1] - j * TILE_COLS)
    gen = torch.Generator().manual_seed(tile_seed(seed, name, i, j))
    DrawCounter.values += rows * cols
    return torch.randn(rows, cols, generator=gen).mul_(std)


def init_local(name: str, p: torch.Tensor, shape: ModelShape, seed: int) -> torch.Tensor:
    """This rank's local data of parameter `name` (CPU fp32), drawn tile by tile (module
    docstring); identical, position by position, to the same slice of every other layout's."""
    std = init_std(name, shape)
    local_shape = tuple((p.to_local() if hasattr(p, "to_local") else p).shape)
    if std is None:
        return torch.ones(local_shape) if name.endswith("norm.weight") else torch.zeros(local_shape)
    if p.ndim != 2:
        raise ValueError(f"init of {name}: {p.ndim}-D weight; allowed: 2-D (matrices)")
    out = torch.empty(local_shape)
    rows, cols = local_indices(p)
    row_tiles, col_tiles = _by_tile(rows, TILE_ROWS), _by_tile(cols, TILE_COLS)
    full = (p.shape[0], p.shape[1])
    for i, row_runs in row_tiles.items():
        for j, col_runs in col_tiles.items():
            tile = _tile(seed, name, full, i, j, std)  # each tile drawn once per rank
            for local_r, tile_r in row_runs:
                for local_c, tile_c in col_runs:
                    out[local_r, local_c] = tile[tile_r, tile_c]
    return out


def _by_tile(idx: torch.Tensor, tile: int) -> dict[int, list[tuple[slice, slice]]]:
    """`_runs` grouped by tile number: {tile: [(local slice, slice inside the tile), ...]}."""
    out: dict[int, list[tuple[slice, slice]]] = {}
    for t, local, inside in _runs(idx, tile):
        out.setdefault(t, []).append((local, inside))
    return out


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Fill every parameter's local data (plain tensor or DTensor shard) tile by tile."""
    for name, p in model.named_parameters():
        target = p.to_local() if hasattr(p, "to_local") else p
        target.copy_(init_local(name, p, model.shape, seed))


@torch.no_grad()
def reset_rope(model: Transformer) -> None:
    """Recompute the non-persistent RoPE buffer (garbage after `to_empty`), shared by every block."""
    s = model.shape
    model.rope = rope_cache(s.head_dim, s.seq_len, s.rope_theta, device=model.rope.device, scaling=s.rope_scaling)
    model.share_rope()


def materialize(model: Transformer, device: torch.device | str, seed: int, init: bool = True) -> Transformer:
    """`to_empty(device)` then deterministic weights (`init_weights`; `init=False`: none, the
    caller loads every parameter next) and the RoPE buffer."""
    model.to_empty(device=device)
    if model.shape.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight  # to_empty makes one tensor per module
    if init:
        init_weights(model, seed)
    reset_rope(model)
    return model
