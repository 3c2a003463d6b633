"""`copus plan`: rank every parallel plan by predicted goodput (what-if; no GPU, no torch).

    copus plan --model llama-3.2-3b --gpus 8 --hardware h100-nvlink-pairs --global-batch 16
    copus plan ... --max-batch 512 --b-noise 300 --json
    copus plan --model path/to/config.json --seq-len 4096 --by-layout
    copus plan --config run.toml --hardware h100-sxm      # the run's model, nproc, batch range

With `--global-batch` alone the batch is fixed and the ranking is by throughput. With
`--max-batch`, every batch in [global-batch, max-batch] competes, scored by goodput =
samples_per_s × E(B) × sqrt(B / global-batch) (COPUS Eqs. 6–8; `--no-lr-aware` drops the sqrt;
`--b-noise` omitted means E = 1). Step times come from the analytic model of `--hardware`
(core/cost/throughput.py; the Megatron structure for COPUS's clusters, core/cost/megatron_cost.py), memory
from core/cost/memory.py; plans over `--memory-gb` are pruned. `--model` takes a named shape or a
Hugging Face config.json (core/specs/hf_config.py); `--by-layout` keeps each layout's best row.

Plan options ranked jointly with dp·tp·pp and the micro-batch (issue 25): activation
checkpointing (none / selective / full; `--activation-checkpointing MODE` keeps one), pipeline
schedule (1f1b / gpipe / interleaved-1f1b with `--virtual-stages`; `--pipeline-schedule NAME`
keeps one), sequence parallel and FSDP reshard-after-forward (`--sequence-parallel`,
`--reshard-after-forward`: on, off or both). `--compile` prices torch.compile (the fitted
`COMPILE_SPEEDUP` on the compute term).

Defaults are the runtime's (runtime/engine/): precision = FSDP2's MixedPrecisionPolicy on a GPU
profile (`--param-dtype bf16`: bf16 parameters and compute, fp32 master weights and gradient
reduction, loss parallel; `fp32` prices the older autocast over fp32 parameters), fp32 on the
CPU profile; AC none / selective / full; the schedules the engine builds (1f1b, gpipe).
`--pipeline-schedule all` or `interleaved-1f1b` also ranks interleaved 1F1B, which the planner
prices but the engine does not run yet; such rows (and pp > 1 with tied embeddings, which the
engine's stage split refuses) carry runnable = false (JSON) and "no" in the `run` column. Memory
of a CUDA profile includes the fitted allocator overhead (`ALLOCATOR_OVERHEAD`); JSON rows add
tokens/s per device, MFU (6N + 12·L·h·s FLOPs per token over the profile's peak) and "time":
where the step's seconds go (`StepTimeModel.time_split`).

A `--hardware` name copus does not know, with `--peak-tflops`, `--memory-gib`, `--hbm-gbps`,
`--intra-node-gbps` and `--inter-node-gbps`, prices a custom GPU (8 per node, all in one
NVLink domain unless `--gpus-per-node`/`--nvlink-group` say otherwise; the GEMM and attention
efficiencies of the Hopper generation); the same flags override a known profile's figures.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import numpy as np

from copus.core.cost.memory import ALLOCATOR_OVERHEAD, MemoryModel
from copus.core.cost.throughput import COMPILE_SPEEDUP, StepTimeModel, time_split
from copus.core.plan.goodput import build_candidates, option_grid
from copus.core.plan.plan import AC_MODES, PIPELINE_SCHEDULES, check_choice
from copus.core.plan.search import RankedPlan, ranked
from copus.core.specs.hardware import GB, GPU_GENERATIONS, HARDWARE, GiB, HardwareProfile, get_hardware, with_overrides
from copus.core.specs.models import MODELS
from copus.core.specs.resolve import get_model_shape
from copus.commands.config_defaults import TRAIN_KEYS, add_config_argument, fill_from_config

JSON_KEYS = (
    "dp",
    "tp",
    "pp",
    "micro_batch_size",
    "num_microbatches",
    "global_batch_size",
    "step_s",
    "samples_per_s",
    "memory_bytes",
    "goodput",
    "activation_checkpointing",
    "pipeline_schedule",
    "virtual_stages",
    "sequence_parallel",
    "reshard_after_forward",
    "runnable",
    "tokens_per_s_per_device",
    "mfu",
    "time",
)
SWITCHES = ("both", "on", "off")
# What copus's engine runs (runtime/engine/engine.py `EngineSettings.pp_schedule`; interleaved
# 1F1B is built by runtime/engine/pipeline.py but not wired into `Engine`).
ENGINE_SCHEDULES = ("1f1b", "gpipe")
# --flag: (HardwareProfile field, unit factor)
HARDWARE_FLAGS = {
    "peak_tflops": ("peak_flops", 1e12),
    "memory_gib": ("memory_bytes", GiB),
    "hbm_gbps": ("memory_bw", GB),
    "intra_node_gbps": ("intra_node_bw", GB),
    "inter_node_gbps": ("inter_node_bw", GB),
    "gpus_per_node": ("gpus_per_node", 1),
    "nvlink_group": ("nvlink_group", 1),
}
CUSTOM_REQUIRED = ("peak_tflops", "memory_gib", "hbm_gbps", "intra_node_gbps", "inter_node_gbps")


PLAN_DEFAULTS = {
    "model": "llama-3.2-3b",
    "seq_len": 0,
    "gpus": 8,
    "global_batch": 16,
    "max_batch": None,
    "memory_gb": None,
    "micro_batch_sizes": "1,2,4,8,16",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser, "plan")
    parser.add_argument(
        "--model",
        default=None,
        help=f"model shape, one of: {', '.join(MODELS)}, or a Hugging Face config.json path (default llama-3.2-3b)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="sequence length in tokens (default: the model's; 2048 for a config.json)",
    )
    parser.add_argument("--gpus", type=int, default=None, help="world size (default 8)")
    parser.add_argument(
        "--hardware",
        default="h100-sxm",
        help=f"hardware profile, one of: {', '.join(HARDWARE)} (default h100-sxm); "
        "another name with the figures below prices a custom GPU",
    )
    for flag, help_text in (
        ("--peak-tflops", "dense BF16 TFLOP/s per GPU (datasheet)"),
        ("--memory-gib", "memory per GPU in GiB"),
        ("--hbm-gbps", "memory bandwidth per GPU in GB/s"),
        ("--intra-node-gbps", "NVLink/xGMI GB/s per GPU per direction"),
        ("--inter-node-gbps", "network GB/s per GPU per direction (IB/RoCE)"),
    ):
        parser.add_argument(flag, type=float, default=None, help=help_text + " (overrides the profile)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (custom default 8)")
    parser.add_argument(
        "--nvlink-group", type=int, default=None, help="GPUs per fully connected fast domain (custom default: the node)"
    )
    parser.add_argument("--global-batch", type=int, default=None, help="global batch size in samples (default 16)")
    parser.add_argument(
        "--max-batch", type=int, default=None, help="also rank every larger batch up to this one (default: fixed batch)"
    )
    parser.add_argument(
        "--b-noise", type=float, default=None, help="gradient noise scale in samples (default: unknown, efficiency 1)"
    )
    parser.add_argument("--no-lr-aware", action="store_true", help="no sqrt(B) learning-rate factor in goodput")
    parser.add_argument(
        "--micro-batch-sizes", default=None, help="comma-separated micro-batch sizes (default 1,2,4,8,16)"
    )
    parser.add_argument(
        "--memory-gb", type=float, default=None, help="memory per device in GB (default: the hardware profile's)"
    )
    parser.add_argument("--top", type=int, default=10, help="rows to show (default 10)")
    parser.add_argument(
        "--by-layout", action="store_true", help="one row per (dp, tp, pp): its best micro-batch size and batch"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (a list, best first)")
    parser.add_argument(
        "--time-split",
        action="store_true",
        help="under the table, where each row's step time goes (JSON rows always carry it)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        default="all",
        metavar="MODE",
        help=f"one of: {', '.join(AC_MODES)}, or all (default: rank all three)",
    )
    parser.add_argument(
        "--pipeline-schedule",
        default="engine",
        metavar="NAME",
        help=f"one of: {', '.join(PIPELINE_SCHEDULES)}, all, or engine (default: the "
        f"schedules the engine runs, {', '.join(ENGINE_SCHEDULES)})",
    )
    parser.add_argument(
        "--virtual-stages", default="2,4", help="chunks per rank tried with interleaved-1f1b (default 2,4)"
    )
    parser.add_argument(
        "--sequence-parallel",
        default="both",
        metavar="on|off|both",
        help="sequence parallel with tp > 1 (default both)",
    )
    parser.add_argument(
        "--reshard-after-forward",
        default="both",
        metavar="on|off|both",
        help="FSDP2 reshard after forward (default both)",
    )
    parser.add_argument(
        "--compile", action="store_true", help=f"price torch.compile: compute time / {COMPILE_SPEEDUP:g} (fitted)"
    )
    parser.add_argument(
        "--no-flash-attention",
        action="store_true",
        help="eager attention: scores stored (5·a·s²·b/t bytes per block) and their memory traffic priced",
    )
    parser.add_argument(
        "--pipeline-stage",
        default="copus",
        metavar="copus|torch",
        help="copus: the engine's stages, reduce-scatter every micro-batch (default); torch: torch's own "
        "PipelineStage as torchtitan runs it, the stage's fp32 gradient unsharded until the last micro-batch",
    )
    parser.add_argument(
        "--param-dtype",
        default=None,
        metavar="fp32|bf16",
        help="bf16: FSDP2 MixedPrecisionPolicy, the runtime's on GPUs (bf16 params and "
        "compute, fp32 master weights and reduction); fp32: fp32 params under bf16 "
        "autocast (default: bf16 on a GPU profile, fp32 on cpu)",
    )


def parse_sizes(text: str, flag: str = "--micro-batch-sizes") -> list[int]:
    """'1,2,4' -> [1, 2, 4]; ValueError naming the bad value."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"{flag}={text!r} is invalid; allowed: comma-separated integers >= 1, e.g. 1,2,4,8")
    return sizes


