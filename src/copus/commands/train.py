"""`copus train`: train a model with adaptive batch size and parallel plan.

With no arguments this is a real, small run: the `tiny` model on the embedded corpus, 2 local
workers, the `goodput` policy, 800k tokens (a few minutes on 2 idle CPU cores); the batch grows from
8 as the gradient noise scale rises. Everything is configurable with --config / --set.
Config, plan and run folder are validated before any worker starts (a mistake exits 2 with one
line; one run per folder, `runtime/state/run_folder.py`). Ctrl-C or SIGTERM stops after the current
step with a checkpoint and exits 130 / 143 (`runtime/train/stop.py`); a second signal aborts at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tomllib
from pathlib import Path

# Command-line defaults for the no-argument run, applied only where neither the config file nor
# --set/flags name the key (docs/internals.md defaults otherwise).
DEFAULT_RUN = {
    ("parallel", "nproc"): 2,
    ("train", "max_tokens"): 800_000,
    # With dp·num_microbatches = 2 small gradients per step the b_noise estimate's relative error
    # hovers around 0.5-0.8 on this model; 1.0 lets the controller decide (growth stays capped
    # at batch.max_growth per decision and the batch never shrinks).
    ("gns", "max_rel_err"): 1.0,
    ("train", "warmup_tokens"): 50_000,
    ("batch", "max"): 128,
    ("eval", "interval_steps"): 25,
    ("checkpoint", "interval_steps"): 100,
    # keep FSDP2 parameters gathered through the gradient accumulation (one all-gather per
    # step; 23-32% less CPU time for dp plans, docs/plan-moves.md); tiny model, memory is no issue
    ("parallel", "reshard_after_forward"): False,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from copus.config import Config

    d = Config()

    def default(section: str, key: str) -> object:
        """What a run without --config/--set uses: the command's default, else the config's."""
        return DEFAULT_RUN.get((section, key), getattr(getattr(d, section), key))

    p.add_argument(
        "--config", metavar="FILE", help="TOML config file (docs/internals.md; default: none, built-in defaults)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key (repeatable; default: none)",
    )
    p.add_argument(
        "--nproc", type=int, help=f"local workers to start (parallel.nproc, default {default('parallel', 'nproc')})"
    )
    p.add_argument("--run-dir", metavar="DIR", help="run folder, new or empty (default runs/<timestamp>)")
    p.add_argument(
        "--max-steps",
        type=int,
        help=f"stop after N optimizer steps (train.max_steps, default {default('train', 'max_steps')} = no step limit)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        help=f"stop after N tokens (train.max_tokens, default {default('train', 'max_tokens')})",
    )
    p.add_argument(
        "--policy",
        help="batch policy (batch.policy): constant, ramp, norm-test, "
        "norm-test-lau, "
        "inner-product-test, gns, goodput, goodput-copus, schedule (batch.schedule), "
        "doubling (default "
        f"{default('batch', 'policy')})",
    )
    p.add_argument(
        "--model",
        help=f"model shape name or a Hugging Face config.json (model.name, default {default('model', 'name')})",
    )
    p.add_argument(
        "--init-from",
        metavar="HF_FOLDER",
        help="start from a Hugging Face model's weights (config.json + safetensors; "
        "model.init_from); its config.json is the model and its tokenizer the "
        "tokenizer unless --model / data.tokenizer say otherwise",
    )
    p.add_argument("--seq-len", type=int, help="sequence length in tokens (model.seq_len; default 0 = the model's)")
    p.add_argument("--seed", type=int, help=f"seed (train.seed, default {default('train', 'seed')})")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="auto",
        help="continue from the latest good checkpoint in --run-dir (any plan); "
        "'--resume auto': resume if --run-dir holds a complete checkpoint, else "
        "start fresh there (for requeue scripts; default: start a new run)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as TOML (file <- --set <- flags) and exit",
    )
    p.add_argument(
        "--max-restarts", type=int, default=3, help="restarts of failed local workers, each resuming from a checkpoint"
    )


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """Convenience flags as `section.key=value` overrides (they win over --set)."""
    out = []
    for flag, key in (
        ("nproc", "parallel.nproc"),
        ("max_steps", "train.max_steps"),
        ("max_tokens", "train.max_tokens"),
        ("seed", "train.seed"),
        ("seq_len", "model.seq_len"),
    ):
        value = getattr(args, flag)
        if value is not None:
            out.append(f"{key}={int(value)}")
    for flag, key in (("policy", "batch.policy"), ("model", "model.name")):
        value = getattr(args, flag)
        if flag == "model" and value is not None and value.endswith(".json"):
            value = os.path.abspath(value)  # workers and resumed runs find the same file
        if value is not None:
            out.append(f"{key}={_toml_str(value)}")
    return out


def _toml_value(v: object) -> str:
    """A default as a TOML literal (`False` → `false`; numbers as they are)."""
    return str(v).lower() if isinstance(v, bool) else str(v)


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _named_keys(config_path: str | None, overrides: list[str]) -> set[tuple[str, str]]:
    """(section, key) pairs the user set explicitly, in the file or on the command line."""
    from copus.config import parse_override

    named: set[tuple[str, str]] = set()
    if config_path is not None:
        try:
            with open(config_path, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError):
            data = {}  # load_config reports the problem
        named |= {(s, k) for s, keys in data.items() if isinstance(keys, dict) for k in keys}
    for text in overrides:
        section, key, _ = parse_override(text)
        named.add((section, key))
    return named


def resolve_config(args: argparse.Namespace):
    """Config file ← command defaults (unnamed keys only) ← --set ← flags; validated."""
    from copus.config import load_config

    config_path = args.config
    run_dir = Path(args.run_dir) if args.run_dir else None
    if args.resume and config_path is None and run_dir and (run_dir / "config.toml").is_file():
        config_path = str(run_dir / "config.toml")  # resume the run as it was configured
    user = list(args.overrides) + flag_overrides(args)
    named = _named_keys(config_path, user)
    user += init_from_overrides(getattr(args, "init_from", None), named)
    defaults = (
        [] if args.resume else [f"{s}.{k}={_toml_value(v)}" for (s, k), v in DEFAULT_RUN.items() if (s, k) not in named]
    )
    if ("train", "max_steps") in named and ("train", "max_tokens") not in named:
        defaults = [d for d in defaults if not d.startswith("train.max_tokens=")]
    cfg = load_config(config_path, defaults + user)
    if cfg.train.max_steps == 0 and cfg.train.max_tokens == 0:
        # (a decaying LR schedule without max_tokens decays over max_steps x initial batch)
        raise ValueError("train.max_tokens=0: allowed: an integer > 0 when train.max_steps=0 (set one of them)")
    return cfg


def init_from_overrides(folder: str | None, named: set[tuple[str, str]]) -> list[str]:
    """`--init-from DIR`: model.init_from, and DIR's config.json / tokenizer where the user named
    no model / tokenizer."""
    if folder is None:
        return []
    root = os.path.abspath(folder)
    out = [f"model.init_from={_toml_str(root)}"]
    if ("model", "name") not in named:
        out.append(f"model.name={_toml_str(os.path.join(root, 'config.json'))}")
    if ("data", "tokenizer") not in named and os.path.isfile(os.path.join(root, "tokenizer.json")):
        out.append(f"data.tokenizer={_toml_str(root)}")
    return out


def default_run_dir() -> Path:
    """runs/<timestamp>, or runs/<timestamp>-2, -3, ... when that one is taken (one run per
    folder); under torchrun runs/<run id>, the same on every rank and node."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if "RANK" in os.environ and run_id and run_id != "none":
        return Path("runs") / f"torchrun-{run_id}"
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def print_config(args: argparse.Namespace) -> int:
    """`--print-config`: the resolved config as TOML on stdout (loadable with --config), exit 0."""
    from copus.config import config_to_toml

    sys.stdout.write(config_to_toml(resolve_config(args)))
    return 0


