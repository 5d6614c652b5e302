"""The chat-completion routes, answered as plain ASGI in front of FastAPI.

Chat calls are the gateway's hot path, and FastAPI's per-request machinery (its middleware
stack, matching the path against every route, solving each endpoint's dependencies, building a
`Request`) cost about a fifth of a call's CPU (cProfile, non-streamed, 16 connections). So
`ChatRoutes` sits in front of FastAPI and answers `POST /sessions/{session_id}/v1/chat/completions`
and `POST /v1/chat/completions` itself; every other request goes on to FastAPI as before.
`GatewayAPI` puts it ahead of even Starlette's outermost error middleware, which would wrap every
message a chat call sends in one more coroutine.

What FastAPI's route gave these is kept: the request metrics under the same route templates,
OpenAI-shaped errors (a `GatewayError` as itself, anything else as a logged 500), and a stream
cut short when its client disconnects (Starlette's `StreamingResponse` does this with a task
group per response; here one watcher task does it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from lockgate.gateway.api.responses import error_response, internal_error
from lockgate.gateway.errors import GatewayError

if TYPE_CHECKING:
    from lockgate.gateway.api.gateway import Gateway
    from lockgate.gateway.store.trajectories import SessionRow

BY_KEY = "/v1/chat/completions"
BY_PATH = "/sessions/{session_id}/v1/chat/completions"
_SESSIONS = "/sessions/"


class ChatRoutes:
    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route, session_id = _match(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        release = _nothing
        try:
            body = await _body(receive)
            if body is None:
                return  # the client left before its request arrived: nobody to answer
            response, release = await self._answer(
                session_id, _header(scope, b"authorization"), body
            )
            status = response.status_code
            if isinstance(response, StreamingResponse):
                await _stream(response, receive, send)
            else:
                await response(scope, receive, send)
        finally:
            release()  # the session's in-flight slot, held until the last chunk went out
            self.gateway.metrics.answered(route, status, time.perf_counter() - started)

    async def _answer(
        self, session_id: str | None, auth: str | None, body: bytes
    ) -> tuple[Response, Callable[[], None]]:
        gateway = self.gateway
        try:
            session: SessionRow = (
                gateway.session_by_key(auth)
                if session_id is None
                else gateway.session_by_path(session_id, auth)
            )
            release = gateway.admission.admit(session.id)
            try:
                return await gateway.chat.answer(session, body), release
            except BaseException:
                release()  # a cancelled call (its client left) gives its slot back too
                raise
        except GatewayError as exc:
            error = exc
        except Exception as exc:
            error = internal_error(exc)
        gateway.metrics.error(error)
        return error_response(error), _nothing


class GatewayAPI(FastAPI):
    """FastAPI with pure ASGI layers in front of all of its own machinery: the chat routes,
    and whatever `put_in_front` adds around them."""

    _front: ASGIApp | None = None

    def answer_chat_calls(self, gateway: Gateway) -> None:
        self.put_in_front(lambda inner: ChatRoutes(inner, gateway))

    def put_in_front(self, layer: Callable[[ASGIApp], ASGIApp]) -> None:
        """Wrap what answers requests now (FastAPI itself at first) in `layer`."""
        self._front = layer(self._front or super().__call__)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._front is None:
            await super().__call__(scope, receive, send)
        else:
            await self._front(scope, receive, send)


def _nothing() -> None:
    pass


def _match(scope: Scope) -> tuple[str | None, str | None]:
    """(route template, session id in the path) for a chat call, (None, None) otherwise."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None, None
    path: str = scope["path"]
    if path == BY_KEY:
        return BY_KEY, None
    if path.startswith(_SESSIONS) and path.endswith(BY_KEY):
        session_id = path[len(_SESSIONS) : -len(BY_KEY)]
        if session_id and "/" not in session_id:  # what the template's {session_id} matches
            return BY_PATH, session_id
    return None, None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def _body(receive: Receive) -> bytes | None:
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


_DONE = b"data: [DONE]\n\n"


async def _stream(response: StreamingResponse, receive: Receive, send: Send) -> None:
    """Send a streamed answer; a client that disconnects stops it (its generator is closed)."""
    me = asyncio.current_task()
    assert me is not None
    streaming = True
    cut = False

    async def watch() -> None:
        nonlocal cut
        while (await receive())["type"] != "http.disconnect":
            pass
        if streaming:  # not once the last event is being sent: the answer is complete
            cut = True
            me.cancel()

    watcher = asyncio.create_task(watch(), name="stream-disconnect-watch")
    body: Any = response.body_iterator
    try:
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": response.raw_headers,
            }
        )
        async with contextlib.aclosing(body):
            async for chunk in body:
                # The block ending in [DONE] is an answer's last: it ends the response in the
                # same write instead of one more for the empty closing chunk.
                last = chunk.endswith(_DONE)
                streaming = not last
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    return
        streaming = False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not cut:
            raise
        me.uncancel()  # the cut was ours: the client is gone and the generator closed
    finally:
        streaming = False
        watcher.cancel()