def _pipeline_stage(args: argparse.Namespace) -> str:
    """`--pipeline-stage` (library callers may build `args` without it: copus's own stages)."""
    return getattr(args, "pipeline_stage", "copus")


def _check(args: argparse.Namespace) -> None:
    if args.seq_len < 0:
        raise ValueError(f"--seq-len={args.seq_len} is invalid; allowed: an integer >= 1 (0 = the model's own)")
    for name in ("gpus", "global_batch", "top"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} is invalid; allowed: an integer >= 1")
    if args.max_batch is not None and args.max_batch < args.global_batch:
        raise ValueError(f"--max-batch={args.max_batch} is invalid; allowed: >= --global-batch={args.global_batch}")
    if args.b_noise is not None and not (math.isfinite(args.b_noise) and args.b_noise > 0):
        raise ValueError(f"--b-noise={args.b_noise} is invalid; allowed: a number > 0")
    if args.memory_gb is not None and not (math.isfinite(args.memory_gb) and args.memory_gb > 0):
        raise ValueError(f"--memory-gb={args.memory_gb} is invalid; allowed: a number > 0")
    if args.activation_checkpointing != "all":
        check_choice("--activation-checkpointing", args.activation_checkpointing, AC_MODES)
    if args.pipeline_schedule not in ("all", "engine"):
        check_choice("--pipeline-schedule", args.pipeline_schedule, PIPELINE_SCHEDULES)
    for name in ("sequence_parallel", "reshard_after_forward"):
        check_choice(f"--{name.replace('_', '-')}", getattr(args, name), SWITCHES)
    if args.param_dtype is not None:
        check_choice("--param-dtype", args.param_dtype, ("fp32", "bf16"))
    check_choice("--pipeline-stage", _pipeline_stage(args), ("copus", "torch"))
    for flag in HARDWARE_FLAGS:
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{flag.replace('_', '-')}={value} is invalid; allowed: a number > 0")
    if any(v < 2 for v in parse_sizes(args.virtual_stages, "--virtual-stages")):
        raise ValueError(f"--virtual-stages={args.virtual_stages!r} is invalid; allowed: integers >= 2")


