"""Runs the gateway as a child process of the coordinator and waits until it serves."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from lockgate.coordinator.processes import client_host, free_port, log_tail, spawn, terminate
from lockgate.gateway.config import GatewayConfig


class GatewayStartError(RuntimeError):
    pass


class GatewayProcess:
    def __init__(
        self,
        config: GatewayConfig,
        run_dir: Path,
        port: int = 0,
        name: str = "gateway",
        host: str = "127.0.0.1",
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.name = name  # names its config and log files: a run may have two gateways
        self.host = host
        self.port = port or free_port()
        self.url = f"http://{client_host(host)}:{self.port}"
        self.log_path = run_dir / "logs" / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The gateway's process while started."""
        return self._proc

    def start(self, timeout_s: float = 60.0) -> None:
        config_path = self.run_dir / f"{self.name}_config.json"
        config_path.write_text(self.config.model_dump_json(indent=2))
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
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise GatewayStartError(
                    f"the gateway exited with code {self._proc.returncode}:\n{log_tail(self.log_path)}"
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

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc, grace_s=10.0)
            self._proc = None
