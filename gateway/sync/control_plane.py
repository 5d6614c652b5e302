"""A thread with its own event loop and its own connections, that sends the replicas' pauses.

On the gateway's loop an abort pause queued behind that loop's backlog: under load most of a
pause passed before the first pause request left, not at the replicas (measured in
benchmarks/README.md, "Where the gateway's time goes"). Here the requests leave as soon as
this thread gets the interpreter, whatever the loop is doing; the gateway's loop only cuts its
calls and reads the answers. While a pause is out the interpreter's switch interval is a tenth
of Python's default: this thread waits for the interpreter each time it sends or reads, and a
busy loop thread held it for the whole interval each time.

Its connections are its own: asyncio connections belong to the loop that made them. The
replicas' state (health, what is paused) stays with the gateway's loop, which reads the results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import time
from collections.abc import Sequence

import httpx

from lockgate.gateway.replicas.http1 import Http1Upstream
from lockgate.gateway.replicas.replica_client import ReplicaClient

# The interpreter's switch interval while a pause is out (Python's default is 5 ms).
PAUSE_SWITCH_INTERVAL_S = 0.0005


class PauseResults:
    """Each replica's answer in order (the engine's seconds, or the exception it raised), and
    when the last one came, on this thread's clock (`time.perf_counter`)."""

    def __init__(self, results: list[float | BaseException | None], answered_at: float) -> None:
        self.results = results
        self.answered_at = answered_at


class _FastSwitching:
    """The short switch interval while at least one pause is out, the process's own otherwise.
    Entered on the caller's thread, left on the control thread: counted under a lock, so
    overlapping pauses cannot leave the short interval behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._saved = 0.0

    def enter(self) -> None:
        with self._lock:
            if self._active == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, PAUSE_SWITCH_INTERVAL_S))
            self._active += 1

    def exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                sys.setswitchinterval(self._saved)


class ControlPlane:
    def __init__(self) -> None:
        # The thread starts with the first pause: a gateway that never syncs needs none.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Made on the control loop, the first time they are needed.
        self._http: httpx.AsyncClient | None = None
        self._upstream: Http1Upstream | None = None
        self._clients: dict[str, ReplicaClient] = {}
        self._switch = _FastSwitching()

    def submit(self, urls: Sequence[str], mode: str) -> concurrent.futures.Future[PauseResults]:
        """Start pausing every replica in `urls` from the control thread, now: no await comes
        first, so nothing queued on the caller's loop runs before the requests go."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="lockgate-control", daemon=True
            )
            self._thread.start()
        self._switch.enter()
        return asyncio.run_coroutine_threadsafe(self._pause(list(urls), mode), self._loop)

    async def _pause(self, urls: list[str], mode: str) -> PauseResults:
        try:
            clients = [self._client(url) for url in urls]
            results = await asyncio.gather(
                *(c.pause(mode) for c in clients), return_exceptions=True
            )
            return PauseResults(list(results), time.perf_counter())
        finally:
            self._switch.exit()

    def _client(self, url: str) -> ReplicaClient:
        client = self._clients.get(url)
        if client is None:
            if self._http is None:
                # Direct, as the gateway's own clients are (a proxy from the environment
                # has no business between a gateway and its replicas).
                self._http = httpx.AsyncClient(trust_env=False)
                self._upstream = Http1Upstream(max_connections=256)
            client = self._clients[url] = ReplicaClient(url, self._http, self._upstream)
        return client

    async def aclose(self) -> None:
        """Close the connections and stop the thread (idempotent)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._close(), loop))
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join, 10)
        loop.close()

    async def _close(self) -> None:
        if self._upstream is not None:
            await self._upstream.aclose()
        if self._http is not None:
            await self._http.aclose()