def plan_options(args: argparse.Namespace, stack: str = "fsdp2") -> list[dict]:
    """The option sets the flags allow (`core.plan.goodput.option_grid`); the Megatron stack
    has no FSDP, so reshard-after-forward stays at its default there."""
    switch = {"both": (False, True), "on": (True,), "off": (False,)}
    raf = (True,) if stack == "megatron" else switch[args.reshard_after_forward][::-1]
    return option_grid(
        ac_modes=AC_MODES if args.activation_checkpointing == "all" else (args.activation_checkpointing,),
        schedules={"all": PIPELINE_SCHEDULES, "engine": ENGINE_SCHEDULES}.get(
            args.pipeline_schedule, (args.pipeline_schedule,)
        ),
        virtual_stages=parse_sizes(args.virtual_stages, "--virtual-stages"),
        sequence_parallel=switch[args.sequence_parallel],
        reshard_after_forward=raf,
    )


def resolve_hardware(args: argparse.Namespace) -> HardwareProfile:
    """`--hardware` with the figure flags applied; an unknown name needs the five figures.

    ValueError (one line): the unknown name, the known ones and the flags that describe a GPU.
    """
    given = {flag: getattr(args, flag, None) for flag in HARDWARE_FLAGS}
    changes = {
        HARDWARE_FLAGS[f][0]: (int(v) if HARDWARE_FLAGS[f][1] == 1 else v * HARDWARE_FLAGS[f][1])
        for f, v in given.items()
        if v is not None
    }
    if args.hardware in HARDWARE:
        hw = get_hardware(args.hardware)
        if "gpus_per_node" in changes and "nvlink_group" not in changes:
            changes["nvlink_group"] = min(hw.nvlink_group, changes["gpus_per_node"])
        return with_overrides(hw, **changes) if changes else hw
    missing = [f for f in CUSTOM_REQUIRED if given[f] is None]
    if missing:
        flags = " ".join(f"--{f.replace('_', '-')} X" for f in CUSTOM_REQUIRED)
        raise ValueError(
            f"unknown hardware {args.hardware!r}; allowed: {', '.join(sorted(HARDWARE))}; or describe "
            f"the GPU: {flags} [--gpus-per-node N --nvlink-group G] (per GPU; GB/s per direction)"
        )
    gemm, attention = GPU_GENERATIONS["hopper"]
    gpn = changes.pop("gpus_per_node", 8)
    return HardwareProfile(
        name=args.hardware,
        mfu=0.4,
        latency_s=1e-5,
        gpus_per_node=gpn,
        nvlink_group=changes.pop("nvlink_group", gpn),
        gemm_efficiency=gemm,
        attention_efficiency=attention,
        **changes,
    )


