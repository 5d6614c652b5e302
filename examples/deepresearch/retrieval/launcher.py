"""Starts the retrieval service as a child process, or adopts one that already runs elsewhere.

The child is started with `coordinator.processes.spawn`: a process group of its own and
`PR_SET_PDEATHSIG`, so it dies with the process that started it even on a SIGKILL. Spawn from a
long-lived thread (the main one): the death signal fires when the spawning thread exits.

It listens on a port it picks itself (`--port 0`, unless one is given) and prints its URL; the
launcher reads that line from the log, then waits for `/health`, so no port is chosen here and
lost to another process between the choice and the bind.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import httpx

from lockgate.coordinator.launch.processes import log_tail, spawn, terminate

_MODULE = "lockgate.examples.deepresearch.retrieval"
_URL_LINE = re.compile(rb"^(http://\S+)$", re.MULTILINE)
_POLL_S = 0.05


class RetrievalStartError(RuntimeError):
    """The service did not come up (or an external one did not answer); says why."""


class RetrievalService:
    """`with RetrievalService(index_dir, log_path=...) as service: ... service.url ...`."""

    def __init__(
        self,
        index_dir: Path,
        *,
        log_path: Path,
        corpus: Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout_s: float = 120.0,
        stop_grace_s: float = 10.0,
        extra_args: list[str] | None = None,
    ) -> None:
        self.index_dir = index_dir
        self.log_path = log_path
        self.corpus = corpus
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.extra_args = list(extra_args or [])
        self._url: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        # How the child ended once stopped (0: it shut down cleanly on SIGTERM).
        self.exit_code: int | None = None
        self._external = False

    @classmethod
    def external(cls, url: str, *, timeout_s: float = 10.0) -> Self:
        """A service that already runs at `url`: checked once here; `stop` leaves it alone."""
        url = url.rstrip("/")
        try:
            response = httpx.get(f"{url}/health", timeout=timeout_s)
        except httpx.HTTPError as e:
            raise RetrievalStartError(f"no retrieval service answers at {url}: {e!r}") from e
        if response.status_code != 200:
            raise RetrievalStartError(
                f"{url}/health answered HTTP {response.status_code}: {response.text[:200]}"
            )
        service = cls(Path(), log_path=Path(), port=0)
        service._url, service._external = url, True
        return service

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the retrieval service has not been started")
        return self._url

    @property
    def pid(self) -> int | None:
        """The child's pid (also its process group's id); None when external or stopped."""
        return None if self._proc is None else self._proc.pid

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            _MODULE,
            "serve",
            "--index",
            str(self.index_dir),
            *(["--corpus", str(self.corpus)] if self.corpus is not None else []),
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    def start(self) -> None:
        if self._external or self._proc is not None:
            raise RuntimeError("this retrieval service has already been started")
        # The URL is read from the log, so an earlier run's lines must not be in it.
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")
        self._proc = spawn(self.command(), self.log_path)
        try:
            self._url = self._await_ready(self._proc)
        except BaseException:
            # Also on KeyboardInterrupt: the server must not outlive a failed start.
            self.stop()
            raise

    def _await_ready(self, proc: subprocess.Popen[bytes]) -> str:
        deadline = time.monotonic() + self.startup_timeout_s
        url: str | None = None
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                code = proc.poll()
                if code is not None:
                    raise RetrievalStartError(
                        f"the retrieval service exited with code {code} before serving; "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                if url is None:
                    found = _URL_LINE.search(self.log_path.read_bytes())
                    url = found.group(1).decode() if found else None
                if url is not None:
                    try:
                        if client.get(f"{url}/health").status_code == 200:
                            return url
                    except httpx.TransportError:
                        pass
                time.sleep(_POLL_S)
        raise RetrievalStartError(
            f"the retrieval service did not serve within {self.startup_timeout_s:g}s; "
            f"log {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def stop(self) -> None:
        """SIGTERM the service's process group, SIGKILL after the grace; idempotent."""
        if self._proc is not None:
            terminate(self._proc, grace_s=self.stop_grace_s)
            self.exit_code = self._proc.returncode
            self._proc = None
        if not self._external:
            self._url = None

    def __enter__(self) -> Self:
        if not self._external:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
