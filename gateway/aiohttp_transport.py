"""An httpx transport that sends requests with aiohttp: the gateway's default to the replicas.

Generate requests, the hot path, do not come through here: the gateway sends them with its own
minimal HTTP/1.1 client (gateway/replicas/http1.py). Admin calls and health checks do.

The gateway talks to replicas through an `httpx.AsyncClient` (tests inject httpx's
`MockTransport` there), but httpx's own connection pool (httpcore) is the gateway's largest
cost under load: per request it checks every pooled connection for readability, so its CPU per
call grows with the number of connections, while aiohttp's (its HTTP parser is in C) stays flat
(measured in docs/performance.md, "Gateway"). Keeping httpx as the interface and aiohttp
underneath keeps every caller and test as it is.

Semantics kept: timeouts from httpx's per-request `timeout` extension, transport failures
raised as the matching `httpx.TransportError` subclasses, bodies streamed as they arrive, and a
response closed before its end closes its connection (which is how vLLM learns a streamed
generation was abandoned); one read to the end goes back to the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import aiohttp
import httpx

# Hop-by-hop or framing headers that aiohttp sets itself from the body it sends.
_DROPPED_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection"})


@contextmanager
def _as_httpx_errors(request: httpx.Request) -> Iterator[None]:
    try:
        yield
    except aiohttp.ConnectionTimeoutError as exc:
        raise httpx.ConnectTimeout(str(exc) or "connect timed out", request=request) from exc
    except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
        raise httpx.ReadTimeout(str(exc) or "read timed out", request=request) from exc
    except aiohttp.ClientConnectorError as exc:
        raise httpx.ConnectError(str(exc), request=request) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        raise httpx.RemoteProtocolError(str(exc), request=request) from exc
    except aiohttp.ClientOSError as exc:
        raise httpx.ReadError(str(exc), request=request) from exc
    except aiohttp.ClientError as exc:
        raise httpx.TransportError(str(exc), request=request) from exc


class _Body(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors(self._request):
            async for piece in self._response.content.iter_any():
                yield piece

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # read to the end: the connection is reusable
        else:
            self._response.close()  # abandoned mid-body: drop the connection


class AiohttpTransport(httpx.AsyncBaseTransport):
    def __init__(self, max_connections: int = 1024, keepalive_s: float = 4.0) -> None:
        self._max_connections = max_connections
        # Under uvicorn's default 5 s keep-alive (vLLM's servers): a pooled connection is
        # dropped here before the server may close it under a request being sent.
        self._keepalive_s = keepalive_s
        # Made on first use: an aiohttp session belongs to the event loop it was created in.
        self._session: aiohttp.ClientSession | None = None

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, keepalive_timeout=self._keepalive_s
                ),
                # httpx decodes the body by its content-encoding; decoding twice would break it.
                auto_decompress=False,
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.get("connect"), sock_read=timeouts.get("read")
        )
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.headers.raw
            if k.lower() not in _DROPPED_HEADERS
        ]
        with _as_httpx_errors(request):
            response = await self._session_now().request(
                request.method,
                str(request.url),
                headers=headers,
                data=await request.aread(),
                timeout=timeout,
                allow_redirects=False,
            )
        return httpx.Response(
            response.status,
            headers=[(k, v) for k, v in response.raw_headers],
            stream=_Body(response, request),
            request=request,
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
            # Let aiohttp's connection closers run before the loop may end (its documented advice).
            await asyncio.sleep(0)