def param_dtype(args: argparse.Namespace, hw: HardwareProfile) -> str:
    """`--param-dtype`, or the runtime's: bf16 (MixedPrecisionPolicy) on a GPU profile, fp32 on cpu."""
    if args.param_dtype is not None:
        return args.param_dtype
    return "bf16" if hw.dtype_bytes == 2 else "fp32"


def plan_model(
    args: argparse.Namespace, shape, hw: HardwareProfile, compute_speedup: float | None = None
) -> StepTimeModel:
    """The step-time model `copus plan` ranks with (the profile's analytic prior)."""
    if compute_speedup is None:
        compute_speedup = COMPILE_SPEEDUP if args.compile else 1.0
    return StepTimeModel.analytic(
        shape,
        hw,
        args.gpus,
        param_bytes=2 if param_dtype(args, hw) == "bf16" else 4,
        compile_speedup=compute_speedup,
        flash_attention=not args.no_flash_attention,
        pipeline_no_sync=_pipeline_stage(args) == "torch",
    )


def plan_rows(
    args: argparse.Namespace, *, hardware: HardwareProfile | None = None, compute_speedup: float | None = None
) -> list[RankedPlan]:
    """The ranked plans `copus plan` prints (best first, at most `--top`).

    Library use (bench/published.py): `hardware` replaces the `--hardware` profile and
    `compute_speedup` the `--compile` factor (e.g. compile × a stated float8 factor).
    """
    fill_from_config(args, TRAIN_KEYS, PLAN_DEFAULTS)
    _check(args)
    shape = get_model_shape(args.model, args.seq_len)
    hw = resolve_hardware(args) if hardware is None else hardware
    capacity = hw.memory_bytes if args.memory_gb is None else args.memory_gb * GB
    memory = memory_model(shape, hw, param_dtype(args, hw), flash_attention=not args.no_flash_attention)
    memory = replace(memory, pipeline_no_sync=_pipeline_stage(args) == "torch")
    max_batch = args.global_batch if args.max_batch is None else args.max_batch
    cands = build_candidates(
        args.gpus,
        shape,
        min_batch=args.global_batch,
        max_batch=max_batch,
        micro_batch_sizes=parse_sizes(args.micro_batch_sizes),
        memory_model=memory,
        memory_capacity_bytes=capacity,
        options=plan_options(args, hw.stack),
    )
    if not len(cands):
        raise ValueError(
            f"no plan of {args.model} fits {args.gpus} x {hw.name} with "
            f"{capacity / GB:.1f} GB per device at global batch {args.global_batch}"
        )
    model = plan_model(args, shape, hw, compute_speedup)
    b_noise = float("inf") if args.b_noise is None else args.b_noise
    rows = ranked(
        cands,
        model,
        b_noise,
        lr_aware=not args.no_lr_aware,
        ref_batch=1.0,
        lr_ref_batch=float(args.global_batch),
        top=None if args.by_layout else args.top,
    )
    return best_per_layout(rows)[: args.top] if args.by_layout else rows


