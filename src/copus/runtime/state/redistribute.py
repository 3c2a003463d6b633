"""Direct layout switch: move model and AdamW shards from the old layout to the new one in memory.

`redistribute(old, new)` (collective, same world, every rank at the same step boundary) fills a
meta-device engine `new` (`Engine(..., allocate=False)`) from the live engine `old`:

1. describe — each rank lists, per parameter name, its layout under each layout: the full shape,
   the mesh (shape and rank grid) and the placements (`core.reshard.Layout`; the local box it
   implies is checked against the local shape), the dtype and the AdamW entries: tensors with
   the parameter's placements (`exp_avg`, `exp_avg_sq`) are moved like the parameter, 0-dim ones
   (`step`) are copied. Such a description is the same on every rank of a pipeline stage, so
   ranks exchange only a digest of theirs (one small `all_gather_object`), and each distinct
   description is broadcast once by the lowest rank holding it: pp_old + pp_new descriptions,
   not world × the stage's. Anything else (a placement other than shard/replicate, a moment
   shaped otherwise, tied weights) makes every rank return the same reason instead, and the
   caller falls back to DCP staging.
2. plan — each rank derives only the pieces it sends or receives (`core.reshard.rank_pieces`,
   chunk arithmetic on the two layouts: O(boxes overlapping its own), the same pieces the global
   `plan_pieces` gives restricted to that rank), the same order of the parameters on every rank,
   keeping each rank's "allocated − freed" balance small (`memory_order` over the per-rank
   volumes, vectorised per layout), and buckets of at most `cap` bytes (default: the largest
   parameter with its moments, i.e. one parameter's worth in flight). A rank-local refusal is
   agreed on with one small `all_gather_object` of the reason.
3. move — per bucket: materialise the new shards of its parameters (`to_empty` of the owning
   module only, moments `empty_like`), copy the pieces a rank keeps, exchange the others with ONE
   `all_to_all_single` per dtype over the default process group (gloo on CPU, NCCL on GPU),
   then free the old shards of those parameters (storage resized to 0) before the next bucket.
4. finish — remaining meta buffers (RoPE) are recomputed, `new.finish_build()` builds AdamW
   over the new parameters, whose state is installed directly (same tensors the DCP path would
   load) along with the old param groups' hyperparameters.

Memory (this rank, accounted exactly over the tensors it holds and reported as `tracked_peak`):
at a bucket boundary it holds the new shards of the buckets done and the old shards of the
buckets to come; inside a bucket, in addition, the bucket's new shards, a send buffer and a
receive buffer, each at most `cap` bytes. So peak ≤ max over boundaries (Σ done new + Σ pending
old) + 3·cap, never the two layouts' full states at once unless one bucket holds them.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from copus.core.plan.reshard import (
    Box,
    Layout,
    Mesh,
    Piece,
    UnsupportedLayout,
    box_of,
    buckets,
    placed_volumes,
    local_box,
    memory_order,
    rank_pieces,
    volume,
)
from copus.runtime.engine.model import reset_rope


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveStats:
    """This rank's figures of one direct redistribution (bytes) and its phase times (s)."""

    describe_s: float
    move_s: float
    finish_s: float
    bytes_sent: int  # to other ranks
    bytes_received: int
    bytes_local: int  # copied within this rank (owner unchanged)
    buckets: int
    collectives: int  # all_to_all_single calls (all ranks make the same ones)
    cap_bytes: int  # bucket size limit
    old_bytes: int  # this rank's moved state under the old layout
    new_bytes: int  # ... under the new layout
    tracked_peak_bytes: int  # max over the switch of the moved state this rank held

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------ describe


def _placement(p) -> tuple:
    if isinstance(p, _StridedShard):
        return ("SS", int(p.dim), int(p.split_factor))
    if isinstance(p, Shard):
        return ("S", int(p.dim))
    if isinstance(p, Replicate):
        return ("R",)
    raise UnsupportedLayout(f"placement {p}; allowed: Shard, _StridedShard, Replicate")


