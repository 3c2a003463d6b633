"""`copus export RUN_DIR [--step N] [--dtype D] --out DIR`: a checkpoint as a Hugging Face folder."""

from __future__ import annotations

import argparse

DTYPE_NAMES = ("bfloat16", "float16", "float32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a copus run folder")
    p.add_argument(
        "--step", type=int, default=None, metavar="N", help="the checkpoint step (default: the latest valid one)"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the new folder to write")
    p.add_argument(
        "--dtype",
        default="float32",
        metavar="|".join(DTYPE_NAMES),
        help="dtype of the written weights (bfloat16 halves the folder; default float32, as training stores them)",
    )


def run(args: argparse.Namespace) -> int:
    if args.dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype={args.dtype!r} is invalid; allowed: {', '.join(DTYPE_NAMES)}")
    from copus.runtime.state.export import export

    path = export(args.run_dir, args.out, step=args.step, dtype=args.dtype)
    arch = json_arch(args.out) or "a causal LM"
    print(
        f"copus export: {path} -> {args.out} ({arch}, {args.dtype}: transformers.AutoModelForCausalLM.from_pretrained)"
    )
    return 0


def json_arch(out: str) -> str | None:
    """The architecture the written config.json names."""
    import json
    from pathlib import Path

    try:
        return json.loads((Path(out) / "config.json").read_text())["architectures"][0]
    except (OSError, KeyError, IndexError, ValueError):
        return None
