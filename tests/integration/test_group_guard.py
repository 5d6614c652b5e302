"""`spawn` and the group guard (coordinator/launch/orphan_guard.py) in isolation: a child leads a process
group in its spawner's session, and the guard exits as its command did and takes its whole group
down when the process that spawned it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lockgate.coordinator.launch.processes import spawn
from tests.support.marked_processes import live_group_members


def _autogroup(pid: int | str) -> str | None:
    # "/autogroup-N nice K" where the kernel schedules by session; empty where it does not
    # (autogroup off, or the task sits in a cpu cgroup of its own, as in a CI container).
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()
    except OSError:
        return None
    return fields[0] if fields else None


def test_a_child_leads_its_own_group_in_its_spawners_session(tmp_path: Path) -> None:
    # A session of its own would also be a scheduling group of its own (autogroup): a busy
    # replica's group could then starve the gateway's for seconds. See processes.py.
    proc = spawn(["sleep", "30"], tmp_path / "log", guard=True)
    try:
        _wait_for(lambda: len(live_group_members(proc.pid)) == 2)  # the guard and sleep
        for pid in live_group_members(proc.pid):
            assert os.getpgid(pid) == proc.pid
            assert os.getsid(pid) == os.getsid(0)
            assert _autogroup(pid) == _autogroup("self")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_exits_with_its_commands_code(tmp_path: Path) -> None:
    proc = spawn(["sh", "-c", "echo out; exit 3"], tmp_path / "log", guard=True)
    assert proc.wait(timeout=30) == 3
    assert (tmp_path / "log").read_text() == "out\n"


def test_a_sigterm_to_the_group_ends_as_the_command_ends(tmp_path: Path) -> None:
    # The command exits 0 on SIGTERM after cleaning up: the guard waits for it and exits 0.
    script = "trap 'echo cleaned; exit 0' TERM; echo up; while :; do sleep 0.05; done"
    proc = spawn(["sh", "-c", script], tmp_path / "log", guard=True)
    _wait_for(lambda: (tmp_path / "log").read_text() == "up\n")
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert (tmp_path / "log").read_text().endswith("cleaned\n")


def test_a_command_killed_by_a_signal_shows_as_killed(tmp_path: Path) -> None:
    proc = spawn(["sh", "-c", "kill -KILL $$"], tmp_path / "log", guard=True)
    assert proc.wait(timeout=30) == -signal.SIGKILL


_PARENT = """
import sys, time
from pathlib import Path
from lockgate.coordinator.launch.processes import spawn
# The command starts a grandchild in the background, as vLLM starts its engine core.
proc = spawn(["sh", "-c", "sleep 600 & sleep 600"], Path(sys.argv[1]), guard=True)
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_the_group_dies_with_the_spawning_process(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path / "log")], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    pgid = int(parent.stdout.readline())
    _wait_for(lambda: len(live_group_members(pgid)) == 4)  # guard, sh and its two sleeps
    parent.kill()
    parent.wait(timeout=30)
    _wait_for(lambda: not live_group_members(pgid))


def _wait_for(condition: object, timeout_s: float = 30.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
