"""What the commands that take a config share: `--set` overrides, layered over the
`LOCKGATE_<SECTION>__<FIELD>` variables, and loading the run config through them."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TypeAlias

from lockgate.coordinator.config import RunConfig, env_overrides, load_config
from lockgate.coordinator.errors import config_loading

# What every command module registers its subcommands on (argparse's type is generic only
# to the type checker, hence the string).
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_overrides(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override an option, e.g. {example}",
    )


def overrides_with_env(overrides: list[str]) -> list[str]:
    """The `LOCKGATE_<SECTION>__<FIELD>` variables as overrides, then `overrides` (--set)."""
    return [*env_overrides(os.environ), *overrides]


def load_run_config(path: Path | None, overrides: list[str]) -> RunConfig:
    """The run config from `path` (None: defaults), the variables, then `overrides`; a
    `ConfigError` when it does not load."""
    with config_loading(path):
        return load_config(path, overrides_with_env(overrides))
