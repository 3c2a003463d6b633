"""The tiny stepwise-ramp run (4 -> 8 -> 12 samples over 6 steps) that the console and end-to-end
command tests launch with `copus train`."""

from __future__ import annotations


def ramp_args(nproc: int, checkpoint_interval: int) -> list[str]:
    """`copus train` arguments for 6 steps of a stepwise ramp on `nproc` ranks, evaluating every 2
    steps and checkpointing every `checkpoint_interval` steps (0: never)."""
    settings = [
        "batch.initial=4",
        "batch.min=4",
        "batch.ramp_to=12",
        "batch.ramp_kind='stepwise'",
        "batch.ramp_samples=8",
        "batch.ramp_steps=2",
        "batch.warmup_steps=1",
        "batch.interval_steps=1",
        "data.max_chars=60000",
        "eval.interval_steps=2",
        "eval.num_samples=4",
        f"checkpoint.interval_steps={checkpoint_interval}",
        "log.tensorboard=false",
        "log.progress_interval_s=0",
    ]
    args = ["--nproc", str(nproc), "--max-steps", "6", "--policy", "ramp", "--seed", "1"]
    for setting in settings:
        args += ["--set", setting]
    return args
