"""`--config FILE` for `copus plan` and `copus simulate`: a run's config fills the flags not given.

Precedence, per flag: given on the command line > the key in `--config` > the command's default.
So `copus plan --config run.toml` ranks the plans of the run `copus train --config run.toml`
would start (model, sequence length, world size, batch range, micro-batch size, memory budget),
and any flag still overrides. Pure (config.py is stdlib + core): no torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from copus.config import Config, load_config

ConfigKey = Callable[[Config], Any]  # a flag's value from the config; None = not set there


def add_config_argument(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"a copus train TOML config (or a run folder's config.toml): its keys fill "
        f"the {command} flags not given (flags win; default: none)",
    )


def fill_from_config(args: argparse.Namespace, keys: Mapping[str, ConfigKey], defaults: Mapping[str, Any]) -> None:
    """Set every flag in `defaults` that is None on `args`: from `--config` when `keys` maps it
    and the config sets it, else the default. Idempotent; a bad config is one ValueError line."""
    path = getattr(args, "config", None)
    cfg = load_config(path) if path else None
    for name, default in defaults.items():
        if getattr(args, name, None) is not None:
            continue
        value = keys[name](cfg) if cfg is not None and name in keys else None
        setattr(args, name, default if value is None else value)


def _positive(v: Any) -> Any:
    return v if v else None


TRAIN_KEYS: dict[str, ConfigKey] = {
    "model": lambda c: c.model.name,
    "seq_len": lambda c: c.model.seq_len,
    "gpus": lambda c: c.parallel.nproc,
    "global_batch": lambda c: c.batch.initial,
    "initial_batch": lambda c: c.batch.initial,
    "max_batch": lambda c: None if c.batch.policy == "constant" else c.batch.max,
    "memory_gb": lambda c: _positive(c.parallel.memory_budget_gb),
    "micro_batch_sizes": lambda c: str(c.parallel.micro_batch_size) if c.parallel.micro_batch_size else None,
    "tokens": lambda c: float(c.train.max_tokens) if c.train.max_tokens else None,
    "seed": lambda c: c.train.seed,
}
