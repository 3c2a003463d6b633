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

import itertools
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
            raise UnsupportedLayout(
                f"strided shard on dim {dim} with split factor {sf}: inner "
                f"mesh dimensions shard it {inner} ways; allowed: equal"
            )
    return plain + strided[::-1]


def local_box(
    shape: Sequence[int], mesh_sizes: Sequence[int], coord: Sequence[int], placements: Sequence[Placement]
) -> Box:
    """The box of the full tensor `shape` held at mesh coordinate `coord`."""
    if not (len(mesh_sizes) == len(coord) == len(placements)):
        raise UnsupportedLayout(
            f"mesh sizes {mesh_sizes}, coordinate {coord} and placements "
            f"{placements} differ in length; allowed: one per mesh dim"
        )
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
            raise UnsupportedLayout(
                f"rank {dst}'s new shard {want} is covered {got} of {need} "
                "elements by the old shards; allowed: exactly once"
            )
    return sorted(pieces, key=lambda p: (p.dst, p.src, p.box))


# ------------------------------------------------------------- per-rank planning (chunk arithmetic)


class Mesh:
    """A device mesh as plain data: its shape and the global rank at each coordinate (row-major),
    with the reverse map rank → coordinate built once."""

    __slots__ = ("shape", "ranks", "_where", "_hash")

    def __init__(self, shape: Sequence[int], ranks: Sequence[int]) -> None:
        self.shape, self.ranks = tuple(int(n) for n in shape), tuple(int(r) for r in ranks)
        if int(np.prod(self.shape, dtype=np.int64)) != len(self.ranks):
            raise UnsupportedLayout(f"mesh {self.shape} lists {len(self.ranks)} ranks")
        self._where: dict[int, tuple[int, ...]] | None = None
        self._hash = hash((self.shape, self.ranks))

    def __reduce__(self):
        return (Mesh, (self.shape, self.ranks))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and (self.shape, self.ranks) == (other.shape, other.ranks)

    def __hash__(self) -> int:
        return self._hash

    def coord(self, rank: int) -> tuple[int, ...] | None:
        """The coordinate of global `rank` in this mesh, None when it is not a member."""
        if self._where is None:
            idx = np.indices(self.shape).reshape(len(self.shape), -1).T.tolist()
            self._where = {r: tuple(c) for r, c in zip(self.ranks, idx, strict=True)}
        return self._where.get(rank)

    def rank(self, coord: Sequence[int]) -> int:
        flat = 0
        for c, n in zip(coord, self.shape, strict=True):
            flat = flat * n + c
        return self.ranks[flat]


@dataclass(frozen=True, slots=True)
class Layout:
    """One tensor under one layout: full shape, mesh and placements (one per mesh dimension).
    Every holder's box follows from these by `local_box`; nothing per rank is listed."""

    shape: tuple[int, ...]
    mesh: Mesh
    placements: tuple[Placement, ...]

    def box_of(self, rank: int) -> Box | None:
        coord = self.mesh.coord(rank)
        if coord is None:
            return None
        return local_box(self.shape, self.mesh.shape, coord, self.placements)


