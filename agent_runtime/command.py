"""An agent in any language: an external command run once per rollout.

The command talks to the model like any OpenAI client, from its environment:

    OPENAI_BASE_URL       the session-scoped base URL (ends in /v1)
    OPENAI_API_KEY        the session's key
    OPENAI_MODEL          the model name to send
    LOCKGATE_SESSION_ID   the session id
    LOCKGATE_REWARD_URL   POST {"reward": float} here (session key as Bearer) to set the reward
    LOCKGATE_TASK_ID      the task id
    LOCKGATE_TASK         the task's data as JSON (also written to stdin)

Its reward is the last non-empty stdout line when that line is a JSON object with a numeric
"reward"; any other last line leaves the reward to the reward function or to a reward the
command posted to the gateway. A non-zero exit, a crash, a timeout or a malformed "reward"
raises `CommandFailed` with the exit status and the tail of stderr, which fails that rollout
only (`run_rollout` catches it).

Each command runs in its own process group, so the whole tree it spawned is killed (SIGTERM,
a grace period, SIGKILL) when it times out, when the rollout is cancelled, and when it exits
leaving children behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import os
import re
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lockgate.agent_runtime.types import RolloutContext, Task

_ERROR_TAIL_CHARS = 2000  # what goes into a session's error text; the log file keeps more


class CommandFailed(Exception):
    """The command did not produce a usable result; the message says why."""


class CommandExited(CommandFailed):
    """Non-zero exit status or death by a signal."""


class CommandTimedOut(CommandFailed):
    """The command ran past its time limit and was killed."""


class CommandOutputInvalid(CommandFailed):
    """The last stdout line claims a reward that is not a finite number."""


class _Tail:
    """Keeps the last `limit` bytes of a stream, so a chatty agent cannot exhaust memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def add(self, chunk: bytes) -> None:
        self._buf += chunk
        if len(self._buf) > self.limit:
            del self._buf[: len(self._buf) - self.limit]

    def text(self) -> str:
        return self._buf.decode("utf-8", errors="replace")


def parse_reward(stdout: str) -> float | None:
    """The reward printed on the last non-empty line, or None when that line states none.

    Raises `CommandOutputInvalid` when the line is a JSON object whose "reward" is present but
    not a finite number: that is a broken agent, not one that leaves the reward to others.
    """
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        value: Any = json.loads(lines[-1])
    except ValueError:
        return None
    if not isinstance(value, dict) or "reward" not in value:
        return None
    reward = value["reward"]
    # bool is an int subclass; `true` as a reward is almost certainly a bug in the agent.
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise CommandOutputInvalid(
            f'the last stdout line has "reward": {json.dumps(reward)}, which is not a finite number'
        )
    return float(reward)


