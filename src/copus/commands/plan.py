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
`COMPILE_SPEEDUP` on the compute term). `--param-dtype bf16` prices FSDP2's
MixedPrecisionPolicy as torchtitan runs it (bf16 parameters, loss parallel, its logits);
the default fp32 is copus's runtime (fp32 parameters, bf16 autocast). Memory of a CUDA profile
includes the fitted allocator overhead (`ALLOCATOR_OVERHEAD`); JSON rows add tokens/s per
device and MFU (6N + 12·L·h·s FLOPs per token over the profile's peak).
"""

from __future__ import annotations

import argparse
import json
import math

from copus.core.cost.memory import ALLOCATOR_OVERHEAD, MemoryModel
from copus.core.cost.throughput import COMPILE_SPEEDUP, StepTimeModel
from copus.core.plan.goodput import build_candidates, option_grid
from copus.core.plan.plan import AC_MODES, PIPELINE_SCHEDULES, check_choice
from copus.core.plan.search import RankedPlan, ranked
from copus.core.specs.hardware import GB, HARDWARE, HardwareProfile, get_hardware
from copus.core.specs.models import MODELS
from copus.core.specs.resolve import get_model_shape
from copus.commands.config_defaults import TRAIN_KEYS, add_config_argument, fill_from_config

JSON_KEYS = ("dp", "tp", "pp", "micro_batch_size", "num_microbatches", "global_batch_size",
             "step_s", "samples_per_s", "memory_bytes", "goodput", "activation_checkpointing",
             "pipeline_schedule", "virtual_stages", "sequence_parallel", "reshard_after_forward",
             "tokens_per_s_per_device", "mfu")
SWITCHES = ("both", "on", "off")


PLAN_DEFAULTS = {"model": "llama-3.2-3b", "seq_len": 0, "gpus": 8, "global_batch": 16, "max_batch": None,
                 "memory_gb": None, "micro_batch_sizes": "1,2,4,8,16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser, "plan")
    parser.add_argument("--model", default=None,
                        help=f"model shape, one of: {', '.join(MODELS)}, or a Hugging Face "
                             "config.json path (default llama-3.2-3b)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length in tokens (default: the model's; 2048 for a config.json)")
    parser.add_argument("--gpus", type=int, default=None, help="world size (default 8)")
    parser.add_argument("--hardware", default="h100-sxm",
                        help=f"hardware profile, one of: {', '.join(HARDWARE)} (default h100-sxm)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="global batch size in samples (default 16)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="also rank every larger batch up to this one (default: fixed batch)")
    parser.add_argument("--b-noise", type=float, default=None,
                        help="gradient noise scale in samples (default: unknown, efficiency 1)")
    parser.add_argument("--no-lr-aware", action="store_true",
                        help="no sqrt(B) learning-rate factor in goodput")
    parser.add_argument("--micro-batch-sizes", default=None,
                        help="comma-separated micro-batch sizes (default 1,2,4,8,16)")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="memory per device in GB (default: the hardware profile's)")
    parser.add_argument("--top", type=int, default=10, help="rows to show (default 10)")
    parser.add_argument("--by-layout", action="store_true",
                        help="one row per (dp, tp, pp): its best micro-batch size and batch")
    parser.add_argument("--json", action="store_true", help="print JSON (a list, best first)")
    parser.add_argument("--activation-checkpointing", default="all", metavar="MODE",
                        help=f"one of: {', '.join(AC_MODES)}, or all (default: rank all three)")
    parser.add_argument("--pipeline-schedule", default="all", metavar="NAME",
                        help=f"one of: {', '.join(PIPELINE_SCHEDULES)}, or all (default all)")
    parser.add_argument("--virtual-stages", default="2,4",
                        help="chunks per rank tried with interleaved-1f1b (default 2,4)")
    parser.add_argument("--sequence-parallel", default="both", metavar="on|off|both",
                        help="sequence parallel with tp > 1 (default both)")
    parser.add_argument("--reshard-after-forward", default="both", metavar="on|off|both",
                        help="FSDP2 reshard after forward (default both)")
    parser.add_argument("--compile", action="store_true",
                        help=f"price torch.compile: compute time / {COMPILE_SPEEDUP:g} (fitted)")
    parser.add_argument("--no-flash-attention", action="store_true",
                        help="eager attention: scores stored (5·a·s²·b/t bytes per block) and "
                             "their memory traffic priced")
    parser.add_argument("--param-dtype", default="fp32", metavar="fp32|bf16",
                        help="fp32: copus's runtime (fp32 params, bf16 autocast); bf16: FSDP2 "
                             "MixedPrecisionPolicy as torchtitan (default fp32)")


def parse_sizes(text: str, flag: str = "--micro-batch-sizes") -> list[int]:
    """'1,2,4' -> [1, 2, 4]; ValueError naming the bad value."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"{flag}={text!r} is invalid; allowed: comma-separated "
                         "integers >= 1, e.g. 1,2,4,8")
    return sizes


