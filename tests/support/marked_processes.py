"""Finding a test run's processes: the test puts a unique variable in the run's environment,
and every process the run starts inherits it; or by process group."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def marked_environment(**extra: str) -> tuple[str, dict[str, str]]:
    """A fresh marker (`NAME=value`, what `processes_with_marker` looks for) and this process's
    environment with it and `extra` set, for a run whose processes a test must find."""
    value = uuid.uuid4().hex
    return f"LOCKGATE_TEST_RUN={value}", {**os.environ, "LOCKGATE_TEST_RUN": value, **extra}


def processes_with_marker(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def live_group_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that still run (zombies waiting for init to reap them are done)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out
