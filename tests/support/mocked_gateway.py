"""A gateway app in this process whose replicas are fakes answered by httpx's MockTransport."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from lockgate.gateway.api.app import create_app
from lockgate.gateway.config import GatewayConfig

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


@contextlib.asynccontextmanager
async def mocked_gateway(
    replicas: dict[str, Handler], **config: Any
) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """The started app and a client of it. `replicas` maps each replica's URL (http://host) to
    its fake; `config`: the rest of the gateway's config (max_model_len 512 unless given)."""
    by_host = {httpx.URL(url).host: handler for url, handler in replicas.items()}

    async def route(req: httpx.Request) -> httpx.Response:
        return await by_host[req.url.host](req)

    upstream = httpx.AsyncClient(transport=httpx.MockTransport(route))
    config.setdefault("max_model_len", 512)
    app = create_app(GatewayConfig(replicas=list(replicas), **config), http=upstream)
    await app.state.gateway.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30
        ) as client:
            yield app, client
    finally:
        await app.state.gateway.close()
        await upstream.aclose()
