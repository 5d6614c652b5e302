"""OpenAI's Responses API: `POST /v1/responses` (by session key) and
`POST /sessions/{session_id}/v1/responses` (by session path).

A front end over the one call pipeline: the body is translated into a chat-completions body
(dialects/responses.py) and enters `CallPipeline.prepare_chat_raw`, so it is bounded, admitted,
rendered (bridging the previous call's exact tokens), generated across weight syncs and
recorded exactly as a chat call is; the parsed answer goes back as a `response` object or as
the Responses stream's typed events (dialects/responses_stream.py), its deltas found by the
chat stream's `DeltaTracker`. A `previous_response_id` is resolved from the session's own
records (its id names the call), never from a second store.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

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
from lockgate.gateway.calls.stops import as_list
from lockgate.gateway.dialects.responses import (
    chat_body,
    check_continuable,
    continued_history,
    finished_response,
    previous_index,
    read_request,
    response_id,
    response_shell,
    stable_call_ids,
)
from lockgate.gateway.dialects.responses_stream import ResponseEvents
from lockgate.gateway.errors import GatewayError
from lockgate.gateway.schema import AssistantMessage, ChatCompletionRequest
from lockgate.gateway.store.trajectories import SessionRow

Release = Callable[[], None]


class ResponsesAnswers:
    """Answers Responses API calls through the call pipeline."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.calls = gateway.calls
        self.renderer = gateway.renderer
        self.think_end = gateway.renderer.special_tokens.get("</think>")

    async def answer(self, session: SessionRow, body: bytes, release: Release) -> Response:
        """The answer to one call; `release` (the session's admission slot) is given back
        when the answer is complete: at once, or when its stream ends."""
        limits = self.gateway.config.limits
        req = read_request(
            parse_json(body, limits.max_json_values), limits.max_messages, limits.max_tools
        )
        history = await self._history(session, req.previous_response_id)
        call = await self.calls.prepare_chat_raw(session, chat_body(req, history))
        shell = response_shell(
            req,
            response_id(session.id, call.index),
            int(call.started_at),
            self.gateway.config.model_name,
            call.sampling,
        )
        if req.stream:
            return await self._stream(call, shell, release)
        try:
            await self.calls.generate(call)
            message = self.calls.parse(call).message
            await self.calls.record(call)
        finally:
            release()
        return json_response(self._finished(call, shell, message))

    async def _history(self, session: SessionRow, previous: str | None) -> list[dict[str, Any]]:
        """The chat messages a `previous_response_id` continues: its call's, and its answer."""
        if previous is None:
            return []
        record = await self.gateway.store.get_call(session.id, previous_index(previous, session.id))
        check_continuable(
            previous,
            None if record is None else record.request,
            None if record is None else record.finish_reason,
        )
        assert record is not None
        chat = ChatCompletionRequest.model_validate(record.request)
        parsed = self.renderer.parse_completion(
            record.completion_ids, record.prompt_ids, chat.tools
        )
        return continued_history(
            record.request, stable_call_ids(parsed.message, previous), previous
        )

    def _finished(
        self, call: ChatCall, shell: dict[str, Any], message: AssistantMessage
    ) -> dict[str, Any]:
        ids = call.generator.sampled.token_ids
        if self.think_end is not None and self.think_end in ids:
            reasoning = ids.index(self.think_end) + 1
        else:
            reasoning = len(ids) if message.reasoning_content else 0
        return finished_response(
            shell,
            stable_call_ids(message, shell["id"]),
            call.generator.sampled.finish_reason or "stop",
            (len(call.prompt.prompt_ids), len(ids), reasoning),
            int(time.time()),
        )

    async def _stream(self, call: ChatCall, shell: dict[str, Any], release: Release) -> Response:
        started = await start_stream(self.calls, call)
        tracker = DeltaTracker(
            self.renderer, call.prompt.prompt_ids, call.req.tools, as_list(call.req.stop)
        )
        stream = DeltaStream(self.calls, call, started, tracker)
        return ReleasingStream(self._events(stream, shell), release)

    async def _events(self, stream: DeltaStream, shell: dict[str, Any]) -> AsyncIterator[bytes]:
        events = ResponseEvents(shell)
        head = events.start()  # goes out with what the first tokens say
        try:
            async for d in stream.deltas():
                yield head + events.delta(d.reasoning, d.content)
                head = b""
        except GatewayError as exc:
            self.gateway.metrics.error(exc)
            yield head + events.failed(exc)
            return
        assert stream.message is not None
        yield events.finish(self._finished(stream.call, shell, stream.message))


def responses_routes(gateway: Gateway) -> APIRouter:
    """`POST /v1/responses` by session key and `/sessions/{session_id}/v1/responses` by path."""
    router = APIRouter()
    answers = ResponsesAnswers(gateway)

    async def answer(session: SessionRow, request: Request) -> Response:
        release = gateway.admission.admit(session.id)
        try:
            return await answers.answer(session, await request.body(), release)
        except BaseException:
            release()
            raise

    @router.post("/sessions/{session_id}/v1/responses")
    async def by_path(session_id: str, request: Request) -> Response:
        auth = request.headers.get("authorization")
        return await answer(gateway.session_by_path(session_id, auth), request)

    @router.post("/v1/responses")
    async def by_key(request: Request) -> Response:
        return await answer(gateway.session_by_key(request.headers.get("authorization")), request)

    return router