def holders(layout: Layout, query: Box) -> list[tuple[Box, list[int]]]:
    """The non-empty boxes of `layout` that intersect `query`, each with the sorted ranks that
    hold it (replicas differ only in replicated mesh dimensions). Chunk arithmetic: along each
    sharding mesh dimension, in chunking order, only the chunk indices
    ⌊(q_lo − lo)/s⌋ … ⌊(q_hi − 1 − lo)/s⌋ (s = ⌈n/k⌉) are visited, so the cost is the number of
    intersecting boxes, not the mesh size."""
    if not volume(query):
        return []
    mesh, place = layout.mesh, layout.placements
    order = [m for m in _order(place, mesh.shape) if place[m][0] != "R"]
    for m in order:
        if place[m][0] not in ("S", "SS") or not 0 <= place[m][1] < len(layout.shape):
            raise UnsupportedLayout(f"placement {place[m]!r}; allowed: replicate or shard of a dim")
    replicated = [m for m, p in enumerate(place) if p[0] == "R"]
    out: list[tuple[Box, list[int]]] = []

    def walk(depth: int, ranges: list[tuple[int, int]], coord: dict[int, int]) -> None:
        if depth == len(order):
            box = tuple(ranges)
            if volume(box) and intersect(box, query) is not None:
                out.append((box, _class_ranks(mesh, coord, replicated)))
            return
        m = order[depth]
        d, k = place[m][1], mesh.shape[m]
        lo, hi = ranges[d]
        size = -(-(hi - lo) // k) if hi > lo else 0
        qlo, qhi = max(query[d][0], lo), min(query[d][1], hi)
        if size == 0 or qhi <= qlo:
            return
        for i in range((qlo - lo) // size, min(k - 1, (qhi - 1 - lo) // size) + 1):
            ranges[d] = chunk_range(lo, hi, k, i)
            coord[m] = i
            walk(depth + 1, ranges, coord)
        ranges[d] = (lo, hi)
        coord.pop(m, None)

    walk(0, [(0, int(n)) for n in layout.shape], {})
    return out


def _class_ranks(mesh: Mesh, fixed: dict[int, int], replicated: list[int]) -> list[int]:
    """Ranks whose coordinate equals `fixed` on the sharding dims (any value elsewhere)."""
    free = [m for m in range(len(mesh.shape)) if m not in fixed]
    ranks = []
    for values in itertools.product(*(range(mesh.shape[m]) for m in free)):
        coord = dict(fixed)
        coord.update(zip(free, values, strict=True))
        ranks.append(mesh.rank([coord[m] for m in range(len(mesh.shape))]))
    return sorted(ranks)


Placed = Sequence[Layout]  # a tensor's groups: disjoint meshes whose equal boxes are replicas
# (e.g. a norm FSDP-sharded over the dp sub-mesh of each tp rank)


def _groups(placed: Layout | Placed) -> Sequence[Layout]:
    return (placed,) if isinstance(placed, Layout) else placed


def box_of(placed: Layout | Placed, rank: int) -> Box | None:
    """`rank`'s box under a (grouped) layout, None when it holds none."""
    for lay in _groups(placed):
        box = lay.box_of(rank)
        if box is not None:
            return box
    return None


def classes(placed: Layout | Placed, query: Box) -> list[tuple[Box, list[int]]]:
    """`holders` over every group, replicas of one box (in any group) merged, ranks sorted."""
    groups = _groups(placed)
    if len(groups) == 1:
        return holders(groups[0], query)
    merged: dict[Box, list[int]] = {}
    for lay in groups:
        for box, ranks in holders(lay, query):
            merged.setdefault(box, []).extend(ranks)
    return [(box, sorted(ranks)) for box, ranks in merged.items()]


def rank_pieces(old: Layout | Placed, new: Layout | Placed, me: int) -> list[Piece]:
    """The pieces of `plan_pieces` (same sources, same boxes) in which rank `me` sends or
    receives, computed from the two layouts alone: O(boxes overlapping me), not O(world).

    Receive: each old box class intersecting my new box sends from me when I hold a replica,
    else from replica number (me mod replicas). Send: for each new holder d whose box meets my
    old box, the source `plan_pieces` picks for d from my class is checked to be me."""
    shapes = {lay.shape for lay in (*_groups(old), *_groups(new))}
    if len(shapes) != 1:
        raise UnsupportedLayout(f"shapes {sorted(shapes)} differ")
    pieces: set[Piece] = set()
    want = box_of(new, me)
    if want is not None and volume(want):
        got = 0
        for box, ranks in classes(old, want):
            part = intersect(box, want)
            src = me if me in ranks else ranks[me % len(ranks)]
            pieces.add(Piece(src, me, part))
            got += volume(part)
        if got != volume(want):
            raise UnsupportedLayout(
                f"rank {me}'s new shard {want} is covered {got} of "
                f"{volume(want)} elements by the old shards; allowed: exactly once"
            )
    have = box_of(old, me)
    if have is not None and volume(have):
        mine = next(ranks for box, ranks in classes(old, have) if box == have)
        members = set(mine)
        for box, ranks in classes(new, have):
            part = intersect(box, have)
            for dst in ranks:
                if (dst if dst in members else mine[dst % len(mine)]) == me:
                    pieces.add(Piece(me, dst, part))
    return sorted(pieces, key=lambda p: (p.dst, p.src, p.box))


def layout_volumes(layout: Layout, world: int) -> np.ndarray:
    """Elements held by each of `world` ranks under `layout` (0 outside its mesh), vectorised
    over the mesh: the same cuts as `local_box` applied to every coordinate at once."""
    mesh, place = layout.mesh, layout.placements
    coords = np.indices(mesh.shape).reshape(len(mesh.shape), -1)
    lo = np.zeros((len(layout.shape), coords.shape[1]), dtype=np.int64)
    hi = np.tile(np.asarray(layout.shape, dtype=np.int64)[:, None], (1, coords.shape[1]))
    for m in _order(place, mesh.shape):
        if place[m][0] == "R":
            continue
        d, k = place[m][1], mesh.shape[m]
        size = -(-(hi[d] - lo[d]) // k)
        start = np.minimum(lo[d] + coords[m] * size, hi[d])
        lo[d], hi[d] = start, np.minimum(start + size, hi[d])
    out = np.zeros(world, dtype=np.int64)
    out[list(mesh.ranks)] = np.prod(np.maximum(hi - lo, 0), axis=0)
    return out


def placed_volumes(placed: Layout | Placed, world: int) -> np.ndarray:
    """`layout_volumes` summed over a grouped layout's (disjoint) groups."""
    return sum((layout_volumes(lay, world) for lay in _groups(placed)), np.zeros(world, dtype=np.int64))


def memory_order(deltas: Sequence[Sequence[int]]) -> list[int]:
    """An order of the tensors (rows: per-rank bytes allocated − freed when it moves) that keeps
    max over ranks of the running sum small: at each step take the tensor that minimises the
    resulting maximum (ties: lowest index). O(n² · distinct columns), vectorised over tensors
    and ranks: ranks whose columns are equal (the same balance at every step, e.g. the dp
    replicas of a stage) are kept once, which changes no maximum."""
    d = _distinct_columns(np.asarray(deltas, dtype=np.float64).reshape(len(deltas), -1))
    run = np.zeros(d.shape[1])
    left = np.ones(len(d), dtype=bool)
    order = []
    for _ in range(len(d)):
        worst = np.where(left, (run + d).max(axis=1, initial=-np.inf), np.inf)
        best = int(np.argmin(worst))  # first minimum: lowest index on ties
        order.append(best)
        left[best] = False
        run += d[best]
    return order


def _distinct_columns(d: np.ndarray) -> np.ndarray:
    """The distinct columns of `d` (any order): grouped by a random projection (equal columns
    give bit-equal keys), checked exactly; `np.unique(axis=1)` (a full sort) if a key collides."""
    if d.shape[1] < 2:
        return d
    keys = np.random.default_rng(0).standard_normal(d.shape[0]) @ d
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    kept = d[:, first]
    return kept if np.array_equal(kept[:, inverse.reshape(-1)], d) else np.unique(d, axis=1)


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
CPU_SWITCH_BANDWIDTH_BPS = 0.5e9  # all ranks together: weights + AdamW state per second


def direct_switch_cost_s(
    state_bytes: float, bandwidth_bps: float | None = None, constant_s: float = DIRECT_SWITCH_CONSTANT_S
) -> float:
    """Prior cost of one direct layout switch: constant + state / bandwidth, where `state_bytes`
    (weights + AdamW moments, all ranks) bounds the bytes that change owner and `bandwidth_bps`
    is the world's aggregate rate (None: the CPU figure measured here)."""
    bw = CPU_SWITCH_BANDWIDTH_BPS if bandwidth_bps is None else bandwidth_bps
    if state_bytes < 0 or bw <= 0:
        raise ValueError(
            f"state_bytes={state_bytes}, bandwidth_bps={bw} are invalid; allowed: state >= 0, bandwidth > 0"
        )
    return float(constant_s + state_bytes / bw)
