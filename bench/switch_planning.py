"""Benchmark: planning one direct layout switch, per rank, on synthetic Llama-3 descriptions.

Hypothesis: the direct switch's planning (runtime/state/redistribute.py) costs O(world² × tensors)
Python on every rank when every rank gathers every rank's per-parameter boxes and derives the
whole plan (`before`); deriving only the pieces a rank sends or receives from the two layouts'
chunk arithmetic (`after`, `core.reshard.rank_pieces`) costs O(tensors × overlap) plus the
vectorised per-rank volumes for the memory order.

Run: nothing distributed. For each scale the engine's placements are reproduced (mesh (pp, dp,
tp) row-major; FSDP dim 0 over TP: colwise weights `_StridedShard(0, tp)` + `Shard(0)`, rowwise
`Shard(0)` + `Shard(1)`, norms `Shard(0)` + `Replicate`; stage s holds an even share of the
layers, the embedding on the first stage, norm and head on the last).

- before: what every rank did — unpickle world × (old, new) per-rank descriptions (what
  `all_gather_object` hands it) and run the previous global `make_plan` (copied below, with the
  previous `memory_order`).
- after: what a rank does now — unpickle the distinct descriptions (one per stage and tp rank
  and layout, what `share` broadcasts) and run `redistribute.make_plan` for that rank; the slowest of
  ranks {0, W/2, W−1} is reported.

Bytes received per rank by the description exchange are reported for both.

Writes bench/results/switch_planning.json and .md.
Run: python bench/switch_planning.py [--before-max-world 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from copus.core.plan.reshard import Layout, Mesh, buckets, local_box, plan_pieces, volume
from copus.runtime.state import redistribute as rd

OUT = Path(__file__).resolve().parent / "results" / "switch_planning"


@dataclass(frozen=True)
class Shape:
    name: str
    dim: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int = 128256


SHAPES = {
    "8B": Shape("8B", 4096, 14336, 32, 32, 8),
    "70B": Shape("70B", 8192, 28672, 80, 64, 8),
    "405B": Shape("405B", 16384, 53248, 126, 128, 8),
}
# (model, (pp, dp, tp) before, (pp, dp, tp) after): the 70B pair differs only in dp
CASES = [
    ("8B", (1, 8, 1), (1, 4, 2)),
    ("70B", (1, 8, 8), (2, 4, 8)),
    ("70B", (1, 32, 8), (2, 16, 8)),
    ("405B", (4, 16, 8), (8, 8, 8)),
]
COL, ROW, NORM = "col", "row", "norm"


def parameters(s: Shape) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, shape, kind, layer or -1 first / -2 last) in the model's order."""
    hd = s.dim // s.heads
    out = [("tok_embeddings.weight", (s.vocab, s.dim), COL, -1)]
    for i in range(s.layers):
        p = f"layers.{i}."
        out += [
            (p + "attention.wq.weight", (s.heads * hd, s.dim), COL, i),
            (p + "attention.wk.weight", (s.kv_heads * hd, s.dim), COL, i),
            (p + "attention.wv.weight", (s.kv_heads * hd, s.dim), COL, i),
            (p + "attention.wo.weight", (s.dim, s.heads * hd), ROW, i),
            (p + "feed_forward.w1.weight", (s.ffn, s.dim), COL, i),
            (p + "feed_forward.w2.weight", (s.dim, s.ffn), ROW, i),
            (p + "feed_forward.w3.weight", (s.ffn, s.dim), COL, i),
            (p + "attention_norm.weight", (s.dim,), NORM, i),
            (p + "ffn_norm.weight", (s.dim,), NORM, i),
        ]
    return out + [("norm.weight", (s.dim,), NORM, -2), ("output.weight", (s.vocab, s.dim), COL, -2)]


