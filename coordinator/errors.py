"""The coordinator's errors: one tree, so that the `lockgate` command catches one class.

Every error here is a `LockgateError`: its message is one line for the operator (a trainer's
failure adds the log tail that explains it) and its class carries the exit code the command
ends with. The tree, with where each class is raised:

* LockgateError               exit 2: bad input, found before anything ran
  + ConfigError               a config file, variable or --set that does not load (here)
  + UsageError                arguments that do not go together, a file missing or unusable
  + DeployError               a run part's place: model dir, ports, URLs (launch/deploy_checks.py)
  + ReportError               a run dir without usable metrics (metrics/report.py)
  + Interrupted               exit 130: Ctrl-C or SIGTERM stopped the command and what it started
  + RunFailed                 exit 1: failed at run time (SFT ranks, a gateway out of reach)
    - ReplicaStartError       a replica did not serve (launch/replicas.py)
    - GatewayStartError       a gateway did not serve (launch/gateway.py)
    - GatewayDied             a gateway the run started exited mid-run (launch/gateway.py)
    - TrainerError            the trainer failed a step or died (launch/trainer.py)
    - SyncFailed              no replica took the new weights (loop/training.py)
    - RunStopped              a run stopped on a failure the operator can act on (launch/local.py)

Other components' errors (the gateway's client, the trainer's export) are wrapped into one of
these where they cross into the command line. A config that does not load (pydantic's
ValidationError, ValueError, OSError) becomes a `ConfigError` in one place, `config_loading`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from pydantic import ValidationError

__all__ = [
    "ConfigError",
    "Interrupted",
    "LockgateError",
    "RunFailed",
    "UsageError",
    "config_loading",
]


class LockgateError(Exception):
    """An error the `lockgate` command reports as `lockgate: <message>`, exiting `exit_code`."""

    exit_code: ClassVar[int] = 2


class ConfigError(LockgateError):
    """A config (file, `LOCKGATE_<SECTION>__<FIELD>` variables, --set) that does not load."""


class UsageError(LockgateError):
    """Arguments that do not go together, or a file named that is missing or unusable."""


class Interrupted(LockgateError):
    """Ctrl-C or SIGTERM stopped the command after it stopped all it started."""

    exit_code: ClassVar[int] = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


class RunFailed(LockgateError):
    """Something started failed at run time: the input was fine, so the exit code is 1."""

    exit_code: ClassVar[int] = 1


def validation_message(exc: ValidationError) -> str:
    """The first error of `exc` as one line naming its field, and how many more there are."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"config error: {where}: {first['msg']}{more}"


def _config_message(path: Path | None, exc: ValueError | OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"config file not found: {exc.filename}"
    if isinstance(exc, ValidationError):
        return validation_message(exc)
    return f"{path}: {exc}" if path is not None else str(exc)


@contextlib.contextmanager
def config_loading(path: Path | None) -> Iterator[None]:
    """Raise a config from `path` (None: variables and flags only) that does not load as a
    `ConfigError`: the one place where loading's ValueError and OSError become one line."""
    try:
        yield
    except (ValueError, OSError) as exc:
        raise ConfigError(_config_message(path, exc)) from exc
