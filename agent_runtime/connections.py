"""One connection pool per event loop, shared by every rollout's OpenAI client.

Agents in a training run open thousands of short-lived OpenAI clients. Each `AsyncOpenAI()`
built without an `http_client` creates its own httpx transport, and with it a fresh TLS
context (even for the plain-HTTP gateway), then its own connections: a large share of the
coordinator's CPU in a run (measured in docs/performance.md). Rollouts that take their
client from `RolloutContext.openai_client()` share one aiohttp pool instead.
"""

from __future__ import annotations

import asyncio
import weakref

import httpx

from lockgate.gateway.client import AiohttpTransport


class _KeepOpen(httpx.AsyncBaseTransport):
    """The shared pool as seen by one client: closing that client must not close the pool."""

    def __init__(self, pool: AiohttpTransport) -> None:
        self._pool = pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._pool.handle_async_request(request)

    async def aclose(self) -> None:
        pass


_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AiohttpTransport] = (
    weakref.WeakKeyDictionary()
)


def shared_transport() -> httpx.AsyncBaseTransport:
    """A transport on this event loop's shared pool (an aiohttp session belongs to one loop)."""
    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is None:
        pool = _pools[loop] = AiohttpTransport()
    return _KeepOpen(pool)


async def close_shared_transport() -> None:
    """Close this loop's pool (before the loop ends, so aiohttp does not warn of an open session)."""
    pool = _pools.pop(asyncio.get_running_loop(), None)
    if pool is not None:
        await pool.aclose()