def _box(t: DTensor) -> Box:
    """This rank's box of DTensor `t`, checked against its local shape."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    box = local_box(tuple(t.shape), tuple(mesh.shape), tuple(coord), [_placement(p) for p in t.placements])
    if tuple(hi - lo for lo, hi in box) != tuple(t.to_local().shape):
        raise UnsupportedLayout(f"computed shard {box} does not match the local shape {tuple(t.to_local().shape)}")
    return box


def _layout(t: DTensor, meshes: dict) -> Layout:
    """DTensor `t` as a `Layout` (its mesh shared by every parameter on that mesh)."""
    mesh = t.device_mesh
    m = meshes.get(id(mesh))
    if m is None:
        m = meshes[id(mesh)] = (mesh, Mesh(tuple(mesh.shape), mesh.mesh.flatten().tolist()))
    _box(t)  # the arithmetic agrees with the local shape
    return Layout(tuple(t.shape), m[1], tuple(_placement(p) for p in t.placements))


def describe(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """{"params": {name: (layout, dtype, moved keys, scalars, key order)}, "problem": str};
    no rank-specific entry, so every rank of a stage describes it identically."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    meshes: dict = {}
    try:
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                raise UnsupportedLayout(f"{name} shares its tensor with another parameter")
            seen.add(id(p))
            if not isinstance(p, DTensor):
                raise UnsupportedLayout(f"{name} is not a DTensor")
            moved, scalars = [], {}
            state = optimizer.state.get(p, {}) if optimizer is not None else {}
            for key, v in state.items():
                if (
                    isinstance(v, DTensor)
                    and v.shape == p.shape
                    and v.placements == p.placements
                    and v.dtype == p.dtype
                ):
                    moved.append(key)
                elif (
                    isinstance(v, torch.Tensor)
                    and not isinstance(v, DTensor)
                    and v.ndim == 0
                    and str(v.dtype) in _SCALAR_DTYPES
                ):
                    scalars[key] = (v.item(), str(v.dtype), v.device.type)
                else:
                    raise UnsupportedLayout(
                        f"optimizer state {name}.{key} is neither shaped like the parameter nor a scalar"
                    )
            out[name] = (_layout(p, meshes), str(p.dtype), tuple(moved), scalars, tuple(state))
    except UnsupportedLayout as err:
        return {"params": {}, "problem": str(err)}
    return {"params": out, "problem": ""}


def share(old_desc: dict, new_desc: dict) -> tuple[list[dict], list[dict]] | str:
    """Every distinct (old, new) description, in the order of the lowest rank holding it, or the
    first problem any rank reported (old layout first, as ranks are numbered). Collective: one
    all_gather_object of (digest, digest, problem, problem) per rank, then one broadcast per
    distinct description."""
    world, me = dist.get_world_size(), dist.get_rank()
    mine = (old_desc, new_desc)
    tags = tuple(hashlib.sha256(pickle.dumps(d, protocol=5)).hexdigest() for d in mine)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (*tags, old_desc["problem"], new_desc["problem"]))
    problems = [t[2] for t in everyone if t[2]] + [t[3] for t in everyone if t[3]]
    if problems:
        return problems[0]
    out: tuple[list[dict], list[dict]] = ([], [])
    for side in (0, 1):
        first: dict[str, int] = {}
        for rank, t in enumerate(everyone):
            first.setdefault(t[side], rank)
        for src in first.values():
            box = [mine[side] if src == me else None]
            dist.broadcast_object_list(box, src=src)
            out[side].append(box[0])
    return out


# ------------------------------------------------------------------------------------ plan

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
_SCALAR_DTYPES = {**_DTYPES, **{str(d): d for d in (torch.int64, torch.int32)}}


@dataclass
class _Plan:
    names: list[str]  # memory order (the same on every rank)
    pieces: dict[str, list[Piece]]  # this rank's: it sends or receives each one
    info: dict[str, tuple]  # name -> (shape, dtype, moved keys, scalars, key order)
    old_box: dict[str, dict[int, Box]]  # name -> {this rank: its old box} when it holds one
    new_box: dict[str, dict[int, Box]]
    groups: list[list[str]]
    cap: int


