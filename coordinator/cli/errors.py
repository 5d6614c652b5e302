"""How every `lockgate` command reports bad input: one line on stderr, `lockgate: ...`,
exit code 2 (1 for a failure at run time)."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import ValidationError


def error(message: str, code: int = 2) -> int:
    print(f"lockgate: {message}", file=sys.stderr)
    return code


def validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"config error: {where}: {first['msg']}{more}"


def config_error(path: Path | None, exc: ValueError | OSError) -> int:
    """The one-line message (exit 2) for a config (file, variables, flags) that did not load."""
    if isinstance(exc, FileNotFoundError):
        return error(f"config file not found: {exc.filename}")
    if isinstance(exc, ValidationError):
        return error(validation_message(exc))
    return error(f"{path}: {exc}" if path is not None else str(exc))
