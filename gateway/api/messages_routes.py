"""Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens` (by session
key, `x-api-key` or `Authorization: Bearer`), and their twins under `/sessions/{session_id}`.

A front end over the one call pipeline: the body is translated into a chat-completions body
(dialects/messages.py) and enters `CallPipeline.prepare_chat_raw`, so it is bounded, admitted,
rendered (bridging the previous call's exact tokens), generated across weight syncs and
recorded exactly as a chat call is; the parsed answer goes back as a `message` or as the
Messages stream's events (dialects/messages_stream.py), its deltas found by the chat stream's
`DeltaTracker`. A token count renders the prompt the same call would have and makes no call.

Errors on these paths are in Anthropic's shape (`{"type": "error", "error": {"type",
"message"}}`), whichever layer refused the request (the body limit, an unknown path, the
pipeline): `AnthropicErrors` rewrites the gateway's error bodies on their way out. The rest of
the gateway keeps OpenAI's shape.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lockgate.gateway.api.gateway import Gateway
from lockgate.gateway.api.responses import json_response
from lockgate.gateway.api.streaming import (
    DeltaStream,
    DeltaTracker,
    ReleasingStream,
    start_stream,
)
from lockgate.gateway.calls.bodies import parse_json
from lockgate.gateway.calls.pipeline import ChatCall
from lockgate.gateway.dialects.messages import (
    MessagesRequest,
    StopReason,
    chat_body,
    error_body,
    matched_stop,
    message_response,
    read_request,
    stop_reason,
)
from lockgate.gateway.dialects.messages_stream import MessageEvents
from lockgate.gateway.errors import GatewayError, unauthorized
from lockgate.gateway.schema import AssistantMessage
from lockgate.gateway.store.trajectories import SessionRow

Release = Callable[[], None]

_MESSAGES = "/v1/messages"
_SESSIONS = "/sessions/"


class MessagesAnswers:
    """Answers Messages API calls through the call pipeline."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.calls = gateway.calls
        self.renderer = gateway.renderer
        self.model = gateway.config.model_name

    def _read(self, body: bytes, counting: bool) -> MessagesRequest:
        limits = self.gateway.config.limits
        return read_request(parse_json(body, limits.max_json_values), limits, counting)

    async def answer(self, session: SessionRow, body: bytes, release: Release) -> Response:
        """The answer to one call; `release` (the session's admission slot) is given back
        when the answer is complete: at once, or when its stream ends."""
        req = self._read(body, counting=False)
        call = await self.calls.prepare_chat_raw(session, chat_body(req))
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        if req.stream:
            stops = req.stop_sequences or ()
            tracker = DeltaTracker(self.renderer, call.prompt.prompt_ids, call.req.tools, stops)
            stream = DeltaStream(self.calls, call, await start_stream(self.calls, call), tracker)
            return ReleasingStream(self._events(call, req, message_id, stream), release)
        try:
            await self.calls.generate(call)
            parsed = self.calls.parse(call)
            await self.calls.record(call)
        finally:
            release()
        s = call.generator.sampled
        return json_response(
            message_response(
                message_id,
                self.model,
                parsed.message,
                self._stop(call, req, parsed.message),
                (len(call.prompt.prompt_ids), len(s.token_ids)),
            )
        )

    async def count_tokens(self, session: SessionRow, body: bytes) -> Response:
        """The prompt tokens the same request would send, counted by rendering it as a call
        would (the previous call's tokens bridged where it can); no call is made."""
        req = self._read(body, counting=True)
        _, prompt = await self.calls.render_chat_raw(session, chat_body(req))
        return json_response({"input_tokens": len(prompt.prompt_ids)})

    def _stop(
        self, call: ChatCall, req: MessagesRequest, message: AssistantMessage
    ) -> tuple[StopReason, str | None]:
        s = call.generator.sampled
        finish = s.finish_reason or "stop"
        sequence = None
        if finish == "stop" and req.stop_sequences:
            # The call ended at the token that completed a stop sequence: its text has it.
            text = self.renderer.tokenizer.decode(s.token_ids, skip_special_tokens=True)
            sequence = matched_stop(text, req.stop_sequences)
        return stop_reason(finish, bool(message.tool_calls), sequence), sequence

    async def _events(
        self, call: ChatCall, req: MessagesRequest, message_id: str, stream: DeltaStream
    ) -> AsyncIterator[bytes]:
        events = MessageEvents(message_id, self.model, len(call.prompt.prompt_ids))
        head = events.start()
        try:
            async for d in stream.deltas():
                yield head + events.delta(d.reasoning, d.content)
                head = b""
        except GatewayError as exc:
            self.gateway.metrics.error(exc)
            yield head + events.failed(exc.status_code, exc.message)
            return
        message = stream.message
        assert message is not None
        rest = stream.tracker.finish(message)
        stop = self._stop(call, req, message)
        n = len(call.generator.sampled.token_ids)
        yield events.finish((rest.reasoning, rest.content), message, stop, n)