def _layouts(descs: list[dict], info: dict | None) -> tuple[list[str], dict, dict] | str:
    """Names (first-seen order), info and grouped layout per name from the distinct
    descriptions: a name described on disjoint meshes (e.g. a norm sharded over the dp sub-mesh
    of each tp rank) gets one group per mesh."""
    names: list[str] = []
    info = {} if info is None else info
    fresh = not info
    lay: dict[str, list[Layout]] = {}
    for d in descs:
        for name, (layout, dtype, moved, scalars, keys) in d["params"].items():
            if fresh and name in info and info[name][:3] != (layout.shape, dtype, moved):
                return f"{name}: ranks disagree on its shape, dtype or optimizer state"
            if not fresh and (name not in info or info[name][:2] != (layout.shape, dtype)):
                return f"{name}: not in the old layout with the same shape and dtype"
            if name in lay:
                if layout in lay[name]:
                    continue
                if any(set(g.mesh.ranks) & set(layout.mesh.ranks) for g in lay[name]):
                    return f"{name}: ranks disagree on its layout"
                lay[name].append(layout)
                continue
            if fresh:
                info[name] = (layout.shape, dtype, moved, scalars, keys)
            names.append(name)
            lay[name] = [layout]
    return names, info, {k: tuple(v) for k, v in lay.items()}


def make_plan(old_descs: list[dict], new_descs: list[dict], me: int, world: int, cap: int | None) -> _Plan | str:
    """This rank's part of the switch from the distinct descriptions (`share`): the same names
    order and buckets on every rank, the pieces `me` sends or receives, or why it cannot be."""
    found = _layouts(old_descs, None)
    if isinstance(found, str):
        return found
    names, info, old_lay = found
    found = _layouts(new_descs, info)
    if isinstance(found, str):
        return found
    _, _, new_lay = found
    if set(new_lay) != set(info):
        return f"parameters {sorted(set(info) - set(new_lay))[:3]} are missing in the new layout"
    if any(dtype not in _DTYPES for _, dtype, *_ in info.values()):
        return "a parameter dtype is not a floating type"
    pieces, deltas, sizes = {}, [], []
    old_box: dict[str, dict[int, Box]] = {}
    new_box: dict[str, dict[int, Box]] = {}
    volumes: dict[tuple[Layout, ...], Any] = {}
    for name in names:
        shape, dtype, moved = info[name][:3]
        old, new = old_lay[name], new_lay[name]
        for lay, boxes in ((old, old_box), (new, new_box)):
            box = box_of(lay, me)
            boxes[name] = {} if box is None else {me: box}
        try:
            pieces[name] = rank_pieces(old, new, me) if old_box[name] or new_box[name] else []
        except UnsupportedLayout as err:
            return f"{name}: {err}"
        per = (1 + len(moved)) * _DTYPES[dtype].itemsize
        for lay in (old, new):
            if lay not in volumes:
                volumes[lay] = placed_volumes(lay, world)
        deltas.append(per * (volumes[new] - volumes[old]))
        sizes.append(per * volume(tuple((0, n) for n in shape)))
    order_idx = memory_order(deltas)
    order = [names[i] for i in order_idx]
    cap = int(cap or max(sizes, default=1))
    groups = [[order[i] for i in g] for g in buckets([sizes[i] for i in order_idx], cap)]
    return _Plan(order, pieces, info, old_box, new_box, groups, cap)


# ------------------------------------------------------------------------------------ move


def _rel(box: Box, within: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(box, within, strict=True))


def _locals(model: torch.nn.Module, optimizer, name: str, keys: tuple) -> list[torch.Tensor]:
    p = model.get_parameter(name)
    state = optimizer.state[p] if keys else {}
    return [p.to_local(), *(state[k].to_local() for k in keys)]