def _check(args: argparse.Namespace) -> None:
    if args.seq_len < 0:
        raise ValueError(f"--seq-len={args.seq_len} is invalid; allowed: an integer >= 1 "
                         "(0 = the model's own)")
    for name in ("gpus", "global_batch", "top"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} is invalid; allowed: an integer >= 1")
    if args.max_batch is not None and args.max_batch < args.global_batch:
        raise ValueError(f"--max-batch={args.max_batch} is invalid; allowed: >= --global-batch="
                         f"{args.global_batch}")
    if args.b_noise is not None and not (math.isfinite(args.b_noise) and args.b_noise > 0):
        raise ValueError(f"--b-noise={args.b_noise} is invalid; allowed: a number > 0")
    if args.memory_gb is not None and not (math.isfinite(args.memory_gb) and args.memory_gb > 0):
        raise ValueError(f"--memory-gb={args.memory_gb} is invalid; allowed: a number > 0")
    if args.activation_checkpointing != "all":
        check_choice("--activation-checkpointing", args.activation_checkpointing, AC_MODES)
    if args.pipeline_schedule != "all":
        check_choice("--pipeline-schedule", args.pipeline_schedule, PIPELINE_SCHEDULES)
    for name in ("sequence_parallel", "reshard_after_forward"):
        check_choice(f"--{name.replace('_', '-')}", getattr(args, name), SWITCHES)
    check_choice("--param-dtype", args.param_dtype, ("fp32", "bf16"))
    if any(v < 2 for v in parse_sizes(args.virtual_stages, "--virtual-stages")):
        raise ValueError(f"--virtual-stages={args.virtual_stages!r} is invalid; allowed: integers >= 2")


def plan_options(args: argparse.Namespace, stack: str = "fsdp2") -> list[dict]:
    """The option sets the flags allow (`core.plan.goodput.option_grid`); the Megatron stack
    has no FSDP, so reshard-after-forward stays at its default there."""
    switch = {"both": (False, True), "on": (True,), "off": (False,)}
    raf = (True,) if stack == "megatron" else switch[args.reshard_after_forward][::-1]
    return option_grid(
        ac_modes=AC_MODES if args.activation_checkpointing == "all" else (args.activation_checkpointing,),
        schedules=PIPELINE_SCHEDULES if args.pipeline_schedule == "all" else (args.pipeline_schedule,),
        virtual_stages=parse_sizes(args.virtual_stages, "--virtual-stages"),
        sequence_parallel=switch[args.sequence_parallel],
        reshard_after_forward=raf)


