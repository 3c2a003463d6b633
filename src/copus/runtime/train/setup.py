"""What a run trains with, resolved before any process starts: the initial plan, the run's
policy, the hardware profile, the launcher's environment (torchrun, elastic restarts).

Torch-free at import; shared by the launcher (`launch.py`), the trainer and the commands, so that
the trainer never imports the launcher back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from copus.config import Config
from copus.core.cost.profile_table import read_profile
from copus.core.stats import calibration_posterior
from copus.core.stats.gns_tracking import resolve_estimator
from copus.core.plan.layout_map import LayoutMappedPolicy, check_layout_map, parse_layout_map
from copus.core.plan.plan import ParallelPlan, default_micro_batch_size, plan_problems
from copus.core.specs.models import ModelShape
from copus.core.specs.resolve import get_model_shape

if TYPE_CHECKING:
    from copus.core.specs.hardware import HardwareProfile

__all__ = [
    "TORCHRUN_VARS",
    "check_run_length",
    "default_micro_batch_size",
    "elastic_run_id",
    "initial_plan",
    "job_cores",
    "make_run_policy",
    "restart_count",
    "run_hardware",
    "switch_cost_prior_s",
    "under_torchrun",
    "validate_before_launch",
    "world_size",
]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def check_run_length(cfg: Config) -> None:
    """A run needs an end: train.max_steps > 0 or train.max_tokens > 0. (A decaying LR schedule
    without max_tokens decays over max_steps × the initial tokens per step, see optim.py.)"""
    if cfg.train.max_steps == 0 and cfg.train.max_tokens == 0:
        raise ValueError("train.max_tokens=0: allowed: an integer > 0 when train.max_steps=0 (set one of them)")


def initial_plan(cfg: Config, world_size: int, shape: ModelShape) -> ParallelPlan:
    """Fixed degrees from [parallel]; unset ones: tp = pp = 1 and dp = the rest (pure FSDP);
    with `parallel.layouts`, the map's layout for batch.initial.

    Global batch = batch.initial; micro_batch_size = parallel.micro_batch_size, else
    `default_micro_batch_size(initial / dp, pp)`. ValueError names the first problem.
    """
    p = cfg.parallel
    tp, pp = p.tp or 1, p.pp or 1
    layouts = parse_layout_map(p.layouts)
    if layouts is not None:
        check_layout_map(layouts, world_size, cfg.batch.initial, shape)
        dp, tp, pp = layouts.layout_for(cfg.batch.initial)
    elif p.dp:
        dp = p.dp
    elif world_size % (tp * pp):
        raise ValueError(f"parallel.tp*parallel.pp={tp * pp} does not divide the world size {world_size}")
    else:
        dp = world_size // (tp * pp)
    batch = cfg.batch.initial
    if batch % dp:
        raise ValueError(f"batch.initial={batch}: allowed: a multiple of dp={dp}")
    mbs = p.micro_batch_size or default_micro_batch_size(batch // dp, pp)
    if (batch // dp) % mbs:
        raise ValueError(f"parallel.micro_batch_size={mbs}: allowed: a divisor of batch.initial/dp={batch // dp}")
    plan = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=batch // (dp * mbs))
    problems = plan_problems(plan, world_size, shape)
    if problems:
        raise ValueError(f"invalid plan {plan.describe()}: {problems[0]}")
    return plan


def make_run_policy(
    cfg: Config,
    plan: ParallelPlan,
    world_size: int,
    shape: ModelShape,
    hardware: HardwareProfile | None = None,
    *,
    memory_capacity_bytes: float | None = None,
    memory_model: Any = None,
):
    """The configured batch policy (core.policies), starting from `plan`. `hardware` is the
    goodput controller's step-time prior (`run_hardware`; None: the "cpu" coefficients).
    `memory_capacity_bytes` (the trainer: the device's real memory less parallel.memory_margin,
    `runtime/train/perf.py`) bounds every plan the controller may choose, predicted by
    `memory_model` (a `core.cost.memory.MemoryModel`; None: the controller's default); without
    it, parallel.memory_budget_gb when set."""
    from copus.core.control.policies import PolicySettings, make_policy

    settings = PolicySettings.from_config(cfg)
    kw: dict[str, Any] = {}
    if cfg.batch.policy.startswith("goodput"):
        c = cfg.controller
        # a degree fixed in [parallel] fixes the layout: resume keeps it too (runtime/state/elastic.py)
        fixed = any(getattr(cfg.parallel, k) > 0 for k in ("dp", "tp", "pp"))
        kw = dict(
            margin=c.margin,
            lr_aware=c.lr_aware,
            lr_warmup_tokens=cfg.train.warmup_tokens,
            lr_rule=cfg.train.lr_rule,
            horizon_tokens=float(cfg.train.max_tokens or 0),
            reconfig_cost_s=switch_cost_prior_s(c.reconfig_cost_s, shape, world_size, hardware),
            allow_reconfigure=c.allow_reconfigure and not fixed,
            refit_interval_steps=c.refit_interval_steps,
            hardware=hardware,
            cores=job_cores(world_size) if hardware is None else None,
        )
        if (
            resolve_estimator(cfg.gns.estimator, cfg.batch.policy) == "ema"
            and calibration_posterior.MODEL_ESTIMATOR_LAG
        ):
            # the posterior over c models the EMA's lag (the mean age of its weights) in its clock
            # (docs/robust-goodput.md §6.13); the tracking estimator's lag is not modelled
            g = cfg.gns
            kw["posterior_options"] = {"lag_decay": (g.decay, g.decay_late, float(g.decay_switch_tokens))}
        if c.profile:
            kw["profile_observations"] = read_profile(c.profile, world_size)
        if memory_capacity_bytes is not None:
            kw["memory_capacity_bytes"] = memory_capacity_bytes
            if memory_model is not None:
                kw["memory_model"] = memory_model
        elif cfg.parallel.memory_budget_gb > 0:
            kw["memory_capacity_bytes"] = cfg.parallel.memory_budget_gb * 1e9
        if cfg.parallel.activation_checkpointing != "none":
            # price candidates under the mode the engine runs (the engine reads it from the
            # config too: the controller's plans carry the default options)
            kw["plan_options"] = {"activation_checkpointing": cfg.parallel.activation_checkpointing}
    policy = make_policy(cfg.batch.policy, settings, plan, world_size, shape, **kw)
    forbid = getattr(policy, "forbid", None)
    if shape.tie_embeddings and forbid is not None:
        # the runtime's pipeline refuses tied embeddings across stages (runtime/engine/pipeline.py);
        # the analytic planner keeps pp (Megatron ties across stages), the run's controller may not
        forbid(lambda p: p.pp > 1)
    layouts = parse_layout_map(cfg.parallel.layouts)
    if cfg.batch.policy == "schedule":  # every entry splits over its layout (before any worker)
        policy.check_layouts(None if layouts is None else layouts.layout_for, cfg.parallel.micro_batch_size)
    return policy if layouts is None else LayoutMappedPolicy(policy, layouts)


def job_cores(world_size: int, env: Mapping[str, str] | None = None) -> int:
    """CPU cores of the whole job: this host's cores × hosts (world / LOCAL_WORLD_SIZE ranks per
    host; one host outside a launcher). The CPU prior prices ranks sharing them."""
    env = os.environ if env is None else env
    local = int(env.get("LOCAL_WORLD_SIZE") or world_size)
    return (os.cpu_count() or 1) * max(world_size // max(local, 1), 1)


def switch_cost_prior_s(
    configured: float, shape: ModelShape, world_size: int, hardware: HardwareProfile | None
) -> float:
    """controller.reconfig_cost_s, or for -1 (auto) the direct switch's cost model: measured
    constant + weights and AdamW moments (12 B/parameter) / the world's bandwidth (CPU: the
    rate measured by bench/reconfigure.py; GPUs: per-device link bandwidth × world)."""
    from copus.core.plan.reshard import direct_switch_cost_s

    if configured >= 0:
        return configured
    bw = None
    if hardware is not None:
        link = hardware.intra_node_bw if world_size <= hardware.gpus_per_node else hardware.inter_node_bw
        bw = link * world_size
    return direct_switch_cost_s(12.0 * shape.num_params(), bw)


# Accelerator names (substrings of torch.cuda.get_device_name) → the closest named profile.
DEVICE_PROFILES = (
    ("H100", "h100-sxm"),
    ("H200", "h200"),
    ("H800", "h100-sxm"),
    ("A100", "a100-80gb"),
    ("A800", "a100-80gb"),
    ("MI2", "mi210"),
)


def run_hardware(
    device_type: str, device_name: str = "", env: Mapping[str, str] | None = None
) -> HardwareProfile | None:
    """The goodput controller's hardware prior for this run's devices, or None on CPU.

    CPU: None, i.e. the calibrated "cpu" coefficients on one tier (gloo between hosts is priced
    like gloo inside one). Accelerators: the profile in DEVICE_PROFILES whose key is in
    `device_name` (default "h100-sxm"; the online fit replaces its coefficients) with the
    launcher's node shape (`core.topology.launched_hardware`), so a tp/dp/pp group that would
    span nodes is priced at the inter-node bandwidth.
    """
    from copus.core.specs.hardware import get_hardware
    from copus.core.specs.topology import launched_hardware

    if device_type == "cpu":
        return None
    from copus.core.specs.hardware import with_overrides

    from copus.core.specs.gpu_peaks import device_peak

    name = next((p for key, p in DEVICE_PROFILES if key in device_name.upper()), "h100-sxm")
    # copus's own runtime is FSDP2 (a profile of COPUS's Megatron clusters keeps its links);
    # the device's own datasheet peak when it is known (an H100 PCIe is not an SXM part)
    known = device_peak(device_name)
    peak = {"peak_flops": known.peak_flops} if known is not None else {}
    return launched_hardware(with_overrides(get_hardware(name), stack="fsdp2", **peak), env)


def elastic_run_id(env: Mapping[str, str] | None = None) -> str | None:
    """The elastic launcher's run id (torchrun --rdzv-id, or copus's own launcher's), None
    outside a launcher or for torchrun's default "none" (every job would share it)."""
    run_id = (os.environ if env is None else env).get("TORCHELASTIC_RUN_ID", "")
    return run_id if run_id and run_id != "none" else None


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """TORCHELASTIC_RESTART_COUNT: failure restarts so far (a membership change keeps it)."""
    return int((os.environ if env is None else env).get("TORCHELASTIC_RESTART_COUNT", "0"))


def validate_before_launch(cfg: Config, world_size: int) -> ParallelPlan:
    """Everything checkable without workers: run length, corpus, plan, policy. ValueError on a
    mistake."""
    from copus.runtime.data.stream import check_data

    check_run_length(cfg)
    check_data(cfg.data)
    shape = get_model_shape(cfg.model.name, cfg.model.seq_len)
    plan = initial_plan(cfg, world_size, shape)
    make_run_policy(cfg, plan, world_size, shape)
    return plan


def under_torchrun() -> bool:
    """True when an outer launcher (torchrun, elastic agent, SLURM wrapper) set the rank env."""
    return all(k in os.environ for k in TORCHRUN_VARS)


def world_size(cfg: Config) -> int:
    """The world the trainer will see: the outer launcher's, else parallel.nproc."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else cfg.parallel.nproc
