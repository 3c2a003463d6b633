"""`copus report RUN_DIR [RUN_DIR ...] --out report/`: plots and a Markdown summary."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="copus run folders")
    p.add_argument("--out", default="report", help="output folder (default: report/)")
    p.add_argument(
        "--targets",
        default="",
        help="comma-separated validation-loss targets (default: none, time-to-target columns left out)",
    )


def _targets(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--targets={text!r}: allowed: comma-separated numbers, e.g. 2.5,2.2") from None


def run(args: argparse.Namespace) -> int:
    from copus.reporting.report import write_report
    from copus.reporting.runs import load_run

    runs = [load_run(d) for d in args.run_dirs]
    path = write_report(runs, Path(args.out), _targets(args.targets))
    print(f"wrote {path} and {len(list(path.parent.glob('*.png')))} plots")
    return 0
