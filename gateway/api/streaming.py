"""Streamed answers: content and reasoning deltas from a growing list of completion ids.

The parser that gives the final message also gives the deltas: each update re-parses all ids
received so far and forwards only what extends what was already sent. Re-parsing is O(n) per
update, so updates are made per *burst* of upstream chunks, not per chunk (each step of
`CallGenerator.run` takes every chunk that arrived since the last): when the
gateway keeps up, every chunk is its own burst and goes out at once; when it falls behind, the
chunks that queued up meanwhile cost one parse, not one each, so the work per call stays bounded
by the gateway's own pace instead of growing with the square of the completion length. The last
update's parse is the final message when no tool call was held back (`DeltaTracker.final`). Text that the final parse
could still change is held back: trailing whitespace (the parser strips it), an incomplete UTF-8
character at the end, and anything from a tool-call opener on (tool calls go out whole, with the
finish). So the concatenated deltas are the non-streamed content, token for token.

The other APIs' streams (the dialects' routes) share the rest: `start_stream` starts a call's
generation, `DeltaStream` gives its deltas then its recorded answer, and `ReleasingStream`
sends the events and gives the session's admission slot back when the stream ends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from lockgate.gateway.calls.pipeline import CallPipeline, ChatCall
from lockgate.gateway.calls.rendering import ChatRenderer, ParsedCompletion, token_array
from lockgate.gateway.calls.stops import cut_at_stop
from lockgate.gateway.errors import GatewayError
from lockgate.gateway.schema import AssistantMessage, ToolSpec

log = logging.getLogger(__name__)


async def start_stream(calls: CallPipeline, call: ChatCall) -> tuple[AsyncIterator[int], bool]:
    """A streamed call's generation, started, and whether it gave tokens yet. A stream's answer
    waits for the first tokens, so that a call that cannot start (no replica, a pause that
    outlasts the limit) still gets a plain HTTP error, not a broken stream."""
    chunks = call.generator.run()
    try:
        first = await anext(chunks, None)
    except GatewayError:
        await chunks.aclose()
        await calls.record_unfinished(call)
        raise
    return chunks, first is not None


def _stable(text: str) -> str:
    return text.strip().rstrip("\ufffd")


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning)


class DeltaTracker:
    def __init__(
        self,
        renderer: ChatRenderer,
        prompt_ids: Sequence[int],
        tools: list[ToolSpec] | None,
        stops: Sequence[str] = (),
    ) -> None:
        self._renderer = renderer
        self._prompt_ids = token_array(prompt_ids)
        self._tools = tools
        self._stop_at = renderer.tool_call_start_id
        self._stops = [x for x in stops if x]
        self.sent_content = ""
        self.sent_reasoning = ""
        # The last parse of the whole completion so far (no tool call held back), by length.
        self._parsed: tuple[int, ParsedCompletion] | None = None

    def update(self, completion_ids: Sequence[int]) -> Delta:
        ids = list(completion_ids)
        whole = True
        if self._stop_at is not None and self._stop_at in ids:
            ids, whole = ids[: ids.index(self._stop_at)], False
        parsed = self._renderer.parse_completion(ids, self._prompt_ids, self._tools)
        self._parsed = (len(ids), parsed) if whole else None
        message = parsed.message
        # No marker token opens this format's calls: text may still become a call, so
        # content waits for the whole completion (finish) while tools are offered.
        content = "" if self._tools and self._renderer.holds_content_for_tools else message.content
        return self._advance(
            self._before_stop(_stable(content or "")),
            self._before_stop(_stable(message.reasoning_content or "")),
        )

    def _before_stop(self, text: str) -> str:
        """What may go out: nothing from a stop string on, nor a tail that may begin one."""
        if not self._stops:
            return text
        text, found = cut_at_stop(text, self._stops)
        if found:
            return text
        hold = max(
            (n for stop in self._stops for n in range(1, len(stop)) if text.endswith(stop[:n])),
            default=0,
        )
        return text[: len(text) - hold]

    def final(self, completion_ids: Sequence[int]) -> ParsedCompletion:
        """The parse of the finished completion; the last update's when it parsed all of it
        (the ids only ever grow, so the same length is the same ids)."""
        if self._parsed is not None and self._parsed[0] == len(completion_ids):
            return self._parsed[1]
        return self._renderer.parse_completion(list(completion_ids), self._prompt_ids, self._tools)

    def finish(self, message: AssistantMessage) -> Delta:
        """The rest of the final message (whatever was held back)."""
        return self._advance(message.content or "", message.reasoning_content or "")

    def _advance(self, content: str, reasoning: str) -> Delta:
        delta = Delta()
        if content.startswith(self.sent_content):
            delta.content = content[len(self.sent_content) :]
            self.sent_content = content
        elif content:
            log.warning("streamed content diverged from the parse; holding the rest back")
        if reasoning.startswith(self.sent_reasoning):
            delta.reasoning = reasoning[len(self.sent_reasoning) :]
            self.sent_reasoning = reasoning
        elif reasoning:
            log.warning("streamed reasoning diverged from the parse; holding the rest back")
        return delta


class DeltaStream:
    """A streamed call's deltas as its tokens arrive (one per burst of upstream chunks, as
    `CallGenerator.run` gives them), then its answer, parsed and recorded (`message`). A failure
    keeps the tokens on record (`record_unfinished`) and is raised for the answer's own
    error event."""

    def __init__(
        self,
        calls: CallPipeline,
        call: ChatCall,
        started: tuple[AsyncIterator[int], bool],
        tracker: DeltaTracker,
    ) -> None:
        self.calls, self.call, self.tracker = calls, call, tracker
        self.chunks, self.primed = started  # what `start_stream` gave
        self.message: AssistantMessage | None = None

    async def deltas(self) -> AsyncIterator[Delta]:
        """The deltas; the first (perhaps empty) at once for the tokens already in."""
        s = self.call.generator.sampled
        try:
            yield self.tracker.update(s.token_ids) if self.primed else Delta()
            async for _ in self.chunks:
                if d := self.tracker.update(s.token_ids):
                    yield d
            self.message = self.calls.parse(self.call, self.tracker.final(s.token_ids)).message
            await self.calls.record(self.call)
        except GatewayError:
            await self.chunks.aclose()
            await self.calls.record_unfinished(self.call)
            raise
        finally:
            await self.chunks.aclose()


class ReleasingStream(StreamingResponse):
    """An SSE answer that gives the session's admission slot back when it ends, however it
    ends, and closes its events (so a client that left stops its call's generation)."""

    def __init__(self, events: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
            self._release()
