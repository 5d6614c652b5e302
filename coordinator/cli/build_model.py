"""`lockgate build-model`: build (or find cached) the tiny offline test model and print its
path (trainer/tiny_models/builder.py)."""

from __future__ import annotations

import argparse

from lockgate.coordinator.cli.options import Subcommands


def add_parser(sub: Subcommands) -> None:
    build = sub.add_parser(
        "build-model", help="build (or find cached) the tiny offline test model; print its path"
    )
    build.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lockgate.trainer.tiny_models.builder import ensure_tiny_model  # torch is slow to import

    print(ensure_tiny_model())
    return 0
