"""The answer to a chat call: one JSON body, or an SSE stream of deltas as tokens arrive.

The call itself (validation, rendering, generation, the record) is the pipeline's
(calls/pipeline.py); this turns it into what OpenAI's clients expect: the message, finish
reason, usage and logprobs, or `chat.completion.chunk` events ending in `[DONE]`. A stream
starts only once the first tokens are in, so a call that cannot start still gets a plain HTTP
error; a failure after that ends the stream with an error event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse

from lockgate.gateway.api.responses import json_response
from lockgate.gateway.api.streaming import DeltaTracker, start_stream
from lockgate.gateway.calls.pipeline import CallPipeline, ChatCall
from lockgate.gateway.calls.rendering import ChatRenderer
from lockgate.gateway.calls.stops import as_list
from lockgate.gateway.errors import GatewayError
from lockgate.gateway.metrics import GatewayMetrics
from lockgate.gateway.replicas.generation import Sampled
from lockgate.gateway.schema import (
    ChatChoice,
    ChatCompletionResponse,
    ChoiceLogprobs,
    TokenLogprob,
    Usage,
)
from lockgate.gateway.store.trajectories import SessionRow


class ChatAnswers:
    """Answers chat calls through the pipeline."""

    def __init__(self, calls: CallPipeline, metrics: GatewayMetrics) -> None:
        self.calls = calls
        self.metrics = metrics

    async def answer(self, session: SessionRow, body: bytes) -> Response:
        call = await self.calls.prepare_chat(session, body)
        if call.req.stream:
            return await self._stream(call)
        await self.calls.generate(call)
        parsed = self.calls.parse(call)
        await self.calls.record(call)
        return json_response(self._response(call, parsed.message, parsed.has_tool_calls))

    def _finish_reason(self, call: ChatCall, has_tool_calls: bool) -> str:
        finish = call.generator.sampled.finish_reason or "stop"
        return "tool_calls" if finish == "stop" and has_tool_calls else finish

    def _usage(self, call: ChatCall) -> Usage:
        n_prompt, n = len(call.prompt.prompt_ids), len(call.generator.sampled.token_ids)
        return Usage(prompt_tokens=n_prompt, completion_tokens=n, total_tokens=n_prompt + n)

    def _logprobs(self, s: Sampled, start: int, k: int) -> ChoiceLogprobs:
        """OpenAI logprobs for the tokens from `start`; with the top-k candidates if k > 0."""
        decode = self.calls.renderer.decode_token
        content = []
        for i in range(start, len(s.token_ids)):
            token = decode(s.token_ids[i])
            top = s.top_logprobs[i][:k] if k and i < len(s.top_logprobs) else []
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=s.logprobs[i],
                    top_logprobs=[
                        {"token": decode(tid), "logprob": lp, "bytes": None} for tid, lp in top
                    ],
                )
            )
        return ChoiceLogprobs(content=content)

    def _response(
        self, call: ChatCall, message: Any, has_tool_calls: bool
    ) -> ChatCompletionResponse:
        s = call.generator.sampled
        return ChatCompletionResponse(
            id=_completion_id(call),
            model=self.calls.config.model_name,
            choices=[
                ChatChoice(
                    message=message,
                    finish_reason=self._finish_reason(call, has_tool_calls),  # type: ignore[arg-type]
                    logprobs=self._logprobs(s, 0, call.req.top_logprobs or 0)
                    if call.req.logprobs
                    else None,
                )
            ],
            usage=self._usage(call),
        )

    async def _stream(self, call: ChatCall) -> Response:
        chunks, primed = await start_stream(self.calls, call)
        return StreamingResponse(self._sse(call, chunks, primed), media_type="text/event-stream")

    async def _sse(
        self, call: ChatCall, chunks: AsyncIterator[int], primed: bool
    ) -> AsyncIterator[bytes]:
        events = _ChunkEvents(
            call, self.calls.renderer, self.calls.config.model_name, self._logprobs
        )
        s = call.generator.sampled
        # Events ready at the same moment go out in one write: the role and what the first
        # tokens say; at the end, the rest, the finish, the usage and [DONE]. An update made
        # once the replica's real finish is in waits for the ending and goes out with it, so
        # an answer that arrives whole is one write.
        held = events.event({"role": "assistant", "content": ""})
        try:
            if primed and (update := events.progress()):
                held += update
            if not call.generator.finished:
                yield held
                held = b""
            # One step per burst of upstream chunks (replicas/generation.py): the tokens that came
            # while the last update was being sent go out together.
            async for _ in chunks:
                if update := events.progress():
                    if call.generator.finished:
                        held += update
                    else:
                        yield update
            parsed = self.calls.parse(call, events.tracker.final(s.token_ids))
            await self.calls.record(call)
        except GatewayError as exc:
            self.metrics.error(exc)
            await chunks.aclose()
            await self.calls.record_unfinished(call)
            yield held + b"data: " + orjson.dumps(exc.body()) + b"\n\ndata: [DONE]\n\n"
            return
        finally:
            await chunks.aclose()
        finish = self._finish_reason(call, parsed.has_tool_calls)
        options = call.req.stream_options
        usage = self._usage(call) if options is not None and options.include_usage else None
        yield held + events.ending(parsed.message, finish, usage)


class _ChunkEvents:
    """The `chat.completion.chunk` events of one streamed call, as its tokens arrive."""

    def __init__(
        self,
        call: ChatCall,
        renderer: ChatRenderer,
        model: str,
        logprobs: Callable[[Sampled, int, int], ChoiceLogprobs],
    ) -> None:
        self.call = call
        self.cid, self.created, self.model = _completion_id(call), int(time.time()), model
        self.logprobs = logprobs
        self.tracker = DeltaTracker(
            renderer, call.prompt.prompt_ids, call.req.tools, as_list(call.req.stop)
        )
        self.sent_logprobs = 0

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload = {
            "id": self.cid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def event(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        choice.update(extra)
        return self.chunk([choice])

    def logprobs_extra(self) -> dict[str, Any]:
        """The logprobs of the tokens not sent yet, if the call asked for logprobs."""
        s, req = self.call.generator.sampled, self.call.req
        if not req.logprobs or self.sent_logprobs >= len(s.token_ids):
            return {}
        lp = self.logprobs(s, self.sent_logprobs, req.top_logprobs or 0)
        self.sent_logprobs = len(s.token_ids)
        return {"logprobs": lp.model_dump(mode="json")}

    def progress(self) -> bytes | None:
        """The event for what the tokens received so far add, if anything."""
        d = self.tracker.update(self.call.generator.sampled.token_ids)
        extra = self.logprobs_extra()
        return self.event(_deltas(d.content, d.reasoning), **extra) if d or extra else None

    def ending(self, message: Any, finish: str, usage: Usage | None) -> bytes:
        """The rest of the answer, the finish, the usage if given, and [DONE]."""
        d = self.tracker.finish(message)
        tail = _deltas(d.content, d.reasoning)
        if message.tool_calls:
            tail["tool_calls"] = [
                {"index": i, **tc.model_dump(mode="json")}
                for i, tc in enumerate(message.tool_calls)
            ]
        extra = self.logprobs_extra()
        closing = [self.event(tail, **extra)] if tail or extra else []
        closing.append(self.event({}, finish))
        if usage is not None:
            closing.append(self.chunk([], usage=usage.model_dump()))
        closing.append(b"data: [DONE]\n\n")
        return b"".join(closing)


def _deltas(content: str, reasoning: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if reasoning:
        out["reasoning_content"] = reasoning
    if content:
        out["content"] = content
    return out


def _completion_id(call: ChatCall) -> str:
    return f"chatcmpl-{call.session.id[:8]}-{call.index}"
