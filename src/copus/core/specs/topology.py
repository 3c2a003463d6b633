"""Node topology from the launcher's environment, and which parallel groups cross nodes.

torchrun (and `torch.distributed.elastic` in general) tells every worker where it sits:

    WORLD_SIZE        workers in the whole job
    LOCAL_WORLD_SIZE  workers on this node (`--nproc-per-node`)
    GROUP_WORLD_SIZE  worker groups = nodes (agents) in the current rendezvous round
    ROLE_WORLD_SIZE   workers with this role (= WORLD_SIZE for a single-role job)
    GROUP_RANK        this node's index; RANK = GROUP_RANK · LOCAL_WORLD_SIZE + LOCAL_RANK

(PyTorch docs, "torchrun (Elastic Launch)", environment variables.) Ranks are therefore placed
`gpus_per_node` per node in order. copus's device mesh is (pp, dp, tp), outermost → innermost
(as torchtitan's), so

    rank = (pp_idx · dp + dp_idx) · tp + tp_idx

and a group of mesh dimension `dim` has `size` members at `stride` ranks apart:
tp (tp, 1), dp (dp, tp), pp (pp, dp·tp). Every group of one dimension lies in an aligned block
of `extent = size · stride` consecutive ranks. Such a group spans two nodes iff it has ≥ 2 members,
the world is larger than one node, and `gpus_per_node` is not a multiple of `extent`.
Proof sketch: if gpus_per_node = k·extent, node boundaries coincide with block boundaries; else
the block holding ranks gpus_per_node−1 and gpus_per_node contains members on both sides, since
within a block consecutive members are `stride` apart and every residue class mod stride occurs.

Pure: stdlib + numpy only. The step-time model (`copus.core.cost.throughput`) prices a crossing group
with the inter-node bandwidth; `profile_overrides` gives the `HardwareProfile` fields to change.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from copus.core.specs.hardware import HardwareProfile, with_overrides

DIMS = ("pp", "dp", "tp")  # mesh order, outermost → innermost


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeTopology:
    """`num_nodes` nodes with `gpus_per_node` workers each; `world_size` = their product."""

    world_size: int
    gpus_per_node: int
    num_nodes: int
    node_rank: int = 0

    def __post_init__(self) -> None:
        for field in ("world_size", "gpus_per_node", "num_nodes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}={value!r} is invalid; allowed: an integer >= 1")
        if self.world_size != self.gpus_per_node * self.num_nodes:
            raise ValueError(
                f"world_size={self.world_size} must equal gpus_per_node*num_nodes="
                f"{self.gpus_per_node}*{self.num_nodes} (copus needs the same worker count "
                "on every node)"
            )
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"node_rank={self.node_rank} is invalid; allowed: 0..{self.num_nodes - 1}")

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    def node_of(self, rank: int) -> int:
        """Node index of global `rank` (ranks fill nodes in order)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is invalid; allowed: 0..{self.world_size - 1}")
        return rank // self.gpus_per_node

    def resized(self, world_size: int) -> NodeTopology:
        """The same nodes' shape after an elastic membership change to `world_size` workers."""
        if world_size < 1 or world_size % self.gpus_per_node:
            raise ValueError(
                f"world_size={world_size} is invalid; allowed: a positive multiple "
                f"of gpus_per_node={self.gpus_per_node}"
            )
        return NodeTopology(
            world_size=world_size, gpus_per_node=self.gpus_per_node, num_nodes=world_size // self.gpus_per_node
        )


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is invalid; allowed: an integer >= 1") from None
    if value < (0 if key == "GROUP_RANK" else 1):
        raise ValueError(f"{key}={raw!r} is invalid; allowed: an integer >= 1")
    return value


def node_topology_from_env(env: Mapping[str, str] | None = None, world_size: int | None = None) -> NodeTopology:
    """The node topology the launcher describes in `env` (default `os.environ`).

    WORLD_SIZE (or ROLE_WORLD_SIZE, or `world_size` when not launched) workers; LOCAL_WORLD_SIZE
    per node; nodes = GROUP_WORLD_SIZE, else WORLD_SIZE / LOCAL_WORLD_SIZE. Without launcher
    variables the job is one node holding every worker. ValueError if the numbers disagree.
    """
    env = os.environ if env is None else env
    world = _env_int(env, "WORLD_SIZE") or _env_int(env, "ROLE_WORLD_SIZE") or world_size or 1
    local = _env_int(env, "LOCAL_WORLD_SIZE")
    groups = _env_int(env, "GROUP_WORLD_SIZE")
    if local is None:
        local = world // groups if groups and world % groups == 0 else world
    if groups is None:
        if world % local:
            raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
        groups = world // local
    if local * groups != world:
        raise ValueError(
            f"WORLD_SIZE={world} != LOCAL_WORLD_SIZE*GROUP_WORLD_SIZE={local}*{groups};"
            " allowed: the same --nproc-per-node on every node"
        )
    node_rank = _env_int(env, "GROUP_RANK") or 0
    return NodeTopology(world_size=world, gpus_per_node=local, num_nodes=groups, node_rank=node_rank)


