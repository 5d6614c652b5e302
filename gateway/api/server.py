"""Serve the gateway's app with uvicorn in this process, until SIGINT or SIGTERM.

Used by `python -m lockgate.gateway --config FILE` and by `lockgate gateway`.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

import uvicorn

from lockgate.gateway.api.app import create_app
from lockgate.gateway.config import GatewayConfig

# Longer than clients keep idle connections (httpx 5 s, aiohttp 15 s): with uvicorn's 5 s
# default an agent back from a 5 s tool could send on a connection being closed.
KEEP_ALIVE_S = 75


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # httpx logs every request at INFO: one log line per upstream call, a real cost at load.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _when_started(server: uvicorn.Server, on_ready: Callable[[], None]) -> None:
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    on_ready()


def serve(
    config: GatewayConfig, host: str, port: int, on_ready: Callable[[], None] | None = None
) -> None:
    """Serve on `host:port`; `on_ready` is called (from another thread) once it listens."""
    app = create_app(config)
    # Start-up leaves hundreds of thousands of objects (the tokenizer brings in transformers and
    # torch) that a full collection would walk every time, with the event loop stopped. Frozen,
    # they are left out of every collection; what the calls create is collected as usual
    # (measured in docs/performance.md, "Gateway").
    gc.collect()
    gc.freeze()
    # Python's default first threshold (700 new objects) runs a young collection many times a
    # call, each walking the calls in flight (their prompts' token lists among them), a large
    # share of the gateway's CPU under load. At 20,000 most of a call's objects are gone before
    # one runs, and fewer survive into the old generation, whose full walk stops the loop.
    gc.set_threshold(20_000, 20, 10)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            # Nothing reads the client address, and agents need neither header: each is Python
            # work on every request.
            proxy_headers=False,
            server_header=False,
            date_header=False,
        )
    )
    if on_ready is not None:
        threading.Thread(
            target=_when_started, args=(server, on_ready), name="on-ready", daemon=True
        ).start()
    try:
        server.run()
    finally:
        # Frozen objects are never collected, not even at exit, where triton's bindings (loaded
        # by transformers' imports) would then report each of theirs as leaked.
        gc.unfreeze()
