"""A streamed Messages API answer: the server-sent events Anthropic's SDKs parse.

`message_start` (the message with no content yet and its input tokens) and a `ping` open the
stream; thinking and text then go out as their deltas arrive, each in its content block
(`content_block_start`, `thinking_delta` / `text_delta` deltas, `content_block_stop`); the
finished answer adds what the last deltas held back, each tool call as a `tool_use` block whose
input goes out whole as one `input_json_delta`, then `message_delta` (stop reason, stop
sequence, output tokens) and `message_stop`. The blocks and their text are the non-streamed
answer's for the same tokens. A failure after the stream began ends it with an `error` event.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from lockgate.gateway.dialects.messages import (
    StopReason,
    error_body,
    text_block,
    thinking_block,
    tool_use_block,
)
from lockgate.gateway.schema import AssistantMessage

log = logging.getLogger(__name__)


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class MessageEvents:
    """The events of one streamed message, its blocks numbered in the order they open."""

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.blocks = 0  # blocks opened so far
        self.open: str | None = None  # the kind of the block open now: "thinking" or "text"
        self.texts_started = False

    def start(self) -> bytes:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return sse("message_start", {"type": "message_start", "message": message}) + sse(
            "ping", {"type": "ping"}
        )

    def delta(self, reasoning: str, content: str) -> bytes:
        """The events for new thinking and text (thinking first, as the model writes it)."""
        out = b""
        if reasoning:
            if self.texts_started:
                # The parse gave thinking after text had begun: a block cannot reopen.
                log.warning("thinking after the text began; holding it back from the stream")
            else:
                out += self._into("thinking", reasoning)
        if content:
            self.texts_started = True
            out += self._into("text", content)
        return out

    def _into(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open != kind:
            out += self._close()
            block = thinking_block("") if kind == "thinking" else text_block("")
            out += sse(
                "content_block_start",
                {"type": "content_block_start", "index": self.blocks, "content_block": block},
            )
            self.open = kind
            self.blocks += 1
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "thinking"
            else {"type": "text_delta", "text": text}
        )
        return out + sse(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta},
        )

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return sse("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})

    def finish(
        self,
        rest: tuple[str, str],
        message: AssistantMessage,
        stop: tuple[StopReason, str | None],
        output_tokens: int,
    ) -> bytes:
        """The end of the stream: `rest` (reasoning, content) the deltas held back until the
        final parse, then the tool calls of `message`, the stop and the usage."""
        out = self.delta(*rest) + self._close()
        for call in message.tool_calls or []:
            block = tool_use_block(call)
            opened = {**block, "input": {}}
            delta = {
                "type": "input_json_delta",
                "partial_json": orjson.dumps(block["input"]).decode(),
            }
            index = self.blocks
            self.blocks += 1
            out += sse(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": opened},
            )
            out += sse(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
            out += sse("content_block_stop", {"type": "content_block_stop", "index": index})
        ending = {
            "type": "message_delta",
            "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
            "usage": {"output_tokens": output_tokens},
        }
        return out + sse("message_delta", ending) + sse("message_stop", {"type": "message_stop"})

    def failed(self, status: int, message: str) -> bytes:
        """The event that ends a stream that failed after it began."""
        return sse("error", error_body(status, message))