def engine_runs(plan, shape) -> bool:
    """Whether copus's engine can run `plan`: a schedule it builds (`ENGINE_SCHEDULES`), and no
    pipeline split of tied embeddings (runtime/engine/pipeline.py `split_stage` refuses it)."""
    return plan.pipeline_schedule in ENGINE_SCHEDULES and not (shape.tie_embeddings and plan.pp > 1)


def best_per_layout(rows: list[RankedPlan]) -> list[RankedPlan]:
    """The first (best) row of each (dp, tp, pp), in the order of `rows`."""
    seen: set[tuple[int, int, int]] = set()
    out = []
    for r in rows:
        if r.plan.layout not in seen:
            seen.add(r.plan.layout)
            out.append(r)
    return out


def memory_model(shape, hw, param_dtype: str = "fp32", *, flash_attention: bool = True) -> MemoryModel:
    """The memory model of the stack `hw` describes (FSDP2 runtime or Megatron, core/cost/memory.py).

    param_dtype "bf16": FSDP2 MixedPrecisionPolicy as torchtitan (bf16 parameters, loss parallel,
    12 bytes per logit). A CUDA profile (2-byte dtype) of the FSDP2 stack adds the fitted
    allocator overhead; the Megatron stack does not: COPUS ran 13B as DP4·TP1·PP4 on 80 GB, which
    Megatron's count puts at 74.3 GB, so a 10 % overhead there is refuted by measurement.
    """
    bf16 = param_dtype == "bf16"
    return MemoryModel(
        shape=shape,
        mixed_precision=hw.dtype_bytes == 2,
        stack=hw.stack,
        distributed_optimizer=hw.distributed_optimizer,
        autocast=not bf16,
        loss_parallel=bf16,
        logit_bytes=12.0 if bf16 else None,
        flash_attention=flash_attention,
        allocator_overhead=ALLOCATOR_OVERHEAD if hw.dtype_bytes == 2 and hw.stack == "fsdp2" else 0.0,
    )


def tokens_per_s_per_device(row: RankedPlan, seq_len: int) -> float:
    """samples/s · seq_len / world size."""
    return row.samples_per_s * seq_len / row.plan.world_size


def mfu(row: RankedPlan, shape, hw) -> float:
    """Model FLOPs utilisation: tokens/s/device · (6N + 12·L·h·s) / peak (no recompute counted)."""
    return tokens_per_s_per_device(row, shape.seq_len) * shape.flops_per_token() / hw.peak_flops


def row_dict(row: RankedPlan, shape=None, hw=None, time: dict | None = None) -> dict:
    p = row.plan
    out = {
        "dp": p.dp,
        "tp": p.tp,
        "pp": p.pp,
        "micro_batch_size": p.micro_batch_size,
        "num_microbatches": p.num_microbatches,
        "global_batch_size": p.global_batch_size,
        "step_s": row.step_s,
        "samples_per_s": row.samples_per_s,
        "memory_bytes": row.memory_bytes,
        "goodput": row.goodput,
        **p.options,
    }
    if shape is not None and hw is not None:
        out["runnable"] = engine_runs(p, shape)
        out["tokens_per_s_per_device"] = tokens_per_s_per_device(row, shape.seq_len)
        out["mfu"] = mfu(row, shape, hw)
    if time is not None:
        out["time"] = time
    return out


