"""A minimal HTTP/1.1 client for generate requests: the gateway's hot path to its replicas.

One generate request is a POST with a JSON body whose answer streams back as SSE. aiohttp
spends most of its CPU per request on its request and response objects and on Python work per
HTTP chunk of the body, that is per token; a bare asyncio protocol with httptools' C parser, as
here, takes a fraction of that (measured in docs/performance.md). Only
what generate requests need is here: keep-alive connections pooled per replica, bodies handed
over as they arrive (all that has arrived at each read), chunked or sized bodies, TLS for https
URLs, a connect timeout, and no read timeout (a generation may run for minutes).

Semantics the gateway relies on (gateway/replicas/upstream.py): transport failures raise
`ReplicaUnavailable`; a body read to its end leaves the connection in the pool; a body left
early closes the connection, which is how vLLM learns that a streamed generation was abandoned.
A pooled connection that the replica closed while it sat idle fails before any answer arrives:
the request is then sent once more on a new connection rather than failing the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from lockgate.gateway.replicas.upstream import (
    CONNECT_TIMEOUT_S,
    ReplicaUnavailable,
    StreamedResponse,
)

# Body bytes held unread before the socket stops being read (the replica then waits).
_HIGH_WATER = 1 << 20


class _Dropped(Exception):
    """The connection ended or broke; `answered` says whether any of the answer had arrived."""

    def __init__(self, message: str, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


@dataclass(frozen=True)
class _Target:
    host: str
    port: int
    tls: bool
    head: bytes  # the request line and fixed headers, up to the content-length value


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        "content-type: application/json\r\ncontent-length: "
    ).encode("latin-1")
    return _Target(parts.hostname, port, tls, head)


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._wakeup: asyncio.Future[None] | None = None
        self._pieces: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self.status = 0
        self._headers_done = False
        self.complete = False
        self.keep_alive = False
        self.error: _Dropped | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"bad HTTP from the replica: {exc}")
            self.close()
        # Once per read, not per callback: a read holds a chunk per token.
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if not self.complete:
            self._fail(f"connection lost: {exc or 'closed by the replica'}")

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and self._transport is not None and not self._paused:
            self._paused = True
            self._transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # -- the client's side -----------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Idle and still open: may carry the next request."""
        return self._transport is not None and not self._transport.is_closing()

    def reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._pieces, self._buffered = [], 0
        self.status, self._headers_done, self.complete = 0, False, False
        self.error = None

    async def send(self, request: bytes) -> None:
        """Send a request and wait for its answer's status and headers."""
        if self._transport is None:
            raise _Dropped("connection already closed", answered=False)
        self._transport.write(request)
        while not self._headers_done:
            await self._wait()

    async def pieces(self) -> AsyncIterator[bytes]:
        while True:
            if self._pieces:
                data = b"".join(self._pieces) if len(self._pieces) > 1 else self._pieces[0]
                self._pieces, self._buffered = [], 0
                if self._paused and self._transport is not None:
                    self._paused = False
                    self._transport.resume_reading()
                yield data
            elif self.complete:
                return
            else:
                await self._wait()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def _wait(self) -> asyncio.Future[None]:
        if self.error is not None:
            raise self.error
        self._wakeup = asyncio.get_running_loop().create_future()
        return self._wakeup

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _fail(self, message: str) -> None:
        self.error = _Dropped(message, answered=self._headers_done)
        self._wake()


class _Response:
    """A streamed answer, as the replica client reads it (`upstream.StreamedResponse`)."""

    def __init__(self, connection: _Connection, url: str) -> None:
        self._connection = connection
        self._url = url
        self.status = connection.status

    async def pieces(self) -> AsyncIterator[bytes]:
        try:
            async for piece in self._connection.pieces():
                yield piece
        except _Dropped as exc:
            raise ReplicaUnavailable(f"{self._url}: {exc}") from exc

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])


class Http1Upstream:
    """Generate requests over pooled HTTP/1.1 connections (the `upstream.Upstream` interface)."""

    def __init__(self, max_connections: int = 1024) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._targets: dict[str, _Target] = {}
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    @contextlib.asynccontextmanager
    async def post_stream(self, url: str, body: bytes) -> AsyncIterator[StreamedResponse]:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _target(url)
        request = b"%s%d\r\n\r\n%s" % (target.head, len(body), body)
        async with self._slots:
            connection = await self._send(target, request, url)
            try:
                yield _Response(connection, url)
            finally:
                if connection.complete and connection.keep_alive and connection.usable:
                    self._idle.setdefault(_key(target), []).append(connection)
                else:
                    connection.close()  # abandoned mid-body (or not reusable): drop it

    async def _send(self, target: _Target, request: bytes, url: str) -> _Connection:
        idle = self._idle.get(_key(target))
        while idle:
            connection = idle.pop()
            if not connection.usable:
                continue
            connection.reset()
            try:
                await _send_on(connection, request)
                return connection
            except _Dropped as exc:
                if exc.answered:
                    raise ReplicaUnavailable(f"{url}: {exc}") from exc
                break  # closed while it sat idle: one more try on a new connection
        connection = await self._connect(target, url)
        try:
            await _send_on(connection, request)
        except _Dropped as exc:
            raise ReplicaUnavailable(f"{url}: {exc}") from exc
        return connection

    async def _connect(self, target: _Target, url: str) -> _Connection:
        loop = asyncio.get_running_loop()
        if target.tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, connection = await loop.create_connection(
                    _Connection,
                    target.host,
                    target.port,
                    ssl=self._tls if target.tls else None,
                )
        except (OSError, TimeoutError) as exc:
            raise ReplicaUnavailable(f"{url}: cannot connect: {type(exc).__name__}: {exc}") from exc
        return connection

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()


async def _send_on(connection: _Connection, request: bytes) -> None:
    try:
        await connection.send(request)
    except BaseException:
        # Cancelled or failed before the answer was handed on: nobody will read or release it,
        # and a replica must not go on generating for it.
        connection.close()
        raise


def _key(target: _Target) -> tuple[str, int, bool]:
    return (target.host, target.port, target.tls)