ATTEMPTS = "previous-attempts"


def has_complete_checkpoint(run_dir: Path) -> bool:
    """`--resume auto` resumes when `run_dir/checkpoints` holds a verified checkpoint."""
    from copus.runtime.state.checkpoint import find_latest

    root = run_dir / "checkpoints"
    return root.is_dir() and find_latest(root, log=lambda _: None) is not None


def holds_failed_attempt(run_dir: Path) -> bool:
    """A copus run (or set-aside attempts) without a complete checkpoint: `--resume auto` restarts it."""
    from copus.runtime.state.run_folder import RUN_FILES

    return run_dir.is_dir() and any((run_dir / n).exists() for n in (*RUN_FILES, ATTEMPTS))


def set_aside(run_dir: Path) -> Path:
    """Move an attempt that never saved a complete checkpoint to `run_dir/previous-attempts/<k>/`
    (kept for its logs), so the fresh run's metrics do not mix with it."""
    aside = run_dir / ATTEMPTS
    k = 1 + sum(1 for _ in aside.iterdir()) if aside.is_dir() else 1
    target = aside / str(k)
    target.mkdir(parents=True)
    for entry in list(run_dir.iterdir()):
        if entry.name != ATTEMPTS:
            entry.rename(target / entry.name)
    return target


def run(args: argparse.Namespace) -> int:
    """Validate everything, then train (spawning workers unless under torchrun)."""
    if args.resume not in (True, False, "auto"):
        raise ValueError(f"--resume {args.resume!r}: allowed: --resume, or --resume auto")
    if args.resume and not args.run_dir:
        raise ValueError("--resume needs --run-dir DIR (the run folder to continue)")
    if args.print_config:
        return print_config(args)
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts={args.max_restarts}: allowed: an integer >= 0")
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    from copus.runtime.state import run_folder

    rank0 = os.environ.get("RANK", "0") == "0"
    run_id = _elastic_run_id()
    restart = False  # --resume auto on a folder whose attempt never saved a checkpoint
    if args.resume == "auto":
        if "RANK" in os.environ:
            raise ValueError(
                "--resume auto: allowed only with copus's own launcher (under torchrun "
                "copus resumes the same elastic run by itself; use --resume)"
            )
        args.resume = has_complete_checkpoint(run_dir)
        restart = not args.resume and holds_failed_attempt(run_dir)
    if rank0 and not restart:  # under torchrun the other ranks' processes see rank 0's folder appear
        run_folder.check_run_dir(run_dir, resume=args.resume, run_id=run_id)
    cfg = resolve_config(args)
    from copus.config import model_shape

    if model_shape(cfg).unsupported:  # priceable by `copus plan`, not buildable (hf_config.py)
        raise ValueError(model_shape(cfg).unsupported)

    from copus.runtime.train import launch, setup

    setup.validate_before_launch(cfg, setup.world_size(cfg))
    if cfg.train.compile:  # inductor missing: one line, exit 2, before any worker starts
        from copus.runtime.engine.parallelize import check_compile_available

        check_compile_available()
    from copus.runtime.state.trackers import check_available

    check_available(cfg.log)
    if cfg.model.init_from:
        import importlib.util

        if importlib.util.find_spec("safetensors") is None:
            raise ValueError(
                f"model.init_from={cfg.model.init_from!r}: reading Hugging Face weights "
                "needs the safetensors package; allowed: pip install 'copus[export]'"
            )
    if restart:
        print(
            f"copus train: --resume auto: no complete checkpoint in {run_dir}; starting fresh "
            f"(the earlier attempt's files: {set_aside(run_dir)})",
            file=sys.stderr,
        )
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        run_folder.write_state(run_dir, "running", run_id=run_id)
        print(f"copus train: run folder {run_dir}", file=sys.stderr)
    try:
        result = launch.launch(cfg, str(run_dir), resume=args.resume, max_restarts=args.max_restarts)
    except Exception as exc:  # ChildFailedError and friends: one line, details are above
        print(
            f"copus train: error: workers failed ({exc.__class__.__name__}); see the log above and {run_dir}",
            file=sys.stderr,
        )
        return 1
    return _outcome(result, run_dir, rank0)


def _elastic_run_id() -> str | None:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return run_id if run_id and run_id != "none" else None


def _outcome(result: dict, run_dir: Path, rank0: bool) -> int:
    """Print the one closing line (errors, stop, abort) and return the exit code."""
    from copus.runtime.train import stop

    if result.get("aborted"):
        if rank0:
            print(
                f"copus train: aborted by a second signal ({result['aborted']}); the last complete "
                f"checkpoint in {run_dir / 'checkpoints'} is kept; resume: copus train "
                f"--run-dir {run_dir} --resume",
                file=sys.stderr,
            )
        return int(result["exit_code"])
    if result.get("stopped"):
        if rank0:
            line = stop.stop_line(result["stopped"], str(run_dir), torchrun="RANK" in os.environ)
            print(f"copus train: {line}", file=sys.stderr)
        return int(result["stopped"]["exit_code"])
    if result.get("error"):
        print(f"copus train: error: {result['error']}", file=sys.stderr)
        return 2 if result.get("kind") == "value" else 1
    return 0