def row_times(rows: list[RankedPlan], model: StepTimeModel) -> list[dict]:
    """Each row's `time_split` (seconds per step by where they go), vectorised over the rows."""
    if not rows:
        return []
    cols = {
        k: np.array([getattr(r.plan, k) for r in rows])
        for k in (
            "dp",
            "tp",
            "pp",
            "micro_batch_size",
            "num_microbatches",
            "activation_checkpointing",
            "pipeline_schedule",
            "virtual_stages",
            "sequence_parallel",
            "reshard_after_forward",
        )
    }
    ac = np.array([AC_MODES.index(a) for a in cols["activation_checkpointing"]])
    schedule = np.array([PIPELINE_SCHEDULES.index(s) for s in cols["pipeline_schedule"]])
    parts = time_split(
        model,
        cols["dp"],
        cols["tp"],
        cols["pp"],
        cols["micro_batch_size"],
        cols["num_microbatches"],
        activation_checkpointing=ac,
        pipeline_schedule=schedule,
        virtual_stages=cols["virtual_stages"],
        sequence_parallel=cols["sequence_parallel"],
        reshard_after_forward=cols["reshard_after_forward"],
    )
    return [{k: float(v[i]) for k, v in parts.items()} for i in range(len(rows))]


def format_table(rows: list[RankedPlan], shape=None) -> str:
    """The ranked rows as a table; `vs #1` is each row's goodput deficit to the first; `run`:
    whether the engine can run the row (`engine_runs`)."""
    head = (
        f"{'#':>3}  {'dp':>3} {'tp':>3} {'pp':>3} {'mbs':>4} {'n_mb':>5} {'B':>6}  "
        f"{'step_s':>9} {'samples/s':>10} {'eff':>6} {'goodput':>10} {'vs #1':>7} {'mem GB':>7} "
        f"{'run':>3}  options"
    )
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        p = r.plan
        gap = 100.0 * (1.0 - r.goodput / rows[0].goodput)
        lines.append(
            f"{i:>3}  {p.dp:>3} {p.tp:>3} {p.pp:>3} {p.micro_batch_size:>4} "
            f"{p.num_microbatches:>5} {p.global_batch_size:>6}  {r.step_s:>9.4g} "
            f"{r.samples_per_s:>10.4g} {r.efficiency:>6.3f} {r.goodput:>10.4g} "
            f"{-gap + 0.0:>+6.1f}% {r.memory_bytes / GB:>7.1f} "
            f"{'yes' if shape is None or engine_runs(p, shape) else 'no':>3} {p.options_suffix()}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rows = plan_rows(args)
    shape = get_model_shape(args.model, args.seq_len)
    hw = resolve_hardware(args)
    if args.json:
        times = row_times(rows, plan_model(args, shape, hw))
        print(json.dumps([row_dict(r, shape, hw, t) for r, t in zip(rows, times)], indent=1))
    else:
        b = "unknown" if args.b_noise is None else f"{args.b_noise:g}"
        print(
            f"{args.model} (seq {shape.seq_len}) on {args.gpus} x {hw.name} ({hw.stack}, "
            f"{param_dtype(args, hw)} parameters), global batch "
            f"{args.global_batch}{'' if args.max_batch is None else f'..{args.max_batch}'}, "
            f"b_noise {b}; best {len(rows)} {'layouts' if args.by_layout else 'plans'} by predicted goodput"
        )
        print(format_table(rows, shape))
        if args.time_split:
            print(format_time_split(rows, row_times(rows, plan_model(args, shape, hw))))
    return 0


SPLIT_LABELS = {
    "compute_s": "compute",
    "recompute_s": "recompute",
    "fsdp_allgather_s": "fsdp-allgather",
    "tp_s": "tp",
    "pp_p2p_s": "pp-p2p",
    "grad_sync_s": "grad-sync",
    "embedding_sync_s": "emb-sync",
    "bubble_s": "bubble",
    "optimizer_s": "optimizer",
}


def format_time_split(rows: list[RankedPlan], times: list[dict]) -> str:
    """One line per row: the share of its step each cost takes (`StepTimeModel.time_split`)."""
    lines = ["where the step time goes (% of step_s; communication is the exposed part):"]
    for i, (r, split) in enumerate(zip(rows, times), 1):
        parts = " ".join(
            f"{SPLIT_LABELS[k]} {100 * v / r.step_s:.0f}%" for k, v in split.items() if v > 0.0005 * r.step_s
        )
        lines.append(f"{i:>3}  {parts}")
    return "\n".join(lines)
