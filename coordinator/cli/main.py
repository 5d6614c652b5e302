"""The `lockgate` command: the top parser, built from one module per command, and the one place
that turns an error into what the command prints and its exit code.

Each command module registers its subcommand(s) with `add_parser(sub)`, which sets the
handler that runs them; a handler returns the exit code, or raises a `LockgateError`
(coordinator/errors.py), printed as `lockgate: <message>` on stderr with the error's exit code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from lockgate.coordinator.cli import (
    build_model,
    deploy,
    export_hf,
    report,
    session,
    sft,
    train,
    view,
)
from lockgate.coordinator.cli.options import Subcommands
from lockgate.coordinator.errors import LockgateError

# In the order `lockgate --help` lists them.
COMMANDS: list[Callable[[Subcommands], None]] = [
    train.add_parser,
    sft.add_parser,
    deploy.add_parser,  # replicas, gateway, serve
    session.add_parser,
    view.add_parser,
    build_model.add_parser,
    export_hf.add_parser,
    report.add_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockgate", description="Fully-asynchronous RL for LLM agents."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in COMMANDS:
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except LockgateError as exc:
        print(f"lockgate: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