def _free(tensors: list[torch.Tensor]) -> int:
    freed = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.resizable():
            freed += storage.nbytes()
            storage.resize_(0)
    return freed


class _Mover:
    """Executes a `_Plan` on this rank; keeps the byte accounting."""

    def __init__(self, plan: _Plan, old, new, device: torch.device) -> None:
        self.plan, self.old, self.new, self.device = plan, old, new, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.new_state: dict[str, dict[str, DTensor]] = {}
        self.done_modules: set[str] = set()
        self.sent = self.received = self.local = self.collectives = 0
        self.held = self.old_bytes = sum(self._bytes(n, plan.old_box) for n in plan.names)
        self.new_bytes = sum(self._bytes(n, plan.new_box) for n in plan.names)
        self.peak = self.held

    def _bytes(self, name: str, boxes: dict[str, dict[int, Box]]) -> int:
        box = boxes[name].get(self.rank)
        if box is None:
            return 0
        _, dtype, moved = self.plan.info[name][:3]
        return volume(box) * (1 + len(moved)) * _DTYPES[dtype].itemsize

    def _track(self, delta: int) -> None:
        self.held += delta
        self.peak = max(self.peak, self.held)

    def _materialise(self, name: str) -> list[torch.Tensor]:
        """This rank's new shard of `name` (owning module `to_empty`'d) and its moments."""
        module_name = name.rpartition(".")[0]
        if module_name not in self.done_modules:
            self.new.model.get_submodule(module_name).to_empty(device=self.device, recurse=False)
            self.done_modules.add(module_name)
        p = self.new.model.get_parameter(name)
        moments = {k: torch.empty_like(p) for k in self.plan.info[name][2]}
        self.new_state[name] = moments
        self._track(self._bytes(name, self.plan.new_box))
        return [p.to_local(), *(m.to_local() for m in moments.values())]

    @torch.no_grad()
    def bucket(self, names: list[str]) -> None:
        plan, me = self.plan, self.rank
        keys = {n: plan.info[n][2] for n in names}
        dst_t = {n: self._materialise(n) for n in names if me in plan.new_box[n]}
        src_t = {n: _locals(self.old.model, self.old.optimizer, n, keys[n]) for n in names if me in plan.old_box[n]}
        for dtype in sorted({plan.info[n][1] for n in names}):
            group = [n for n in names if plan.info[n][1] == dtype]
            self._exchange(group, src_t, dst_t, _DTYPES[dtype])
        for n in names:
            if n in src_t:
                _free(src_t[n])
                self._track(-self._bytes(n, plan.old_box))

    def _exchange(self, names: list[str], src_t: dict, dst_t: dict, dtype: torch.dtype) -> None:
        plan, me = self.plan, self.rank
        send: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        recv_counts = [0] * self.world
        unpack: list[list[tuple[list[torch.Tensor], tuple[slice, ...]]]] = [[] for _ in range(self.world)]
        for n in names:
            nt = 1 + len(plan.info[n][2])
            for pc in plan.pieces[n]:
                if pc.src == pc.dst:
                    if pc.src == me:
                        a = _rel(pc.box, plan.old_box[n][me])
                        b = _rel(pc.box, plan.new_box[n][me])
                        for s, d in zip(src_t[n], dst_t[n], strict=True):
                            d[b].copy_(s[a])
                        self.local += volume(pc.box) * nt * dtype.itemsize
                    continue
                if pc.src == me:
                    a = _rel(pc.box, plan.old_box[n][me])
                    send[pc.dst] += [s[a].reshape(-1) for s in src_t[n]]
                if pc.dst == me:
                    recv_counts[pc.src] += volume(pc.box) * nt
                    unpack[pc.src].append((dst_t[n], _rel(pc.box, plan.new_box[n][me])))
        # every rank joins the exchange (a rank without pieces sends and receives nothing):
        # which ranks have traffic is known per rank only, not globally as before
        send_counts = [sum(t.numel() for t in parts) for parts in send]
        flat = [t for parts in send for t in parts]
        inp = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=self.device)
        out = torch.empty(sum(recv_counts), dtype=dtype, device=self.device)
        self._track((inp.numel() + out.numel()) * dtype.itemsize)
        dist.all_to_all_single(out, inp, output_split_sizes=recv_counts, input_split_sizes=send_counts)
        self.collectives += 1
        self.sent += inp.numel() * dtype.itemsize
        self.received += out.numel() * dtype.itemsize
        off = 0
        for src in range(self.world):
            for targets, where in unpack[src]:
                for d in targets:
                    n = d[where].numel()
                    d[where].copy_(out[off : off + n].view(d[where].shape))
                    off += n
        self._track(-(inp.numel() + out.numel()) * dtype.itemsize)
        del inp, out

    def finish(self) -> None:
        """Meta buffers, AdamW over the new parameters, its state and param-group settings."""
        model = self.new.model
        for module in model.modules():
            for key, buf in list(module._buffers.items()):
                if buf is not None and buf.is_meta:
                    module._buffers[key] = torch.empty_like(buf, device=self.device)
        reset_rope(model)
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left:
            raise RuntimeError(f"direct switch left parameters unfilled: {left[:3]}")
        self.new.finish_build()
        opt = self.new.optimizer
        for name, p in model.named_parameters():
            _, _, moved, scalars, key_order = self.plan.info[name]
            if not key_order:
                continue
            moments = self.new_state.pop(name)
            opt.state[p] = {k: moments[k] if k in moved else self._scalar(*scalars[k]) for k in key_order}
        old_groups = self.old.optimizer.param_groups
        if len(old_groups) != len(opt.param_groups):
            raise RuntimeError("direct switch: the new optimizer has other parameter groups")
        for new_g, old_g in zip(opt.param_groups, old_groups, strict=True):
            new_g.update({k: v for k, v in old_g.items() if k != "params"})

    def _scalar(self, value: float, dtype: str, device_type: str) -> torch.Tensor:
        """A 0-dim entry (AdamW `step`: on the CPU unless capturable/fused) on its device; the
        value travelled as a Python number (exact for float32/float64/int entries)."""
        device = torch.device("cpu") if device_type == "cpu" else self.device
        return torch.tensor(value, dtype=_SCALAR_DTYPES[dtype], device=device)


