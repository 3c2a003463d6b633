"""`copus` command line: train | plan | profile | simulate | report | prepare | export | calibrate.

Each subcommand lives in its own module under `copus.commands`, imported only when used, so
`copus plan` and `copus simulate` never import torch. User mistakes exit 2 with one line.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from copus import __version__

SUBCOMMANDS = {
    "train": "train a model with adaptive batch size and parallelism",
    "plan": "rank parallel plans by predicted goodput (what-if, no GPUs needed)",
    "profile": "measure step time and memory of parallel plans",
    "simulate": "simulate every policy on a cluster of 8 to 1,024+ GPUs",
    "report": "plots and a summary table from run folders",
    "prepare": "tokenize text once into token shards that training streams",
    "export": "write a checkpoint as a Hugging Face model folder (safetensors + config.json)",
    "calibrate": "measure the critical batch and the noise-scale calibration c by branching",
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2), like every other copus error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default: argparse's ArgumentDefaultsHelpFormatter, except
    where the text already names it, or there is none to show (None, False, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default in ("", [], argparse.SUPPRESS)
            or action.option_strings == []
            or isinstance(action, argparse._HelpAction)
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="copus", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"copus {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.subcommand_parsers = {}  # name -> parser: main() reports unknown flags on it
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_DefaultsFormatter)
        parser.subcommand_parsers[name] = p
        module = _command_module(name)
        if module is not None:
            module.add_arguments(p)
    return parser


def _command_module(name: str):
    try:
        return importlib.import_module(f"copus.commands.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"copus.commands.{name}":
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # `copus plan --gpu-count 8`: one line naming the subcommand and the flag, exit 2
        parser.subcommand_parsers.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 0
    module = _command_module(args.command)
    if module is None:
        print(f"copus {args.command}: not implemented yet", file=sys.stderr)
        return 2
    try:
        return int(module.run(args) or 0)
    except ValueError as exc:  # user mistakes: one line, exit 2, no traceback
        print(f"copus {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a run's graceful stop (runtime/train/stop.py)
        print(f"copus {args.command}: interrupted", file=sys.stderr)
        return 130
