"""Child processes that cannot outlive the run.

Each child gets its own process group (so stopping it stops everything it started) and
`PR_SET_PDEATHSIG = SIGKILL` (so even a SIGKILL of the coordinator takes it down). The death
signal fires when the *spawning thread* exits, so spawn from a long-lived thread (the main one).
It reaches the child alone: a command whose own children would outlive it (a vLLM server) is
spawned with `guard=True`, under `group_guard`, which takes its whole group down instead.

A process group, not a session: under the kernel's autogroup scheduling (on by default in most
distributions: `/proc/sys/kernel/sched_autogroup_enabled`) each session is a scheduling group of
its own, and CPU time is shared out between groups before threads. With every replica and the
gateway in a session of their own, the gateway sat runnable but unscheduled for up to a second
at a time while the replicas' groups held both cores of a 2-core machine (the "gateway stalls"
behind a slow weight-sync pause, gone once they shared the coordinator's session: measured in
docs/performance.md). In one session every thread competes on its own weight.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from lockgate.coordinator.launch.orphan_guard import PARENT_DIED

_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    def preexec() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)

    return preexec


def spawn(
    cmd: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    *,
    guard: bool = False,
) -> subprocess.Popen[bytes]:
    """Start `cmd` logging to `log_path`; with `guard`, under `group_guard` (the returned
    process is then the guard, and the command its child in the same group)."""
    argv, death = list(cmd), signal.SIGKILL
    if guard:
        argv = [sys.executable, "-m", "lockgate.coordinator.launch.orphan_guard", *argv]
        death = PARENT_DIED
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            process_group=0,
            preexec_fn=_die_with_parent(death),
        )


def terminate(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the child's process group, then SIGKILL it if it has not exited in time."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            # The leader is gone; make sure nothing else of its group lingers.
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
        break
    if proc.poll() is None:
        proc.wait(timeout=5.0)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def client_host(host: str) -> str:
    """The host a client connects to for a server bound to `host` (a wildcard is not one)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