def group_geometry(dim: str, dp, tp, pp) -> tuple[np.ndarray, np.ndarray]:
    """(size, stride) of the `dim` groups in mesh order (pp, dp, tp); broadcasts over arrays."""
    dp, tp, pp = np.asarray(dp), np.asarray(tp), np.asarray(pp)
    if dim == "tp":
        return tp, np.ones_like(tp)
    if dim == "dp":
        return dp, tp
    if dim == "pp":
        return pp, dp * tp
    raise ValueError(f"dim={dim!r} is invalid; allowed: 'tp', 'dp', 'pp'")


def crosses_nodes(dim: str, dp, tp, pp, gpus_per_node) -> np.ndarray:
    """Whether some `dim` group of layout (dp, tp, pp) spans two nodes (vectorised, bool array).

    True iff size ≥ 2, dp·tp·pp > gpus_per_node, and gpus_per_node mod (size·stride) ≠ 0
    (module docstring). For tp (stride 1) with dp·tp·pp > gpus_per_node: crossing iff tp does
    not divide gpus_per_node.
    """
    size, stride = group_geometry(dim, dp, tp, pp)
    world = np.asarray(dp) * np.asarray(tp) * np.asarray(pp)
    gpn = np.asarray(gpus_per_node)
    if np.any(gpn < 1):
        raise ValueError(f"gpus_per_node={gpus_per_node} is invalid; allowed: integers >= 1")
    return (size > 1) & (world > gpn) & (gpn % (size * stride) != 0)


def groups(dim: str, dp: int, tp: int, pp: int) -> list[list[int]]:
    """The explicit rank groups of mesh dimension `dim` (reference for `crosses_nodes`)."""
    size, stride = (int(x) for x in group_geometry(dim, dp, tp, pp))
    world = dp * tp * pp
    extent = size * stride
    return [
        [block + offset + i * stride for i in range(size)]
        for block in range(0, world, extent)
        for offset in range(stride)
    ]


def nodes_spanned(dim: str, dp: int, tp: int, pp: int, gpus_per_node: int) -> int:
    """Most nodes any one `dim` group touches (1 = the dimension stays inside nodes)."""
    return max(len({r // gpus_per_node for r in g}) for g in groups(dim, dp, tp, pp))


def crossing_dims(dp: int, tp: int, pp: int, gpus_per_node: int) -> tuple[str, ...]:
    """Mesh dimensions (in mesh order) whose groups cross nodes for this layout."""
    return tuple(d for d in DIMS if bool(crosses_nodes(d, dp, tp, pp, gpus_per_node)))


def profile_overrides(topology: NodeTopology, nvlink_group: int) -> dict[str, int]:
    """`HardwareProfile` fields that make a profile describe the launched nodes.

    gpus_per_node from the launcher; the fast domain shrinks to a divisor of it
    (gcd(nvlink_group, gpus_per_node)) so the profile stays valid, e.g.
    `hardware.with_overrides(profile, **profile_overrides(topo, profile.nvlink_group))`.
    """
    return dict(gpus_per_node=topology.gpus_per_node, nvlink_group=math.gcd(nvlink_group, topology.gpus_per_node))


def launched_hardware(
    profile: HardwareProfile, env: Mapping[str, str] | None = None, world_size: int | None = None
) -> HardwareProfile:
    """`profile` with the node shape the launcher reports in `env` (default `os.environ`).

    The step-time model then prices every tp/dp/pp group that `crosses_nodes` with the profile's
    inter-node bandwidth (tier 2 of `copus.core.specs.hardware`). Without launcher variables the
    profile is returned unchanged (a single process knows nothing about other nodes).
    """
    env = os.environ if env is None else env
    if not any(k in env for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE")):
        return profile
    topo = node_topology_from_env(env, world_size)
    return with_overrides(profile, **profile_overrides(topo, profile.nvlink_group))
