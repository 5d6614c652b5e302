"""Request bodies bounded before anything reads them: a pure ASGI layer in front of the app.

Parsing a body costs the event loop time in proportion to its size (a 20 MB chat call held it
for half a minute), and the loop is shared by every call. So a body over the limit
(`gateway.limits`) is answered with a 413 in OpenAI's shape here, before any route sees it:

- with a Content-Length over the limit, at once, without reading a byte of it (the server
  delivers no more than Content-Length declares, so one within the limit passes untouched and
  the hot path pays nothing);
- sent chunked (no Content-Length), as soon as what has arrived passes the limit; a body within
  it is handed on, already read, exactly as it came.

The connection is left open: uvicorn drops whatever of the body still arrives after the answer
without keeping it, and a client that writes its whole body before reading (httpx, the OpenAI
SDK) gets the 413 instead of a reset connection.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lockgate.gateway.api.responses import error_response
from lockgate.gateway.config import RequestLimits
from lockgate.gateway.errors import GatewayError, too_large

_ADMIN = "/admin"


class BodyLimit:
    def __init__(
        self, app: ASGIApp, limits: RequestLimits, refused: Callable[[GatewayError], None]
    ) -> None:
        self.app = app
        self.limits = limits
        self.refused = refused  # told of every refusal (the error metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, field = self._limit_for(scope["path"])
        chunked = _has_header(scope, b"transfer-encoding")
        # Under Transfer-Encoding a Content-Length means nothing (HTTP/1.1): never trust it.
        declared = None if chunked else _declared_length(scope)
        if declared is not None:
            if declared > limit:
                await self._refuse(limit, field, scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        if not chunked and scope.get("http_version", "1.1") in ("1.0", "1.1"):
            # HTTP/1.x with neither header: no body follows (a GET): nothing to count.
            await self.app(scope, receive, send)
            return
        first = await _read_within(receive, limit)
        if first is None:
            return  # the client left before its request arrived: nobody to answer
        if first is _OVER:
            await self._refuse(limit, field, scope, receive, send)
            return
        await self.app(scope, _replay(first, receive), send)

    def _limit_for(self, path: str) -> tuple[int, str]:
        """The limit on this path's bodies, and the config field that sets it."""
        if path == _ADMIN or path.startswith(_ADMIN + "/"):
            return self.limits.max_admin_request_bytes, "max_admin_request_bytes"
        return self.limits.max_request_bytes, "max_request_bytes"

    async def _refuse(
        self, limit: int, field: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        err = too_large(
            f"the request body is over this gateway's limit of {limit} bytes "
            f"(gateway.limits.{field})"
        )
        self.refused(err)
        await error_response(err)(scope, receive, send)


_OVER: Message = {"type": "lockgate.body_over_limit"}


def _declared_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one before we are called
    return None


def _has_header(scope: Scope, name: bytes) -> bool:
    return any(key == name for key, _ in scope["headers"])


async def _read_within(receive: Receive, limit: int) -> Message | None:
    """The whole body as one request message, `_OVER` once it passes `limit`, None if the
    client disconnected first."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return _OVER
        parts.append(chunk)
        if not message.get("more_body", False):
            return {"type": "http.request", "body": b"".join(parts), "more_body": False}


def _replay(first: Message, receive: Receive) -> Receive:
    """`receive` with the body already read given first (later calls wait for a disconnect)."""
    pending: Message | None = first

    async def replayed() -> Message:
        nonlocal pending
        if pending is not None:
            message, pending = pending, None
            return message
        return await receive()

    return replayed
