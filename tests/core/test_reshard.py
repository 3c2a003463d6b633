"""core/plan/reshard.py: shard boxes, the pieces a layout switch moves, memory order and buckets."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copus.core.plan.reshard import (
    Piece,
    UnsupportedLayout,
    buckets,
    chunk_range,
    intersect,
    local_box,
    memory_order,
    plan_pieces,
    volume,
)


@given(st.integers(0, 40), st.integers(1, 9))
@settings(max_examples=60, deadline=None)
def test_chunk_range_cuts_like_torch_chunk(n, parts):
    """torch.chunk: size ceil(n/parts), trailing chunks short or missing (here: empty)."""
    size = -(-n // parts) if n else 0
    expected = [(min(i * size, n), min((i + 1) * size, n)) for i in range(parts)]
    got = [chunk_range(0, n, parts, i) for i in range(parts)]
    assert got == expected
    assert sum(hi - lo for lo, hi in got) == n  # the pieces tile [0, n)


def test_fsdp_over_tp_box_follows_the_strided_shard():
    """rows 8, mesh (dp=2, tp=2), placements (_StridedShard(0, sf=2), Shard(0)): TP cuts first,
    then FSDP cuts each TP shard (the right-to-left order of the DTensor docstring)."""
    place = [("SS", 0, 2), ("S", 0)]
    boxes = {c: local_box((8, 3), (2, 2), c, place) for c in itertools.product(range(2), range(2))}
    assert boxes[(0, 0)] == ((0, 2), (0, 3)) and boxes[(0, 1)] == ((4, 6), (0, 3))
    assert boxes[(1, 0)] == ((2, 4), (0, 3)) and boxes[(1, 1)] == ((6, 8), (0, 3))
    row_tp = {c: local_box((8, 6), (2, 2), c, [("S", 0), ("S", 1)]) for c in itertools.product(range(2), range(2))}
    assert row_tp[(1, 0)] == ((4, 8), (0, 3))  # FSDP dim 0, TP dim 1
    assert local_box((5,), (2, 2), (0, 1), [("S", 0), ("R",)]) == ((0, 3),)
    with pytest.raises(UnsupportedLayout, match="split factor 4"):
        local_box((8, 3), (2, 2), (0, 0), [("SS", 0, 4), ("S", 0)])
    with pytest.raises(UnsupportedLayout, match="placement"):
        local_box((8,), (2,), (0,), [("P", "sum")])


def _fill(pieces: list[Piece], new: dict) -> dict:
    """Element → source rank for each destination, from the pieces."""
    got: dict = {}
    for pc in pieces:
        for idx in itertools.product(*(range(lo, hi) for lo, hi in pc.box)):
            assert idx not in got.setdefault(pc.dst, {}), (pc, idx)  # each element once
            got[pc.dst][idx] = pc.src
    for dst, box in new.items():
        assert len(got.get(dst, {})) == volume(box)
    return got


def test_pieces_cover_each_new_box_once_and_prefer_a_local_replica():
    # dp4 (rows in 4 chunks) -> dp2·tp2 rowwise: dp-major mesh, TP shards dim 1
    shape, old, new = (8, 4), {}, {}
    for r in range(4):
        old[r] = local_box(shape, (4,), (r,), [("S", 0)])
        new[r] = local_box(shape, (2, 2), (r // 2, r % 2), [("S", 0), ("S", 1)])
    pieces = plan_pieces(old, new)
    got = _fill(pieces, new)
    assert all(src in (0, 1) for src in got[0].values())  # rows 0-3 lived on ranks 0, 1
    # a replicated norm weight (tp2: two replicas per dp rank) -> dp4: each rank keeps its own
    old_r = {r: local_box((8,), (2, 2), (r // 2, r % 2), [("S", 0), ("R",)]) for r in range(4)}
    new_r = {r: local_box((8,), (4,), (r,), [("S", 0)]) for r in range(4)}
    pieces = plan_pieces(old_r, new_r)
    _fill(pieces, new_r)
    assert [(p.src, p.dst) for p in pieces] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    # a stage that held nothing: the other stage's ranks send everything
    pp = plan_pieces({0: ((0, 8),), 1: ((0, 8),)}, {2: ((0, 4),), 3: ((4, 8),)})
    assert [(p.src, p.dst, p.box) for p in pp] == [(0, 2, ((0, 4),)), (1, 3, ((4, 8),))]


def test_pieces_refuse_overlapping_or_missing_old_shards():
    with pytest.raises(UnsupportedLayout, match="covered"):
        plan_pieces({0: ((0, 5),), 1: ((3, 8),)}, {0: ((0, 8),)})
    with pytest.raises(UnsupportedLayout, match="covered 4 of 8"):
        plan_pieces({0: ((0, 4),)}, {0: ((0, 8),)})
    assert intersect(((0, 4),), ((4, 8),)) is None


def test_memory_order_keeps_every_rank_balanced():
    """Two stages swap halves: rank 0 gains on tensors 0-3 and loses on 4-7, rank 1 the
    opposite. Layer order would reach +4 on rank 0; the min-max order stays within one."""
    deltas = [[1, -1]] * 4 + [[-1, 1]] * 4
    order = memory_order(deltas)
    assert sorted(order) == list(range(8))
    run, worst = [0, 0], 0
    for i in order:
        run = [run[r] + deltas[i][r] for r in range(2)]
        worst = max(worst, *run)
    assert worst <= 1


def test_buckets_are_consecutive_and_capped():
    assert buckets([3, 3, 3, 5, 1, 9, 1], cap=6) == [[0, 1], [2], [3, 4], [5], [6]]
    assert buckets([], cap=4) == []


def test_direct_switch_cost_prior_grows_with_the_state():
    from copus.core.plan.reshard import DIRECT_SWITCH_CONSTANT_S, direct_switch_cost_s

    assert direct_switch_cost_s(0.0) == DIRECT_SWITCH_CONSTANT_S
    assert direct_switch_cost_s(4e9, 2e9, constant_s=0.1) == pytest.approx(2.1)
    assert direct_switch_cost_s(1e9) < direct_switch_cost_s(2e9)
    with pytest.raises(ValueError, match="bandwidth_bps=0"):
        direct_switch_cost_s(1.0, 0.0)


# ---------------------------------------------------------- per-rank planning = global plan restricted


def _patterns(ndim: int, tp: int) -> list[tuple]:
    """Placements the engine produces on a (dp, tp) mesh (FSDP dim 0 over TP), plus replicas."""
    if tp == 1:
        return [(("S", 0),), (("R",),)]
    out = [(("SS", 0, tp), ("S", 0)), (("S", 0), ("R",)), (("R",), ("S", 0)), (("R",), ("R",))]
    if ndim == 2:
        out += [(("S", 0), ("S", 1)), (("R",), ("S", 1))]
    return out


@st.composite
def _layouts(draw, world: int, shape: tuple[int, ...]):
    """A random (pp, dp, tp) factorisation of `world`, a stage and a placement pattern."""
    from copus.core.plan.reshard import Layout, Mesh

    splits = [
        (pp, dp, world // (pp * dp))
        for pp in range(1, world + 1)
        if world % pp == 0
        for dp in range(1, world // pp + 1)
        if (world // pp) % dp == 0
    ]
    pp, dp, tp = draw(st.sampled_from(splits))
    stage = draw(st.integers(0, pp - 1))
    perm = draw(st.permutations(range(world)))
    ranks = [perm[stage * dp * tp + i] for i in range(dp * tp)]
    if tp > 1 and draw(st.booleans()):  # per tp rank, a dp sub-mesh of its own (FSDP'd norms)
        return tuple(Layout(shape, Mesh((dp,), ranks[j::tp]), (("S", 0),)) for j in range(tp))
    place = draw(st.sampled_from(_patterns(len(shape), tp)))
    mesh = Mesh((dp, tp), ranks) if tp > 1 else Mesh((dp,), ranks)
    return Layout(shape, mesh, place)


@st.composite
def _switch(draw):
    world = draw(st.integers(1, 8))
    shape = tuple(draw(st.lists(st.integers(1, 13), min_size=1, max_size=2)))
    return world, draw(_layouts(world, shape)), draw(_layouts(world, shape))


@given(_switch())
@settings(max_examples=300, deadline=None)
def test_rank_pieces_are_the_global_plan_restricted_to_each_rank(case):
    """Chunk arithmetic per rank (`rank_pieces`) = `plan_pieces` over every rank's box, keeping
    the pieces the rank sends or receives: same sources, destinations and boxes."""
    from copus.core.plan.reshard import Layout, placed_volumes, rank_pieces

    world, old, new = case

    def every_box(placed) -> dict:
        groups = (placed,) if isinstance(placed, Layout) else placed
        return {r: g.box_of(r) for g in groups for r in g.mesh.ranks}

    old_boxes, new_boxes = every_box(old), every_box(new)
    everything = plan_pieces(old_boxes, new_boxes)
    for me in range(world):
        assert rank_pieces(old, new, me) == [p for p in everything if me in (p.src, p.dst)]
    for lay, boxes in ((old, old_boxes), (new, new_boxes)):
        assert placed_volumes(lay, world).tolist() == [volume(boxes[r]) if r in boxes else 0 for r in range(world)]


def test_rank_pieces_visit_only_the_overlapping_boxes():
    """512 ranks, dp512 → dp256·tp2 rowwise: a rank meets 2 old boxes, not 512."""
    import copus.core.plan.reshard as rs

    old = rs.Layout((4096, 1024), rs.Mesh((512,), range(512)), (("S", 0),))
    new = rs.Layout((4096, 1024), rs.Mesh((256, 2), range(512)), (("S", 0), ("S", 1)))
    calls = []
    real = rs.chunk_range
    try:
        rs.chunk_range = lambda *a: calls.append(a) or real(*a)
        pieces = rs.rank_pieces(old, new, 7)
    finally:
        rs.chunk_range = real
    assert {(p.src, p.dst) for p in pieces} == {(6, 7), (7, 7), (7, 6)}
    assert len(calls) < 40


def test_memory_order_is_unchanged_by_repeated_rank_columns():
    """Equal columns (ranks with the same balance) are kept once: the same order as before."""
    rng = __import__("numpy").random.default_rng(0)
    d = rng.integers(-3, 4, size=(12, 3))
    wide = __import__("numpy").repeat(d, [5, 1, 7], axis=1)
    assert memory_order(wide) == memory_order(d)
