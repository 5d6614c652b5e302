"""`lockgate report RUN_DIR...`: a run's metrics as PNG plots and a self-contained report.html
(several runs: their reward curves overlaid); the plotting is coordinator/metrics/report.py."""

from __future__ import annotations

import argparse
from pathlib import Path

from lockgate.coordinator.cli.options import Subcommands
from lockgate.coordinator.errors import UsageError


def add_parser(sub: Subcommands) -> None:
    report = sub.add_parser(
        "report",
        help="plot a run's metrics into RUN_DIR/report/ (or compare several runs)",
        description="Write PNG plots and a self-contained report.html from each run's "
        "metrics.jsonl. One run: RUN_DIR/report/ by default. Several runs: their reward curves "
        "overlaid, written to --out.",
    )
    report.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="a run dir")
    report.add_argument("--out", type=Path, help="output dir (needed with several runs)")
    report.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lockgate.coordinator.metrics.report import write_report  # matplotlib is slow

    try:
        report = write_report(args.run_dirs, args.out)
    except OSError as exc:
        raise UsageError(f"cannot write the report: {exc}") from exc
    print(report.html)
    return 0
