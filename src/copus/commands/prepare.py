"""`copus prepare INPUT... --out DIR`: tokenize text once into memory-mappable token shards."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help=".txt, .txt.gz, .jsonl, .jsonl.gz or .parquet files, or folders of them",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the prepared folder to write")
    p.add_argument(
        "--tokenizer",
        default="byte",
        metavar="SPEC",
        help="byte | bpe:N (train N tokens on the inputs) | PATH/tokenizer.json (default: byte)",
    )
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the JSON field / parquet column holding the text (default: text)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        metavar="F",
        help="fraction of documents held out for validation (default: 0.01)",
    )
    p.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizer processes (default: 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from copus.runtime.data.prepare import prepare

    meta = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        workers=args.workers,
        progress=not args.no_progress,
    )
    sp, tok = meta["splits"], meta["tokenizer"]
    print(
        f"copus prepare: {args.out}: {sp['train']['num_tokens']} training tokens in "
        f"{sp['train']['num_docs']} documents, {sp['val']['num_tokens']} validation tokens in "
        f"{sp['val']['num_docs']}; tokenizer {tok['spec']} (vocab {tok['vocab_size']}, "
        f"{meta['dtype']}); train with --set data.source={args.out}"
    )
    return 0
