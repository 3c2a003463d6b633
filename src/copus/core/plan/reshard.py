"""Which slice of which tensor moves from which rank to which, when the layout changes (design §6).

Pure logic (no torch) behind `runtime/state/redistribute.py`, the direct in-process switch.

A rank's shard of a parameter (and of each AdamW moment, which has the parameter's placements)
is a *box* of the full tensor: one half-open range [lo, hi) per tensor dimension. It follows from
the placements by applying, in order, each sharded mesh dimension as torch.chunk does (chunk size
⌈n/k⌉, trailing chunks possibly short or empty), which is how both FSDP2 (`fully_shard`, dim 0)
and DTensor TP (`Shard(d)`) cut tensors. FSDP2 over TP shards the TP-local tensor, which DTensor
writes as `_StridedShard(d, sf)` on the outer (dp) mesh dimension: that chunking is applied AFTER
the inner mesh dimensions that shard d, and sf must equal the product of their sizes.

Placements are given as tuples per mesh dimension: ("R",) replicate, ("S", d) shard dim d,
("SS", d, sf) strided shard. `plan_pieces` covers every new box exactly once from the old boxes
(a replicated source is taken from the destination itself when it holds it, else spread over the
replicas by destination rank), so each element is sent at most once per destination.
`memory_order` orders the parameters so that the running per-rank balance "new bytes allocated −
old bytes freed" stays small on every rank at once (greedy min-max), and `buckets` cuts that order
into consecutive groups of at most `cap` bytes: the state in flight at any moment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Box = tuple[tuple[int, int], ...]
Placement = tuple


class UnsupportedLayout(ValueError):
    """The direct path cannot map this tensor (the switch falls back to DCP staging)."""


def chunk_range(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    """Piece `index` of [lo, hi) cut into `parts` as torch.chunk does: size ⌈n/parts⌉, the
    last pieces short or empty (then (hi, hi))."""
    size = -(-(hi - lo) // parts) if hi > lo else 0
    start = min(lo + index * size, hi)
    return start, min(start + size, hi)


def _order(placements: Sequence[Placement], mesh_sizes: Sequence[int]) -> list[int]:
    """Mesh dimensions in the order their chunking applies (strided shards last, outer last)."""
    plain = [m for m, p in enumerate(placements) if p[0] != "SS"]
    strided = [m for m, p in enumerate(placements) if p[0] == "SS"]
    for m in strided:
        dim, sf = placements[m][1], placements[m][2]
        inner = 1
        for k in range(m + 1, len(placements)):
            if placements[k][0] == "S" and placements[k][1] == dim:
                inner *= mesh_sizes[k]
        if inner != sf:
            raise UnsupportedLayout(f"strided shard on dim {dim} with split factor {sf}: inner "
                                    f"mesh dimensions shard it {inner} ways; allowed: equal")
    return plain + strided[::-1]


def local_box(shape: Sequence[int], mesh_sizes: Sequence[int], coord: Sequence[int],
              placements: Sequence[Placement]) -> Box:
    """The box of the full tensor `shape` held at mesh coordinate `coord`."""
    if not (len(mesh_sizes) == len(coord) == len(placements)):
        raise UnsupportedLayout(f"mesh sizes {mesh_sizes}, coordinate {coord} and placements "
                                f"{placements} differ in length; allowed: one per mesh dim")
    ranges = [(0, int(n)) for n in shape]
    for m in _order(placements, mesh_sizes):
        p = placements[m]
        if p[0] == "R":
            continue
        if p[0] not in ("S", "SS") or not 0 <= p[1] < len(shape):
            raise UnsupportedLayout(f"placement {p!r}; allowed: replicate or shard of a dim")
        d = p[1]
        ranges[d] = chunk_range(*ranges[d], mesh_sizes[m], coord[m])
    return tuple(ranges)


def volume(box: Box) -> int:
    v = 1
    for lo, hi in box:
        v *= max(hi - lo, 0)
    return v


def intersect(a: Box, b: Box) -> Box | None:
    """a ∩ b, or None when empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(hi > lo for lo, hi in out) else None


