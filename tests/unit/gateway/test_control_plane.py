"""The control plane sends the replicas' pauses from its own thread: they leave while the
gateway's event loop is busy, over real sockets, and a replica that is down is an answer."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lockgate.gateway.sync.control_plane import PAUSE_SWITCH_INTERVAL_S, ControlPlane, PauseResults
from lockgate.gateway.vllm_ext.routes import PAUSE_PATH


class _Replica(BaseHTTPRequestHandler):
    arrivals: list[tuple[str, float]]  # set per server below
    engine_s = 0.0

    def do_POST(self) -> None:
        self.arrivals.append((self.path, time.perf_counter()))
        body = json.dumps({"engine_s": self.engine_s}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def replicas() -> Iterator[list[tuple[str, list[tuple[str, float]]]]]:
    """Two replicas with lockgate's pause route, on threads of their own."""
    servers, out = [], []
    for engine_s in (0.01, 0.02):
        arrivals: list[tuple[str, float]] = []
        handler = type("Handler", (_Replica,), {"arrivals": arrivals, "engine_s": engine_s})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        out.append((f"http://127.0.0.1:{server.server_address[1]}", arrivals))
    yield out
    for server in servers:
        server.shutdown()
        server.server_close()


async def _pause(control: ControlPlane, urls: list[str]) -> PauseResults:
    return await asyncio.wrap_future(control.submit(urls, "abort"))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_pauses_leave_while_the_gateway_loop_is_blocked(
    replicas: list[tuple[str, list[tuple[str, float]]]],
) -> None:
    control = ControlPlane()
    try:
        urls = [url for url, _ in replicas]
        before = sys.getswitchinterval()
        sent = asyncio.wrap_future(control.submit(urls, "abort"))
        # Handed over with no await: the interpreter switches threads more often meanwhile.
        assert sys.getswitchinterval() == PAUSE_SWITCH_INTERVAL_S < before
        blocked_at = time.perf_counter()
        time.sleep(0.5)  # noqa: ASYNC251 (the point: this loop is busy, as a backlog holds it)
        released_at = time.perf_counter()
        result = await sent
        assert result.results == [0.01, 0.02]
        assert sys.getswitchinterval() == before
        for _, arrivals in replicas:
            ((path, at),) = arrivals
            assert path == f"{PAUSE_PATH}?mode=abort"
            assert blocked_at < at < released_at  # sent while this loop could not run
        assert blocked_at < result.answered_at < released_at
    finally:
        await control.aclose()


async def test_a_replica_that_is_down_answers_with_its_error_and_the_others_pause(
    replicas: list[tuple[str, list[tuple[str, float]]]],
) -> None:
    control = ControlPlane()
    try:
        down = f"http://127.0.0.1:{_closed_port()}"
        result = await _pause(control, [replicas[0][0], down])
        assert result.results[0] == 0.01
        assert isinstance(result.results[1], Exception)
        assert "cannot connect" in str(result.results[1])
        # Connections are kept for the next sync.
        again = await _pause(control, [replicas[0][0]])
        assert again.results == [0.01]
        assert len(replicas[0][1]) == 2
    finally:
        await control.aclose()
    await control.aclose()  # closing twice is harmless


def _control_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lockgate-control"]


async def test_the_thread_starts_with_the_first_pause_and_stops_on_close(
    replicas: list[tuple[str, list[tuple[str, float]]]],
) -> None:
    idle = ControlPlane()
    await idle.aclose()  # never paused: nothing was started
    control = ControlPlane()
    assert _control_threads() == []
    await _pause(control, [replicas[0][0]])
    assert len(_control_threads()) == 1
    await control.aclose()
    assert _control_threads() == []


async def test_overlapping_pauses_leave_the_switch_interval_as_it_was(
    replicas: list[tuple[str, list[tuple[str, float]]]],
) -> None:
    control = ControlPlane()
    before = sys.getswitchinterval()
    try:
        first = asyncio.wrap_future(control.submit([replicas[0][0]], "abort"))
        second = asyncio.wrap_future(control.submit([replicas[1][0]], "abort"))
        assert sys.getswitchinterval() == PAUSE_SWITCH_INTERVAL_S
        await asyncio.gather(first, second)
        assert sys.getswitchinterval() == before
    finally:
        await control.aclose()
