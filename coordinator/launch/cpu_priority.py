"""The trainer first, on a machine where it shares the cores with the run's replicas.

Under the kernel's autogroup scheduling (`/proc/sys/kernel/sched_autogroup_enabled`, on in most
distributions) each session is a scheduling group, and CPU time is shared out between groups
before threads. The trainer's ranks run in a session of their own (torchrun starts them so);
the coordinator, its gateways, the environment and the local replicas share this process's
session (`processes.py` says why they must). Shared out equally, the trainer's one group gets
no more CPU than everything else of the run together, so its steps stretch, the trainer
becomes the bottleneck and generation runs ahead to the staleness bound. With this session's
group at a higher nice the trainer gets the cores it needs and generation is the bound again
(measured in docs/performance.md, "Coordinator: launching on a CPU machine").

A group's nice is raised (priority lowered) without privileges and set back when the run ends;
where autogroups are off, `/proc` is not Linux's, or the process sits in a task group of its own
(a container's CPU cgroup: the kernel then leaves the autogroup file empty), nothing changes.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")
# "/autogroup-188 nice 0"
_NICE = re.compile(r"\bnice\s+(-?\d+)\s*$")


def autogroup_nice(text: str) -> int:
    """The nice value in the text of a `/proc/PID/autogroup` file."""
    match = _NICE.search(text)
    if match is None:
        raise ValueError(f"not an autogroup line: {text!r}")
    return int(match.group(1))


@contextlib.contextmanager
def session_niced(nice: int, path: Path = AUTOGROUP) -> Iterator[bool]:
    """This session's scheduling group at `nice` or lower priority while the block runs (its
    old value after); yields whether it was applied (False without autogroups)."""
    try:
        before = autogroup_nice(path.read_text())
        path.write_text(str(max(nice, before)))
    except (OSError, ValueError):
        yield False
        return
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            path.write_text(str(before))
