"""Does a replica read what the trainer writes? A probe for deploy checks.

Before a run syncs weights through the disk transport, `lockgate train` writes a probe file
where the trainer's snapshots will go and asks each replica, through the worker extension
(`POST /collective_rpc {"method": "lockgate_read_probe", "args": [PATH]}`), what it reads
there. Another content, or nothing, means the replica does not share the trainer's weights
volume at the same path, which would otherwise surface as a failed load at the first sync.
Only files named as probes are read: the route is no way to read the replica's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROBE_METHOD = "lockgate_read_probe"
PROBE_PREFIX = ".lockgate-probe-"
_MAX_BYTES = 256


def read_probe(path: str) -> dict[str, Any]:
    """{"found": True, "content": TEXT} for a probe file at `path`, else {"found": False,
    "reason"}."""
    file = Path(path)
    if not file.name.startswith(PROBE_PREFIX):
        return {"found": False, "reason": "not a probe file"}
    try:
        with file.open("rb") as f:
            content = f.read(_MAX_BYTES)
    except OSError as exc:
        return {"found": False, "reason": f"{type(exc).__name__}: {exc.strerror or exc}"}
    return {"found": True, "content": content.decode("ascii", "replace")}