@dataclass(frozen=True, slots=True)
class Piece:
    """The elements `box` (full-tensor coordinates) of one tensor go from `src` to `dst`."""

    src: int
    dst: int
    box: Box


def plan_pieces(old: Mapping[int, Box], new: Mapping[int, Box]) -> list[Piece]:
    """Pieces that fill every destination's new box from the old holders (rank → box).

    Old boxes are either identical (replicas) or disjoint; UnsupportedLayout otherwise, or when
    a new box is not covered exactly. Sorted by (dst, src, box): every rank derives the same list.
    """
    classes: dict[Box, list[int]] = {}
    for rank, box in sorted(old.items()):
        if volume(box):
            classes.setdefault(box, []).append(rank)
    pieces = []
    for dst, want in sorted(new.items()):
        need = volume(want)
        if not need:
            continue
        got = 0
        for box, ranks in sorted(classes.items()):
            part = intersect(box, want)
            if part is None:
                continue
            src = dst if dst in ranks else ranks[dst % len(ranks)]
            pieces.append(Piece(src, dst, part))
            got += volume(part)
        if got != need:
            raise UnsupportedLayout(f"rank {dst}'s new shard {want} is covered {got} of {need} "
                                    "elements by the old shards; allowed: exactly once")
    return sorted(pieces, key=lambda p: (p.dst, p.src, p.box))


def memory_order(deltas: Sequence[Sequence[int]]) -> list[int]:
    """An order of the tensors (rows: per-rank bytes allocated − freed when it moves) that keeps
    max over ranks of the running sum small: at each step take the tensor that minimises the
    resulting maximum (ties: lowest index). O(n² · ranks), vectorised over tensors and ranks."""
    d = np.asarray(deltas, dtype=np.float64).reshape(len(deltas), -1)
    run = np.zeros(d.shape[1])
    left = np.ones(len(d), dtype=bool)
    order = []
    for _ in range(len(d)):
        worst = np.where(left, (run + d).max(axis=1, initial=-np.inf), np.inf)
        best = int(np.argmin(worst))          # first minimum: lowest index on ties
        order.append(best)
        left[best] = False
        run += d[best]
    return order


def buckets(sizes: Sequence[int], cap: int) -> list[list[int]]:
    """Consecutive groups of indices whose sizes sum to at most `cap` (a larger single item
    forms its own group)."""
    out: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if out and total + size <= cap:
            out[-1].append(i)
            total += size
        else:
            out.append([i])
            total = size
    return out


# Direct-switch cost measured by bench/reconfigure.py (bench/results/reconfigure_synthetic.json:
# 4 gloo ranks on 2 CPU cores shared with other jobs, load 11-28; synthetic states of 0.1, 0.5
# and 1 GB took 0.59, 0.73 and 2.4 s): wall ≈ 0.3 s + state / 0.5 GB/s.
DIRECT_SWITCH_CONSTANT_S = 0.3
CPU_SWITCH_BANDWIDTH_BPS = 0.5e9   # all ranks together: weights + AdamW state per second


def direct_switch_cost_s(state_bytes: float, bandwidth_bps: float | None = None,
                         constant_s: float = DIRECT_SWITCH_CONSTANT_S) -> float:
    """Prior cost of one direct layout switch: constant + state / bandwidth, where `state_bytes`
    (weights + AdamW moments, all ranks) bounds the bytes that change owner and `bandwidth_bps`
    is the world's aggregate rate (None: the CPU figure measured here)."""
    bw = CPU_SWITCH_BANDWIDTH_BPS if bandwidth_bps is None else bandwidth_bps
    if state_bytes < 0 or bw <= 0:
        raise ValueError(f"state_bytes={state_bytes}, bandwidth_bps={bw} are invalid; allowed: "
                         "state >= 0, bandwidth > 0")
    return float(constant_s + state_bytes / bw)