def redistribute(old, new, *, cap_bytes: int | None = None) -> MoveStats | str:
    """Fill the meta engine `new` from `old` (see module docstring); collective. Returns the
    figures, or — identically on every rank, before anything changed — why it cannot apply.
    `old` keeps its (now empty) model and optimizer; the caller closes it."""
    t0 = time.perf_counter()
    for module in old.model.modules():  # sharded parameters registered (a pipeline stage
        if isinstance(module, FSDPModule):  # without resharding may hold them gathered)
            module.reshard()
    shared = share(describe(old.model, old.optimizer), describe(new.model, None))
    if isinstance(shared, str):
        return shared
    plan = make_plan(*shared, dist.get_rank(), dist.get_world_size(), cap_bytes)
    problems: list[Any] = [None] * dist.get_world_size()  # a rank-local refusal: all agree
    dist.all_gather_object(problems, plan if isinstance(plan, str) else "")
    problem = next((p for p in problems if p), "")
    if problem:
        return problem
    assert not isinstance(plan, str)
    t1 = time.perf_counter()
    mover = _Mover(plan, old, new, new.device)
    for group in plan.groups:
        mover.bucket(group)
    t2 = time.perf_counter()
    mover.finish()
    t3 = time.perf_counter()
    return MoveStats(
        describe_s=t1 - t0,
        move_s=t2 - t1,
        finish_s=t3 - t2,
        bytes_sent=mover.sent,
        bytes_received=mover.received,
        bytes_local=mover.local,
        buckets=len(plan.groups),
        collectives=mover.collectives,
        cap_bytes=plan.cap,
        old_bytes=mover.old_bytes,
        new_bytes=mover.new_bytes,
        tracked_peak_bytes=mover.peak,
    )