def _authorization(request: Request) -> str | None:
    """The session key as `Authorization` carries it: Anthropic's SDKs send `x-api-key`."""
    key = request.headers.get("x-api-key")
    return f"Bearer {key}" if key else request.headers.get("authorization")


def messages_routes(gateway: Gateway) -> APIRouter:
    """The Messages API's routes, by session key and by session path."""
    router = APIRouter()
    answers = MessagesAnswers(gateway)

    def session_of(session_id: str | None, request: Request) -> SessionRow:
        auth = _authorization(request)
        if session_id is not None:
            return gateway.session_by_path(session_id, auth)
        if auth is None:
            raise unauthorized("missing API key: send 'x-api-key: <session key>'")
        return gateway.session_by_key(auth)

    async def answer(session_id: str | None, request: Request) -> Response:
        session = session_of(session_id, request)
        release = gateway.admission.admit(session.id)
        try:
            return await answers.answer(session, await request.body(), release)
        except BaseException:
            release()
            raise

    async def count(session_id: str | None, request: Request) -> Response:
        session = session_of(session_id, request)
        release = gateway.admission.admit(session.id)  # a count renders: it is bounded alike
        try:
            return await answers.count_tokens(session, await request.body())
        finally:
            release()

    @router.post("/sessions/{session_id}/v1/messages")
    async def by_path(session_id: str, request: Request) -> Response:
        return await answer(session_id, request)

    @router.post(_MESSAGES)
    async def by_key(request: Request) -> Response:
        return await answer(None, request)

    @router.post("/sessions/{session_id}/v1/messages/count_tokens")
    async def count_by_path(session_id: str, request: Request) -> Response:
        return await count(session_id, request)

    @router.post(_MESSAGES + "/count_tokens")
    async def count_by_key(request: Request) -> Response:
        return await count(None, request)

    return router


def is_messages_path(path: str) -> bool:
    """`/v1/messages` or a path under it, by key or under a session."""
    if path.startswith(_SESSIONS):
        _, _, rest = path[len(_SESSIONS) :].partition("/")
        path = "/" + rest
    return path == _MESSAGES or path.startswith(_MESSAGES + "/")


class AnthropicErrors:
    """A pure ASGI layer that answers errors on the Messages API's paths in Anthropic's shape:
    an error the gateway answered (a status of 400 or more, its body OpenAI's error object) is
    rewritten on its way out; every other answer passes untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        parts: list[bytes] = []

        async def rewriting(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                await _send_error(send, start, b"".join(parts))

        await self.app(scope, receive, rewriting)


async def _send_error(send: Send, start: Message, body: bytes) -> None:
    status = start["status"]
    try:
        message = orjson.loads(body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    out = orjson.dumps(error_body(status, str(message)))
    headers = [
        (k, v) for k, v in start.get("headers", []) if k not in (b"content-length", b"content-type")
    ]
    headers += [(b"content-length", str(len(out)).encode()), (b"content-type", b"application/json")]
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": out, "more_body": False})
