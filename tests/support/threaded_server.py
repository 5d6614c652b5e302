"""An ASGI app served by uvicorn in a thread of the test process, on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.types import ASGIApp

from lockgate.gateway.api.server import KEEP_ALIVE_S


@contextmanager
def serve_in_thread(app: ASGIApp, start_timeout_s: float = 60) -> Iterator[int]:
    """Serve `app` until the block ends; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # The gateway's keep-alive, not uvicorn's 5 s: a test's pooled client idle near 5 s under
    # the suite's load otherwise sends on a connection the server is closing (reset by peer).
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
