"""How a generate request reaches a replica: one POST whose body is read as it streams.

The replica client needs only this from an HTTP stack, and on the hot path every layer costs:
`httpx.AsyncClient` (cookies, auth, redirects, its request and response models) over aiohttp
(its own request objects and Python work per HTTP chunk, that is per token) made a large part
of each call's CPU (measured in docs/performance.md, "Gateway"). So the gateway's own stack
sends generate requests with a minimal HTTP/1.1 client (`http1.Http1Upstream`), and an
injected `httpx.AsyncClient` (tests use httpx's mock transport) is used through
`HttpxUpstream`.

Both keep the same semantics: transport failures raise `ReplicaUnavailable`, a body read to its
end returns the connection to the pool, and one left early closes its connection, which is how
vLLM learns that a streamed generation was abandoned.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import httpx

_JSON_HEADERS = {"content-type": "application/json"}
# Generation may legitimately run for minutes: only connecting is bounded.
CONNECT_TIMEOUT_S = 5.0
_GENERATE_TIMEOUT = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S).as_dict()


class ReplicaUnavailable(Exception):
    """The replica could not be reached (connection refused, reset, timed out)."""


class StreamedResponse(Protocol):
    status: int

    def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives, one piece per read."""
        ...

    async def read(self) -> bytes: ...


class Upstream(Protocol):
    def post_stream(
        self, url: str, body: bytes
    ) -> AbstractAsyncContextManager[StreamedResponse]: ...


def unreachable(url: str, exc: BaseException) -> ReplicaUnavailable:
    return ReplicaUnavailable(f"{url}: {type(exc).__name__}: {exc}")


class _HttpxResponse:
    def __init__(self, response: httpx.Response, url: str) -> None:
        self._response = response
        self.status = response.status_code
        self._url = url

    async def pieces(self) -> AsyncIterator[bytes]:
        try:
            async for piece in self._response.aiter_bytes():
                yield piece
        except httpx.TransportError as exc:
            raise unreachable(self._url, exc) from exc

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.TransportError as exc:
            raise unreachable(self._url, exc) from exc


class HttpxUpstream:
    """Generate requests through an `httpx.AsyncClient` (an injected one)."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http

    @contextlib.asynccontextmanager
    async def post_stream(self, url: str, body: bytes) -> AsyncIterator[StreamedResponse]:
        request = httpx.Request(
            "POST",
            url,
            content=body,
            headers=_JSON_HEADERS,
            extensions={"timeout": _GENERATE_TIMEOUT},
        )
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise unreachable(url, exc) from exc
        async with contextlib.aclosing(response):
            yield _HttpxResponse(response, url)
