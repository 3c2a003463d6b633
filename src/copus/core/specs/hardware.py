"""Hardware profiles and the rank topology: what a step-time model needs to know about a cluster.

A `HardwareProfile` holds per-device datasheet figures (compute, memory, links) plus a few
software-stack coefficients (achieved MFU, per-block overhead, overlap). They are *priors*: the
fitted model (`copus.core.cost.fit`) replaces them with measured coefficients once steps are timed.

Links come in three tiers (COPUS §5.1 describes clusters whose fast links cover only a subset of
a node's GPUs, so a tensor-parallel group larger than that subset is slower):

    tier 0: inside one fully connected fast domain of `nvlink_group` devices (NVLink/NVSwitch, xGMI)
    tier 1: inside one node, across fast domains (PCIe)
    tier 2: across nodes (InfiniBand / Ethernet NIC)

Bandwidths are bytes/s per direction per device. Inter-node figures are the node's NIC bandwidth
divided by `gpus_per_node` when one NIC is shared by the whole node (a pessimistic but honest
prior: every data-parallel group crosses the NIC at the same time).

Rank order: torchtitan's and copus's device mesh is (pp, dp, tp), outermost → innermost, so
`rank = (pp_idx · dp + dp_idx) · tp + tp_idx`: tp ranks are contiguous, a dp group has stride tp
and spans `dp·tp` consecutive ranks, a pipeline hop jumps `dp·tp` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

GB = 1e9
GiB = 2**30
STACKS = ("fsdp2", "megatron")


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
    """Per-device figures of one accelerator type in one cluster layout.

    peak_flops: dense bf16 FLOP/s of one device (datasheet). mfu: achieved fraction of it on
    transformer training (model FLOPs utilisation). memory_bytes: device memory. memory_bw: device
    memory bandwidth (bytes/s; prices the optimizer step). intra_node_bw: tier-0 bandwidth, inside
    the fast domain; cross_group_bw: tier 1 (None = same as intra_node_bw); inter_node_bw: tier 2.
    latency_s: per-message latency of one collective step (alpha of the alpha-beta model).
    layer_overhead_s: fixed time per transformer block per micro-batch, forward + backward
    (kernel launches, Python). step_overhead_s: fixed time per optimizer step (gradient clipping
    all-reduce, bookkeeping). overlap_gamma: Pollux's overlap exponent, 1 = none, large = full.
    dtype_bytes: bytes per element of activations and all-gathered parameters (2 for bf16).
    """

    name: str
    peak_flops: float
    mfu: float
    memory_bytes: float
    memory_bw: float
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int
    nvlink_group: int
    latency_s: float
    cross_group_bw: float | None = None
    layer_overhead_s: float = 2e-4
    step_overhead_s: float = 5e-3
    overlap_gamma: float = 2.0
    dtype_bytes: int = 2
    # Software stack the profile describes (`copus.core.cost.throughput`): "fsdp2" (copus's runtime:
    # FSDP2 all-gathers per micro-batch, fp32 reduce-scatter) or "megatron" (Megatron-LM DDP as
    # COPUS ran it: replicated optimizer, one fp32 gradient all-reduce per step).
    stack: str = "fsdp2"
    # Megatron's distributed optimizer (ZeRO-1): fp32 grads reduce-scattered, bf16 params
    # all-gathered, optimizer state sharded over dp. COPUS ran without it (§4.4).
    distributed_optimizer: bool = False
    # One NIC shared by the whole node (SR-IOV / one Ethernet port): `inter_node_bw` is then the
    # node's bandwidth / gpus_per_node and a group with k members on a node gets k shares.
    shared_nic: bool = False
    # Per-GPU compute efficiency kept per doubling of the tensor-parallel degree (Megatron stack):
    # a TP rank computes at tp_efficiency^log2(tp) of its tp = 1 speed (narrower GEMMs, NCCL
    # kernels sharing SMs, launch gaps). 1.0 = ideal 1/tp scaling. docs/cost-model.md.
    tp_efficiency: float = 1.0
    # Roofline compute (`copus.core.cost.compute`): the maximum achievable matmul FLOPS as a
    # fraction of `peak_flops` (measured per GPU generation) and the fraction of peak flash
    # attention reaches. None: the plain FLOP count at `mfu` (the CPU profile).
    gemm_efficiency: float | None = None
    attention_efficiency: float | None = None
    # Sustained tensor-core clock under a matmul load relative to the datasheet's boost clock
    # (`power_clock`): < 1 for a card with less power per SM than the GPU its generation's
    # gemm_efficiency was measured on. Scales the roofline's peak, not `peak_flops` (MFU).
    power_clock: float = 1.0

    def __post_init__(self) -> None:
        for f in ("peak_flops", "memory_bytes", "memory_bw", "intra_node_bw", "inter_node_bw"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f}={getattr(self, f)!r} is invalid; allowed: a number > 0")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu={self.mfu!r} is invalid; allowed: 0 < mfu <= 1")
        for f in ("gemm_efficiency", "attention_efficiency"):
            v = getattr(self, f)
            if v is not None and not 0 < v <= 1:
                raise ValueError(f"{f}={v!r} is invalid; allowed: 0 < x <= 1, or None")
        if not 0 < self.power_clock <= 1:
            raise ValueError(f"power_clock={self.power_clock!r} is invalid; allowed: 0 < x <= 1")
        if (self.gemm_efficiency is None) != (self.attention_efficiency is None):
            raise ValueError("gemm_efficiency and attention_efficiency are set together; allowed: both or neither")
        if not 0 < self.tp_efficiency <= 1:
            raise ValueError(f"tp_efficiency={self.tp_efficiency!r} is invalid; allowed: 0 < x <= 1")
        if self.stack not in STACKS:
            raise ValueError(f"stack={self.stack!r} is invalid; allowed: {', '.join(STACKS)}")
        if self.gpus_per_node < 1 or self.nvlink_group < 1 or self.gpus_per_node % self.nvlink_group:
            raise ValueError(
                f"nvlink_group={self.nvlink_group} must be >= 1 and divide gpus_per_node={self.gpus_per_node}"
            )

    @property
    def sustained_flops(self) -> float:
        """peak_flops · power_clock: the dense bf16 FLOP/s the tensor cores sustain under load."""
        return self.peak_flops * self.power_clock

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.mfu

    @property
    def link_bw(self) -> tuple[float, float, float]:
        """Bandwidth (bytes/s per direction per device) of tiers 0, 1, 2."""
        mid = self.intra_node_bw if self.cross_group_bw is None else self.cross_group_bw
        return (self.intra_node_bw, mid, self.inter_node_bw)

    @property
    def tier_slowdown(self) -> tuple[float, float, float]:
        """Seconds per byte of each tier relative to tier 0 (1 for tier 0)."""
        bw = self.link_bw
        return (1.0, bw[0] / bw[1], bw[0] / bw[2])


# Per GPU generation: (gemm_efficiency, attention_efficiency). GEMM: maximum achievable matmul
# FLOPS (BF16, best shape) over the datasheet peak, S. Bekman, ml-engineering,
# compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table": A100 SXM
# 267.9/312 = 85.9 %, H100 SXM 792.1/989 = 80.1 %, MI250X one GCD 147.0/191.5 = 76.7 % (CDNA2,
# the MI210's generation). Attention: FlashAttention-2 forward + backward, causal, head dim 128,
# long sequences: ≈ 60 % of peak on A100 (Dao 2023, "FlashAttention-2", Fig. 5–6: 187–203
# TFLOP/s of 312), 35 % on H100 (Shah et al. 2024, "FlashAttention-3", §1); CDNA2 0.30
# (inferred: no published figure; ROCm's FlashAttention-2 port reaches less of peak than on A100).
GPU_GENERATIONS: dict[str, tuple[float, float]] = {
    "ampere": (0.859, 0.60),
    "hopper": (0.801, 0.35),
    "cdna2": (0.767, 0.30),
}


def power_clock(watts: float, units: int, ref_watts: float, ref_units: int) -> float:
    """Sustained clock relative to boost of a card with `watts` over `units` SMs (CUs) against
    the card its generation's gemm_efficiency was measured on: min(1, sqrt(w/u ÷ w_ref/u_ref)).

    Dynamic power ∝ f·V² with V rising with f over the DVFS range, P ∝ f² (inferred, not
    measured): a power-capped card sustains the square root of its power share per SM.
    """
    return min(1.0, ((watts / units) / (ref_watts / ref_units)) ** 0.5)


# The cards the Hopper and CDNA2 GEMM efficiencies were measured on: H100 SXM (700 W, 132 SMs),
# MI250X one GCD (560 W / 2, 110 CUs).
H100_SXM_POWER = (700.0, 132)
MI250X_GCD_POWER = (280.0, 110)


def _gen(name: str) -> dict[str, float]:
    gemm, attention = GPU_GENERATIONS[name]
    return {"gemm_efficiency": gemm, "attention_efficiency": attention}


HARDWARE: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        # NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 4
        # 900 GB/s bidirectional (450 per direction) through NVSwitch to all 8 GPUs of a DGX H100;
        # 8 x ConnectX-7 400 Gb/s NICs per node = 50 GB/s per GPU. MFU 0.40: Megatron-LM /
        # torchtitan report 38-50 % on H100 for 7-70B Llama.
        HardwareProfile(
            name="h100-sxm",
            peak_flops=989e12,
            mfu=0.40,
            memory_bytes=80 * GB,
            memory_bw=3.35e12,
            intra_node_bw=450 * GB,
            inter_node_bw=50 * GB,
            gpus_per_node=8,
            nvlink_group=8,
            latency_s=8e-6,
            **_gen("hopper"),
        ),
        # NVIDIA H200 SXM datasheet: the H100's compute (989 TFLOPS dense BF16) and NVLink 4,
        # 141 GB HBM3e at 4.8 TB/s; the same 8-GPU HGX board and NICs as the DGX H100.
        HardwareProfile(
            name="h200",
            peak_flops=989e12,
            mfu=0.40,
            memory_bytes=141 * GB,
            memory_bw=4.8e12,
            intra_node_bw=450 * GB,
            inter_node_bw=50 * GB,
            gpus_per_node=8,
            nvlink_group=8,
            latency_s=8e-6,
            **_gen("hopper"),
        ),
        # COPUS's NVIDIA cluster (§5.1): H100 in NVLink pairs, PCIe between pairs, SR-IOV at
        # 350 Gb/s between nodes, Megatron-LM with a replicated optimizer (§4.4). (inferred)
        # PCIe cards with an NVLink bridge: H100 PCIe datasheet 756 TFLOPS dense BF16, 2.0 TB/s
        # HBM2e, NVLink bridge 600 GB/s bidirectional (300 per direction), PCIe Gen5 x16
        # 64 GB/s per direction; 350 Gb/s = 43.75 GB/s per node, one SR-IOV NIC shared by the
        # node's 8 GPUs (5.47 GB/s per GPU share). Link efficiencies (achieved NCCL bus
        # bandwidth / datasheet; docs/cost-model.md): NVLink 0.8, PCIe between pairs 0.5 (a
        # virtualised host: peer traffic through the root complex), network 0.8. 0.4 ms of fixed
        # cost per block per micro-batch (~80 kernels fwd+bwd, launch gaps and GEMM tails);
        # TP keeps 0.93 of per-GPU efficiency per doubling on top of the roofline's narrow GEMMs (fitted to
        # COPUS's eight published layouts: [0.92, 0.96] meets them; docs/cost-model.md).
        # Power: the PCIe card's 350 W over 114 SMs sustains sqrt((350/114)/(700/132)) = 0.76 of
        # its boost clock under matmul load (`power_clock`), against the H100 SXM the Hopper GEMM
        # efficiency was measured on. Checked against COPUS Table 1's token budgets: a run still
        # training at minute t has processed at most its budget, so throughput ≤ budget/t
        # (docs/cost-model.md, "Throughput bounds from COPUS Table 1").
        HardwareProfile(
            name="h100-nvlink-pairs",
            peak_flops=756e12,
            mfu=0.40,
            power_clock=power_clock(350, 114, *H100_SXM_POWER),
            memory_bytes=80 * GB,
            memory_bw=2.0e12,
            intra_node_bw=300 * GB * 0.8,
            cross_group_bw=64 * GB * 0.5,
            inter_node_bw=350e9 / 8 / 8 * 0.8,
            gpus_per_node=8,
            nvlink_group=2,
            latency_s=1e-5,
            overlap_gamma=1.0,
            layer_overhead_s=4e-4,
            stack="megatron",
            shared_nic=True,
            tp_efficiency=0.93,
            **_gen("hopper"),
        ),
        # NVIDIA A100 80GB SXM datasheet: 312 TFLOPS dense BF16, 2.039 TB/s HBM2e, NVLink 3
        # 600 GB/s bidirectional (300 per direction) via NVSwitch (DGX A100), 8 x HDR 200 Gb/s
        # NICs = 25 GB/s per GPU. MFU 0.50 (Megatron-LM, Narayanan et al. SC'21: 44-52 %).
        HardwareProfile(
            name="a100-80gb",
            peak_flops=312e12,
            mfu=0.50,
            memory_bytes=80 * GB,
            memory_bw=2.039e12,
            intra_node_bw=300 * GB,
            inter_node_bw=25 * GB,
            gpus_per_node=8,
            nvlink_group=8,
            latency_s=1e-5,
            **_gen("ampere"),
        ),
        # torchtitan's benchmark H100 (benchmarks/llama3_h100_202412_torchtitan.md, Grand Teton):
        # 96 GB HBM2e at 2.4 TB/s, default 500 W power limit, 8 per host on NVLink (450 GB/s per
        # direction), 400 Gb/s RDMA per GPU (50 GB/s). Peak: the SXM datasheet's 989 TFLOPS, as
        # torchtitan computes MFU ("the actual peak is between SXM and NVL", 989 and 835); at 500 W
        # instead of the SXM's 700 W the tensor cores sustain sqrt(500/700) = 0.845 of its clock
        # (`power_clock`), 836 TFLOPS: the NVL datasheet's figure. `mfu` is the old
        # single-constant model's (fitted on Table 1's FSDP 8 row). Capacity 95.0 GiB: 82.4 GiB
        # is reported as 86.7 %.
        HardwareProfile(
            name="h100-hbm2e-96gb",
            peak_flops=989e12,
            power_clock=power_clock(500, 132, *H100_SXM_POWER),
            mfu=0.372,
            memory_bytes=95.0 * GiB,
            memory_bw=2.4e12,
            intra_node_bw=450 * GB,
            inter_node_bw=50 * GB,
            gpus_per_node=8,
            nvlink_group=8,
            latency_s=8e-6,
            **_gen("hopper"),
        ),
        # AMD Instinct MI210 datasheet: 181 TFLOPS BF16, 64 GB HBM2e at 1.6 TB/s. COPUS §5.1:
        # Infinity Fabric 200 GB/s inside a 4-GPU NUMA domain, PCIe4 64 GB/s across domains
        # (both taken as bidirectional: 100 and 32 GB/s per direction), Ethernet 25 GB/s
        # between nodes (200 GbE line rate, per direction, one port shared by the node's 8
        # GPUs). Megatron-LM (ROCm fork) with a replicated optimizer (§4.4). MFU 0.30 (ROCm
        # stacks of that generation, inferred). Link efficiencies 0.8 / 0.4 / 0.8: the PCIe4 hop
        # between NUMA domains crosses the CPU sockets (docs/cost-model.md). TP as on H100.
        HardwareProfile(
            name="mi210",
            peak_flops=181e12,
            mfu=0.30,
            memory_bytes=64 * GB,
            memory_bw=1.6e12,
            intra_node_bw=100 * GB * 0.8,
            cross_group_bw=32 * GB * 0.4,
            inter_node_bw=25 * GB / 8 * 0.8,
            gpus_per_node=8,
            nvlink_group=4,
            latency_s=1.5e-5,
            layer_overhead_s=3e-4,
            overlap_gamma=1.0,
            stack="megatron",
            shared_nic=True,
            tp_efficiency=0.93,
            **_gen("cdna2"),
        ),
        # This 2-core machine, one rank per process, gloo over shared memory, fp32, 4 ranks on
        # 2 cores as the tests run. Calibrated to cpu-notes.md §g/g2 (36 measured steps of two
        # 4-block models, one set of coefficients fitted to both, then rounded): ~55 GFLOP/s
        # achieved per rank, ~2 ms per gloo ring step, ~0.3 GB/s effective, ~2.5 ms of Python
        # overhead per block per micro-batch, no compute/communication overlap. Median error of
        # this prior on those steps: ~20 % (of a fit: ~12 %). One node, one tier.
        HardwareProfile(
            name="cpu",
            peak_flops=100e9,
            mfu=0.55,
            memory_bytes=8 * GiB,
            memory_bw=10 * GB,
            intra_node_bw=0.3 * GB,
            inter_node_bw=0.3 * GB,
            gpus_per_node=1024,
            nvlink_group=1024,
            latency_s=2e-3,
            layer_overhead_s=2.5e-3,
            step_overhead_s=5e-3,
            overlap_gamma=1.0,
            dtype_bytes=4,
        ),
    )
}


def get_hardware(name: str) -> HardwareProfile:
    """Look up a named profile; ValueError names the bad value and the allowed ones."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; allowed: {', '.join(sorted(HARDWARE))}") from None


