"""`lockgate build-model`: build (or find cached) a tiny offline test model and print its path:
the default Qwen3 one, or with `--format NAME` one of another chat family
(trainer/tiny_models/families.py; `--list` names them)."""

from __future__ import annotations

import argparse

from lockgate.coordinator.cli.options import Subcommands
from lockgate.coordinator.errors import UsageError


def add_parser(sub: Subcommands) -> None:
    build = sub.add_parser(
        "build-model", help="build (or find cached) a tiny offline test model; print its path"
    )
    build.add_argument(
        "--format",
        default="qwen3",
        metavar="NAME",
        help="the chat family to build it in (default: qwen3; --list names them all)",
    )
    build.add_argument(
        "--list", action="store_true", help="list the chat families and exit, building nothing"
    )
    build.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lockgate.trainer.tiny_models.families import FAMILIES

    if args.list:
        for name, chat in FAMILIES.items():
            print(f"{name:12} {chat.note}")
        return 0
    if args.format not in FAMILIES:
        raise UsageError(
            f"--format: no tiny model in format '{args.format}'; choose one of: "
            f"{', '.join(FAMILIES)}"
        )
    # torch is slow to import: only when a model is built.
    from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec
    from lockgate.trainer.tiny_models.harmony_vocab import MissingVocabulary

    try:
        print(ensure_tiny_model(spec=family_spec(args.format)))
    except MissingVocabulary as exc:  # gpt-oss's vocabulary comes from setup, never a download
        raise UsageError(f"--format {args.format}: {exc}") from exc
    return 0
