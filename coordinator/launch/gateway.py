"""Runs the gateway as a child process of the coordinator and waits until it serves."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from lockgate.coordinator.errors import RunFailed
from lockgate.coordinator.launch.processes import client_host, free_port, log_tail, spawn, terminate
from lockgate.coordinator.run_dir import GATEWAY, RunDir
from lockgate.gateway.config import ADMIN_TOKEN_ENV, GatewayConfig


class GatewayStartError(RunFailed):
    """A gateway did not serve; the message says why and where its log is."""


class GatewayDied(RunFailed):
    """A gateway the run started exited mid-run; the message is one line for the operator."""


class GatewayProcess:
    def __init__(
        self,
        config: GatewayConfig,
        run_dir: Path,
        port: int = 0,
        name: str = GATEWAY,
        host: str = "127.0.0.1",
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.name = name  # names its config and log files: a run may have two gateways
        self.host = host
        self.port = port or free_port()
        self.url = f"http://{client_host(host)}:{self.port}"
        self.log_path = RunDir(run_dir).log_of(name)
        self._proc: subprocess.Popen[bytes] | None = None
        self._launched_at = 0.0

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The gateway's process while started."""
        return self._proc

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = 60.0) -> None:
        """Launch the gateway and wait until it serves."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the gateway's process without waiting for it (`wait_ready` does)."""
        config_path = RunDir(self.run_dir).gateway_config_of(self.name)
        # The token goes through the child's environment: run dirs get copied and shared.
        config_path.write_text(self.config.model_dump_json(indent=2, exclude={"admin_token"}))
        self._proc = spawn(
            [
                sys.executable,
                "-m",
                "lockgate.gateway",
                "--config",
                str(config_path),
                "--host",
                self.host,
                "--port",
                str(self.port),
            ],
            self.log_path,
            env={**os.environ, ADMIN_TOKEN_ENV: self.config.admin_token},
        )
        self._launched_at = time.monotonic()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until the launched gateway serves, within `timeout_s` of its launch."""
        proc = self._proc
        if proc is None:
            raise GatewayStartError(f"the {self.name} was not launched")
        deadline = self._launched_at + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise GatewayStartError(
                    f"the gateway exited with code {proc.returncode}:\n{log_tail(self.log_path)}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise GatewayStartError(
            f"the gateway did not serve within {timeout_s:.0f}s:\n{log_tail(self.log_path)}"
        )

    def died(self) -> GatewayDied | None:
        """What to tell the operator if the started gateway has exited; None while it runs."""
        proc = self._proc
        if proc is None or proc.poll() is None:
            return None
        code = proc.returncode
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code < 0
            else f"exited with code {code}"
        )
        # Calls are committed before they are answered (gateway/store), so the store holds
        # every answered call and the newest checkpoint is a sound place to go on from.
        return GatewayDied(
            f"the {self.name} (pid {proc.pid}) {how} mid-run; the run stopped. Every call it "
            f"answered is in {self.config.db_path}; continue with: lockgate train --resume "
            f"{self.run_dir} (log: {self.log_path})"
        )

    async def watch(self, poll_s: float = 0.5) -> None:
        """Raise `GatewayDied` once the started gateway exits (run beside the loop)."""
        # A child's exit is no asyncio event (the loop has no child watcher for Popen): poll.
        while (dead := self.died()) is None:  # noqa: ASYNC110
            await asyncio.sleep(poll_s)
        raise dead

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc, grace_s=10.0)
            self._proc = None