def stage_of(layer: int, layers: int, pp: int) -> int:
    if layer == -1:
        return 0
    if layer == -2:
        return pp - 1
    return min(layer * pp // layers, pp - 1)


def placements(kind: str, tp: int) -> tuple:
    if tp == 1:
        return (("S", 0),)
    return {COL: (("SS", 0, tp), ("S", 0)), ROW: (("S", 0), ("S", 1)), NORM: (("S", 0), ("R",))}[kind]


def stage_meshes(pp: int, dp: int, tp: int) -> list[Mesh]:
    grid = np.arange(pp * dp * tp).reshape(pp, dp, tp)
    return [Mesh((dp, tp) if tp > 1 else (dp,), grid[s].reshape(-1).tolist()) for s in range(pp)]


SCALARS = {"step": (10.0, "torch.float32", "cpu")}
KEYS = ("step", "exp_avg", "exp_avg_sq")
MOVED = ("exp_avg", "exp_avg_sq")


def new_descriptions(s: Shape, layout: tuple[int, int, int], with_optim: bool) -> list[dict]:
    """The distinct descriptions of one layout, as `redistribute.describe` writes them: one per
    (stage, tp rank), since a norm lives on the dp sub-mesh of its tp rank (a mesh of its own)."""
    pp, dp, tp = layout
    meshes = stage_meshes(pp, dp, tp)
    grid = np.arange(pp * dp * tp).reshape(pp, dp, tp)
    out = [{"params": {}, "problem": ""} for _ in range(pp * tp)]
    subs = {(st, j): Mesh((dp,), grid[st, :, j].tolist()) for st in range(pp) for j in range(tp)}
    for name, shape, kind, layer in parameters(s):
        st = stage_of(layer, s.layers, pp)
        for j in range(tp):
            lay = (
                Layout(shape, subs[st, j], (("S", 0),))
                if kind == NORM and tp > 1
                else Layout(shape, meshes[st], placements(kind, tp))
            )
            out[st * tp + j]["params"][name] = (
                lay,
                "torch.float32",
                MOVED if with_optim else (),
                SCALARS if with_optim else {},
                KEYS if with_optim else (),
            )
    return out


def old_descriptions(s: Shape, layout: tuple[int, int, int], with_optim: bool) -> list[dict]:
    """Every rank's description as the previous `describe` wrote it (its own box per name)."""
    pp, dp, tp = layout
    meshes = stage_meshes(pp, dp, tp)
    per_rank: list[dict] = [{"params": {}, "problem": ""} for _ in range(pp * dp * tp)]
    for name, shape, kind, layer in parameters(s):
        st = stage_of(layer, s.layers, pp)
        mesh, place = meshes[st], placements(kind, tp)
        for rank in mesh.ranks:
            box = local_box(shape, mesh.shape, mesh.coord(rank), place)
            per_rank[rank]["params"][name] = (
                shape,
                box,
                "torch.float32",
                MOVED if with_optim else (),
                SCALARS if with_optim else {},
                KEYS if with_optim else (),
            )
    return per_rank


# ------------------------------------------------------------- the previous algorithm (verbatim)


def old_memory_order(deltas):
    d = np.asarray(deltas, dtype=np.float64).reshape(len(deltas), -1)
    run = np.zeros(d.shape[1])
    left = np.ones(len(d), dtype=bool)
    order = []
    for _ in range(len(d)):
        worst = np.where(left, (run + d).max(axis=1, initial=-np.inf), np.inf)
        best = int(np.argmin(worst))
        order.append(best)
        left[best] = False
        run += d[best]
    return order


def old_make_plan(old_all: list[dict], new_all: list[dict], cap: int | None):
    """The previous `redistribute.make_plan`: the whole plan from every rank's boxes."""
    names: list[str] = []
    info: dict = {}
    old_box: dict = {}
    new_box: dict = {}
    for rank, d in enumerate(old_all):
        for name, (shape, box, dtype, moved, scalars, keys) in d["params"].items():
            if name not in info:
                names.append(name)
                info[name] = (shape, dtype, moved, scalars, keys)
            old_box.setdefault(name, {})[rank] = box
    for rank, d in enumerate(new_all):
        for name, (_shape, box, *_rest) in d["params"].items():
            new_box.setdefault(name, {})[rank] = box
    world = len(old_all)
    pieces, deltas, sizes = {}, [], []
    for name in names:
        pieces[name] = plan_pieces(old_box[name], new_box[name])
    for name in names:
        shape, dtype, moved = info[name][:3]
        per = (1 + len(moved)) * 4
        deltas.append([per * (_vol(new_box[name], r) - _vol(old_box[name], r)) for r in range(world)])
        sizes.append(per * volume(tuple((0, n) for n in shape)))
    order = [names[i] for i in old_memory_order(deltas)]
    ordered_sizes = [sizes[names.index(n)] for n in order]
    cap = int(cap or max(sizes, default=1))
    groups = [[order[i] for i in g] for g in buckets(ordered_sizes, cap)]
    return order, pieces, old_box, new_box, groups


def _vol(boxes, rank):
    return volume(boxes[rank]) if rank in boxes else 0


# ------------------------------------------------------------------------------------ measure


def time_before(model: str, old_l, new_l) -> dict:
    s = SHAPES[model]
    world = int(np.prod(old_l))
    blobs = [
        pickle.dumps((o, n))
        for o, n in zip(old_descriptions(s, old_l, True), old_descriptions(s, new_l, False), strict=True)
    ]
    t0 = time.perf_counter()
    gathered = [pickle.loads(b) for b in blobs]
    t1 = time.perf_counter()
    order, pieces, _, _, groups = old_make_plan([g[0] for g in gathered], [g[1] for g in gathered], None)
    t2 = time.perf_counter()
    return {
        "unpickle_s": t1 - t0,
        "plan_s": t2 - t1,
        "total_s": t2 - t0,
        "bytes_received": sum(len(b) for b in blobs),
        "world": world,
        "order": order,
        "groups": groups,
        "pieces": pieces,
    }


def time_after(model: str, old_l, new_l, ranks: list[int]) -> dict:
    s = SHAPES[model]
    world = int(np.prod(old_l))
    olds, news = new_descriptions(s, old_l, True), new_descriptions(s, new_l, False)
    blobs = [pickle.dumps(d) for d in olds + news]
    digests = world * 2 * (64 + 40)  # (digest, digest, "", "") per rank, pickled
    per_rank = []
    plans = {}
    for me in ranks:
        t0 = time.perf_counter()
        descs = [pickle.loads(b) for b in blobs]
        t1 = time.perf_counter()
        plan = rd.make_plan(descs[: len(olds)], descs[len(olds) :], me, world, None)
        t2 = time.perf_counter()
        assert not isinstance(plan, str), plan
        plans[me] = plan
        per_rank.append({"rank": me, "unpickle_s": t1 - t0, "plan_s": t2 - t1, "total_s": t2 - t0})
    worst = max(per_rank, key=lambda r: r["total_s"])
    return {
        **{k: worst[k] for k in ("unpickle_s", "plan_s", "total_s")},
        "ranks": per_rank,
        "bytes_received": sum(len(b) for b in blobs) + digests,
        "world": world,
        "plans": plans,
    }


def same_plan(before: dict, after: dict) -> bool:
    """The after plan of each timed rank = the before plan restricted to that rank."""
    for me, plan in after["plans"].items():
        if plan.names != before["order"] or plan.groups != before["groups"]:
            return False
        for name, pcs in before["pieces"].items():
            if plan.pieces[name] != [p for p in pcs if me in (p.src, p.dst)]:
                return False
    return True


def label(model: str, layout) -> str:
    pp, dp, tp = layout
    return "".join(f"{k}{v}" for k, v in (("pp", pp), ("dp", dp), ("tp", tp)) if v > 1) or "dp1"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--before-max-world",
        type=int,
        default=256,
        help="measure the previous algorithm up to this world (it grows as world²)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for model, old_l, new_l in CASES:
        world = int(np.prod(old_l))
        ranks = sorted({0, world // 2, world - 1})
        afters, befores = [], []
        for rep in range(args.repeats):
            do_before = world <= args.before_max_world and (rep == 0 or world <= 64)
            first_after = rep % 2 == 0  # interleaved order
            if first_after:
                afters.append(time_after(model, old_l, new_l, ranks))
            if do_before:
                befores.append(time_before(model, old_l, new_l))
            if not first_after:
                afters.append(time_after(model, old_l, new_l, ranks))
        after = sorted(afters, key=lambda r: r["total_s"])[len(afters) // 2]
        before = sorted(befores, key=lambda r: r["total_s"])[len(befores) // 2] if befores else None
        row = {
            "model": model,
            "world": world,
            "old_layout": label(model, old_l),
            "new_layout": label(model, new_l),
            "tensors": len(parameters(SHAPES[model])),
            "after": {k: v for k, v in after.items() if k != "plans"},
            "after_repeats": [a["total_s"] for a in afters],
            "before": None
            if before is None
            else {k: before[k] for k in ("unpickle_s", "plan_s", "total_s", "bytes_received")},
            "before_repeats": [b["total_s"] for b in befores],
            "equal_to_before": None if before is None else same_plan(before, after),
        }
        rows.append(row)
        b = row["before"]["total_s"] if row["before"] else float("nan")
        print(
            f"{model}/{world} {row['old_layout']}>{row['new_layout']}: before {b:.2f} s, "
            f"after {row['after']['total_s']:.3f} s, equal={row['equal_to_before']}",
            flush=True,
        )
    by = {(r["model"], r["world"]): r for r in rows}
    growth_after = by[("70B", 256)]["after"]["total_s"] / by[("70B", 64)]["after"]["total_s"]
    b64, b256 = by[("70B", 64)]["before"], by[("70B", 256)]["before"]
    growth_before = b256["total_s"] / b64["total_s"] if b64 and b256 else None
    result = {
        "machine": platform.processor() or platform.machine(),
        "note": "2 CPU cores shared with other jobs; medians over repeats, interleaved order",
        "command": "python bench/switch_planning.py",
        "cases": rows,
        "growth_70B_64_to_256": {"before": growth_before, "after": growth_after},
        "goals": {
            "405B_512_after_s": by[("405B", 512)]["after"]["total_s"],
            "405B_512_ok": by[("405B", 512)]["after"]["total_s"] <= 5.0,
            "growth_ok": growth_after <= 4.5,
        },
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    OUT.with_suffix(".md").write_text(table(result))
    print(table(result))


def table(result: dict) -> str:
    lines = [
        "| model / world | switch | tensors | before s/rank | after s/rank (plan + unpickle) "
        "| bytes received before | after | equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cases"]:
        b = r["before"]
        lines.append(
            f"| {r['model']} / {r['world']} | {r['old_layout']} → {r['new_layout']} | "
            f"{r['tensors']} | {'%.2f' % b['total_s'] if b else 'not run'} | "
            f"{r['after']['total_s']:.3f} ({r['after']['plan_s']:.3f} + "
            f"{r['after']['unpickle_s']:.3f}) | "
            f"{'%.3g' % b['bytes_received'] if b else '—'} | "
            f"{r['after']['bytes_received']:.3g} | {r['equal_to_before']} |"
        )
    g = result["growth_70B_64_to_256"]
    lines.append("")
    lines.append(
        f"70B 64 → 256 ranks: before ×{g['before']:.1f}, after ×{g['after']:.2f}"
        if g["before"]
        else f"70B 64 → 256 ranks: after ×{g['after']:.2f}"
    )
    lines.append(f"({result['note']})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