def plan_rows(args: argparse.Namespace, *, hardware: HardwareProfile | None = None,
              compute_speedup: float | None = None) -> list[RankedPlan]:
    """The ranked plans `copus plan` prints (best first, at most `--top`).

    Library use (bench/published.py): `hardware` replaces the `--hardware` profile and
    `compute_speedup` the `--compile` factor (e.g. compile × a stated float8 factor).
    """
    fill_from_config(args, TRAIN_KEYS, PLAN_DEFAULTS)
    _check(args)
    shape = get_model_shape(args.model, args.seq_len)
    hw = get_hardware(args.hardware) if hardware is None else hardware
    capacity = hw.memory_bytes if args.memory_gb is None else args.memory_gb * GB
    memory = memory_model(shape, hw, args.param_dtype, flash_attention=not args.no_flash_attention)
    max_batch = args.global_batch if args.max_batch is None else args.max_batch
    cands = build_candidates(args.gpus, shape, min_batch=args.global_batch, max_batch=max_batch,
                             micro_batch_sizes=parse_sizes(args.micro_batch_sizes),
                             memory_model=memory, memory_capacity_bytes=capacity,
                             options=plan_options(args, hw.stack))
    if not len(cands):
        raise ValueError(f"no plan of {args.model} fits {args.gpus} x {hw.name} with "
                         f"{capacity / GB:.1f} GB per device at global batch {args.global_batch}")
    if compute_speedup is None:
        compute_speedup = COMPILE_SPEEDUP if args.compile else 1.0
    model = StepTimeModel.analytic(shape, hw, args.gpus, param_bytes=2 if args.param_dtype == "bf16" else 4,
                                   compile_speedup=compute_speedup, flash_attention=not args.no_flash_attention)
    b_noise = float("inf") if args.b_noise is None else args.b_noise
    rows = ranked(cands, model, b_noise, lr_aware=not args.no_lr_aware, ref_batch=1.0,
                  lr_ref_batch=float(args.global_batch), top=None if args.by_layout else args.top)
    return best_per_layout(rows)[:args.top] if args.by_layout else rows


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
    return MemoryModel(shape=shape, mixed_precision=hw.dtype_bytes == 2, stack=hw.stack,
                       distributed_optimizer=hw.distributed_optimizer, autocast=not bf16,
                       loss_parallel=bf16, logit_bytes=12.0 if bf16 else None, flash_attention=flash_attention,
                       allocator_overhead=ALLOCATOR_OVERHEAD if hw.dtype_bytes == 2 and hw.stack == "fsdp2"
                       else 0.0)


def tokens_per_s_per_device(row: RankedPlan, seq_len: int) -> float:
    """samples/s · seq_len / world size."""
    return row.samples_per_s * seq_len / row.plan.world_size


def mfu(row: RankedPlan, shape, hw) -> float:
    """Model FLOPs utilisation: tokens/s/device · (6N + 12·L·h·s) / peak (no recompute counted)."""
    return tokens_per_s_per_device(row, shape.seq_len) * shape.flops_per_token() / hw.peak_flops


def row_dict(row: RankedPlan, shape=None, hw=None) -> dict:
    p = row.plan
    out = {"dp": p.dp, "tp": p.tp, "pp": p.pp, "micro_batch_size": p.micro_batch_size,
           "num_microbatches": p.num_microbatches, "global_batch_size": p.global_batch_size,
           "step_s": row.step_s, "samples_per_s": row.samples_per_s,
           "memory_bytes": row.memory_bytes, "goodput": row.goodput, **p.options}
    if shape is not None and hw is not None:
        out["tokens_per_s_per_device"] = tokens_per_s_per_device(row, shape.seq_len)
        out["mfu"] = mfu(row, shape, hw)
    return out


def format_table(rows: list[RankedPlan]) -> str:
    """The ranked rows as a table; `vs #1` is each row's goodput deficit to the first."""
    head = (f"{'#':>3}  {'dp':>3} {'tp':>3} {'pp':>3} {'mbs':>4} {'n_mb':>5} {'B':>6}  "
            f"{'step_s':>9} {'samples/s':>10} {'eff':>6} {'goodput':>10} {'vs #1':>7} {'mem GB':>7}  options")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        p = r.plan
        gap = 100.0 * (1.0 - r.goodput / rows[0].goodput)
        lines.append(f"{i:>3}  {p.dp:>3} {p.tp:>3} {p.pp:>3} {p.micro_batch_size:>4} "
                     f"{p.num_microbatches:>5} {p.global_batch_size:>6}  {r.step_s:>9.4g} "
                     f"{r.samples_per_s:>10.4g} {r.efficiency:>6.3f} {r.goodput:>10.4g} "
                     f"{-gap + 0.0:>+6.1f}% {r.memory_bytes / GB:>7.1f} {p.options_suffix()}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rows = plan_rows(args)
    if args.json:
        shape = get_model_shape(args.model, args.seq_len)
        print(json.dumps([row_dict(r, shape, get_hardware(args.hardware)) for r in rows], indent=1))
    else:
        b = "unknown" if args.b_noise is None else f"{args.b_noise:g}"
        print(f"{args.model} (seq {get_model_shape(args.model, args.seq_len).seq_len}) on "
              f"{args.gpus} x {args.hardware} ({get_hardware(args.hardware).stack}), global batch "
              f"{args.global_batch}{'' if args.max_batch is None else f'..{args.max_batch}'}, "
              f"b_noise {b}; best {len(rows)} {'layouts' if args.by_layout else 'plans'} by predicted goodput")
        print(format_table(rows))
    return 0
