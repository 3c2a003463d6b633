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
"""

from __future__ import annotations

import argparse
import json
import math

from copus.core.plan.goodput import build_candidates
from copus.core.specs.hardware import GB, HARDWARE, get_hardware
from copus.core.cost.memory import MemoryModel
from copus.core.specs.models import MODELS
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.search import RankedPlan, ranked
from copus.core.cost.throughput import StepTimeModel
from copus.commands.config_defaults import TRAIN_KEYS, add_config_argument, fill_from_config

JSON_KEYS = ("dp", "tp", "pp", "micro_batch_size", "num_microbatches", "global_batch_size",
             "step_s", "samples_per_s", "memory_bytes", "goodput")


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


def parse_sizes(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; ValueError naming the bad value."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"--micro-batch-sizes={text!r} is invalid; allowed: comma-separated "
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


def plan_rows(args: argparse.Namespace) -> list[RankedPlan]:
    """The ranked plans `copus plan` prints (best first, at most `--top`)."""
    fill_from_config(args, TRAIN_KEYS, PLAN_DEFAULTS)
    _check(args)
    shape = get_model_shape(args.model, args.seq_len)
    hw = get_hardware(args.hardware)
    capacity = hw.memory_bytes if args.memory_gb is None else args.memory_gb * GB
    memory = memory_model(shape, hw)
    max_batch = args.global_batch if args.max_batch is None else args.max_batch
    cands = build_candidates(args.gpus, shape, min_batch=args.global_batch, max_batch=max_batch,
                             micro_batch_sizes=parse_sizes(args.micro_batch_sizes),
                             memory_model=memory, memory_capacity_bytes=capacity)
    if not len(cands):
        raise ValueError(f"no plan of {args.model} fits {args.gpus} x {args.hardware} with "
                         f"{capacity / GB:.1f} GB per device at global batch {args.global_batch}")
    model = StepTimeModel.analytic(shape, hw, args.gpus)
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


def memory_model(shape, hw) -> MemoryModel:
    """The memory model of the stack `hw` describes (FSDP2 runtime or Megatron, core/cost/memory.py)."""
    return MemoryModel(shape=shape, mixed_precision=hw.dtype_bytes == 2, stack=hw.stack,
                       distributed_optimizer=hw.distributed_optimizer)


def row_dict(row: RankedPlan) -> dict:
    p = row.plan
    return {"dp": p.dp, "tp": p.tp, "pp": p.pp, "micro_batch_size": p.micro_batch_size,
            "num_microbatches": p.num_microbatches, "global_batch_size": p.global_batch_size,
            "step_s": row.step_s, "samples_per_s": row.samples_per_s,
            "memory_bytes": row.memory_bytes, "goodput": row.goodput}


def format_table(rows: list[RankedPlan]) -> str:
    """The ranked rows as a table; `vs #1` is each row's goodput deficit to the first."""
    head = (f"{'#':>3}  {'dp':>3} {'tp':>3} {'pp':>3} {'mbs':>4} {'n_mb':>5} {'B':>6}  "
            f"{'step_s':>9} {'samples/s':>10} {'eff':>6} {'goodput':>10} {'vs #1':>7} {'mem GB':>7}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        p = r.plan
        gap = 100.0 * (1.0 - r.goodput / rows[0].goodput)
        lines.append(f"{i:>3}  {p.dp:>3} {p.tp:>3} {p.pp:>3} {p.micro_batch_size:>4} "
                     f"{p.num_microbatches:>5} {p.global_batch_size:>6}  {r.step_s:>9.4g} "
                     f"{r.samples_per_s:>10.4g} {r.efficiency:>6.3f} {r.goodput:>10.4g} "
                     f"{-gap + 0.0:>+6.1f}% {r.memory_bytes / GB:>7.1f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rows = plan_rows(args)
    if args.json:
        print(json.dumps([row_dict(r) for r in rows], indent=1))
    else:
        b = "unknown" if args.b_noise is None else f"{args.b_noise:g}"
        print(f"{args.model} (seq {get_model_shape(args.model, args.seq_len).seq_len}) on "
              f"{args.gpus} x {args.hardware} ({get_hardware(args.hardware).stack}), global batch "
              f"{args.global_batch}{'' if args.max_batch is None else f'..{args.max_batch}'}, "
              f"b_noise {b}; best {len(rows)} {'layouts' if args.by_layout else 'plans'} by predicted goodput")
        print(format_table(rows))
    return 0