def with_overrides(profile: HardwareProfile, **changes) -> HardwareProfile:
    """A copy of `profile` with some fields changed (e.g. `gpus_per_node` of another cluster)."""
    return replace(profile, **changes)


def crosses(group_size, stride, world_size, domain) -> np.ndarray:
    """Whether some group of `group_size` ranks at `stride` spans two `domain`-sized rank blocks.

    Groups live in aligned blocks of `E = group_size·stride` consecutive ranks (mesh order). A
    block boundary at a multiple of `domain` cuts some group iff the group has ≥ 2 members, the
    world extends past one domain, and `domain` is not a multiple of `E` (derivation: the block
    containing ranks domain-1 and domain then holds members on both sides). Vectorised.
    """
    n = np.asarray(group_size)
    extent = n * np.asarray(stride)
    dom = np.asarray(domain)
    return (n > 1) & (np.asarray(world_size) > dom) & (dom % extent != 0)


def link_tier(group_size, stride, world_size, nvlink_group, gpus_per_node) -> np.ndarray:
    """Slowest link tier (0, 1, 2) used by the groups of `group_size` ranks at `stride`."""
    inter = crosses(group_size, stride, world_size, gpus_per_node)
    cross = crosses(group_size, stride, world_size, nvlink_group)
    return np.where(inter, 2, np.where(cross, 1, 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Ranks 0..world_size-1 placed `gpus_per_node` per node in order, mesh order (pp, dp, tp)."""

    world_size: int
    gpus_per_node: int
    nvlink_group: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"world_size={self.world_size}, gpus_per_node={self.gpus_per_node} are invalid; allowed: integers >= 1"
            )

    @property
    def fast_domain(self) -> int:
        return self.gpus_per_node if self.nvlink_group is None else self.nvlink_group

    @staticmethod
    def rank(pp_idx: int, dp_idx: int, tp_idx: int, dp: int, tp: int) -> int:
        return (pp_idx * dp + dp_idx) * tp + tp_idx

    def groups(self, dim: str, dp: int, tp: int, pp: int) -> list[list[int]]:
        """Explicit rank groups of mesh dimension `dim` ("tp", "dp" or "pp") for a layout."""
        if dp * tp * pp != self.world_size:
            raise ValueError(f"dp*tp*pp={dp * tp * pp} must equal world_size={self.world_size}")
        idx = {"tp": 2, "dp": 1, "pp": 0}
        if dim not in idx:
            raise ValueError(f"dim={dim!r} is invalid; allowed: 'tp', 'dp', 'pp'")
        out: dict[tuple[int, ...], list[int]] = {}
        for p in range(pp):
            for d in range(dp):
                for t in range(tp):
                    coord = [p, d, t]
                    coord[idx[dim]] = -1
                    out.setdefault(tuple(coord), []).append(self.rank(p, d, t, dp, tp))
        return list(out.values())

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def tier(self, dim: str, dp: int, tp: int, pp: int) -> int:
        """Slowest link tier used by the `dim` groups of layout (dp, tp, pp)."""
        size, stride = {"tp": (tp, 1), "dp": (dp, tp), "pp": (pp, dp * tp)}[dim]
        return int(link_tier(size, stride, self.world_size, self.fast_domain, self.gpus_per_node))

    def crosses_nodes(self, dim: str, dp: int, tp: int, pp: int) -> bool:
        """Whether some `dim` group of layout (dp, tp, pp) spans two nodes."""
        return self.tier(dim, dp, tp, pp) == 2