def reward_url(base_url: str) -> str:
    """The agent-facing reward route for a session-scoped base URL `.../sessions/<sid>/v1`."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root + "/reward"


@dataclass(frozen=True)
class CommandAgent:
    """An `Agent` that runs `command` per rollout; see the module docstring for the contract."""

    command: Sequence[str]
    timeout_s: float | None = None
    cwd: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    log_dir: Path | None = None  # one stderr file per rollout, when set
    output_limit_kib: int = 64  # per stream, in memory and in the log file
    kill_grace_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.command or not all(isinstance(part, str) and part for part in self.command):
            raise ValueError(
                f"command must be a non-empty list of non-empty strings, got {self.command!r}"
            )
        bad = [k for k, v in self.env.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError(f"env values must be strings (quote them in YAML): {bad}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.output_limit_kib < 1:
            raise ValueError(f"output_limit_kib must be at least 1, got {self.output_limit_kib}")

    def environment(self, task: Task, ctx: RolloutContext) -> dict[str, str]:
        return {
            **os.environ,
            **self.env,
            "OPENAI_BASE_URL": ctx.base_url,
            "OPENAI_API_KEY": ctx.api_key,
            "OPENAI_MODEL": ctx.model,
            "LOCKGATE_SESSION_ID": ctx.session_id,
            "LOCKGATE_REWARD_URL": reward_url(ctx.base_url),
            "LOCKGATE_TASK_ID": task.id,
            "LOCKGATE_TASK": json.dumps(task.data),
        }

    async def __call__(self, task: Task, ctx: RolloutContext) -> float | None:
        loop = asyncio.get_running_loop()
        log_file = self._open_log(task, ctx)
        limit = self.output_limit_kib * 1024
        try:
            transport, capture = await loop.subprocess_exec(
                lambda: _Capture(limit, log_file),
                *self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.cwd,
                env=self.environment(task, ctx),
                **_own_process_group(loop),
            )
        except OSError as exc:
            if log_file is not None:
                log_file.close()
            hint = (
                " (the task is too large to pass in LOCKGATE_TASK; keep tasks small or point"
                " to their data)"
                if exc.errno == errno.E2BIG
                else ""
            )
            raise CommandFailed(f"could not start {list(self.command)}: {exc}{hint}") from exc

        timed_out = False
        try:
            stdin = transport.get_pipe_transport(0)
            assert isinstance(stdin, asyncio.WriteTransport)
            # Buffered by the transport: a command that never reads its stdin does not block us.
            stdin.write((json.dumps(task.data) + "\n").encode())
            stdin.close()
            try:
                await asyncio.wait_for(capture.exited.wait(), self.timeout_s)
            except TimeoutError:
                timed_out = True
        finally:
            # Runs on cancellation too: this is what keeps a cancelled rollout from leaving
            # its process tree running.
            try:
                await _kill_group(transport.get_pid(), capture.exited, self.kill_grace_s)
                # Output still in the pipes belongs to the result. A grandchild that escaped
                # into its own session could hold them open forever, hence the bound.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(capture.pipes_closed.wait(), self.kill_grace_s)
            finally:
                transport.close()
                if log_file is not None:
                    log_file.close()

        stderr = capture.tails[2]
        if timed_out:
            raise CommandTimedOut(
                f"command timed out after {self.timeout_s}s and was killed" + _stderr_note(stderr)
            )
        returncode = transport.get_returncode()
        assert returncode is not None
        if returncode != 0:
            raise CommandExited(_describe_exit(returncode) + _stderr_note(stderr))
        return parse_reward(capture.tails[1].text())

    def _open_log(self, task: Task, ctx: RolloutContext) -> IO[bytes] | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        safe_task = re.sub(r"[^A-Za-z0-9_.-]+", "_", task.id)[:80]
        return (self.log_dir / f"{safe_task}-{ctx.session_id}.stderr.log").open("wb")


class _Capture(asyncio.SubprocessProtocol):
    """Keeps stdout's and stderr's tails, copies stderr to the log, and signals the exit.

    `exited` is set when the command's own process has exited. asyncio's Process.wait() would
    also wait for the pipes to close, which a background child of the command can put off
    forever.
    """

    def __init__(self, limit: int, log_file: IO[bytes] | None) -> None:
        self.tails = {1: _Tail(limit), 2: _Tail(limit)}
        self.exited = asyncio.Event()
        self.pipes_closed = asyncio.Event()
        self._open_pipes = {1, 2}
        self._log = log_file
        self._log_limit = limit
        self._logged = 0

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.tails[fd].add(data)
        if fd == 2 and self._log is not None and self._logged < self._log_limit:
            part = data[: self._log_limit - self._logged]
            self._log.write(part)
            self._logged += len(part)
            if self._logged >= self._log_limit:
                self._log.write(
                    f"\n[lockgate: log truncated at {self._log_limit} bytes]\n".encode()
                )
            self._log.flush()

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        # stdin (fd 0) closing early only means the command did not read its task there.
        self._open_pipes.discard(fd)
        if not self._open_pipes:
            self.pipes_closed.set()

    def process_exited(self) -> None:
        self.exited.set()


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        # A member that changed its credentials (setuid helper) cannot be signalled; the rest
        # of the group has been.
        return True
    return True


def _own_process_group(loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    """Start the command in a process group of its own (its whole tree is killed with it), in
    our session: a session would also be a scheduling group of its own under the kernel's
    autogroup, and many busy agents' groups would crowd out the gateway and the replicas,
    whatever their thread counts. asyncio's own loops take Popen's `process_group`; uvloop
    refuses it but runs a `preexec_fn`."""
    if isinstance(loop, asyncio.BaseEventLoop):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}


async def _kill_group(pgid: int, leader_exited: asyncio.Event, grace_s: float) -> None:
    """End every process of the command's group: SIGTERM, up to `grace_s`, then SIGKILL.

    Safe to call when everything already exited. `_own_process_group` made the leader's pid
    the group id; the leader itself is reaped by asyncio's child watcher.
    """
    if not _signal_group(pgid, signal.SIGTERM):
        return
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(leader_exited.wait(), grace_s)
        # Children left behind by the leader are still in the group: give them the rest of
        # the grace period. Zombies count as members until reaped, so this only waits, never
        # blocks past the deadline.
        while loop.time() < deadline:
            if not _signal_group(pgid, 0):
                break
            await asyncio.sleep(0.05)
    finally:
        # Also reached when the wait above is cancelled: SIGKILL needs no waiting.
        _signal_group(pgid, signal.SIGKILL)


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"command was killed by {name}"
    return f"command exited with status {returncode}"


def _stderr_note(stderr: _Tail) -> str:
    text = stderr.text().strip()
    if not text:
        return " (no stderr output)"
    if len(text) > _ERROR_TAIL_CHARS:
        text = "..." + text[-_ERROR_TAIL_CHARS:]
    return f"; stderr tail:\n{text}"
