"""`copus export RUN_DIR [--step N] --out DIR`: a checkpoint as a Hugging Face Llama folder."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a copus run folder")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="the checkpoint step (default: the latest valid one)")
    p.add_argument("--out", required=True, metavar="DIR", help="the new folder to write")


def run(args: argparse.Namespace) -> int:
    from copus.runtime.state.export import export

    path = export(args.run_dir, args.out, step=args.step)
    print(f"copus export: {path} -> {args.out} (LlamaForCausalLM: "
          "transformers.AutoModelForCausalLM.from_pretrained)")
    return 0
