"""A streamed Responses API answer: the typed server-sent events OpenAI's SDKs parse.

`response.created` and `response.in_progress` open the stream; reasoning and text then go out
as their deltas arrive, each in its output item and content part (`response.output_item.added`,
`response.content_part.added`, `response.reasoning_text.delta` / `response.output_text.delta`);
the finished answer closes them (`.done` events carrying the final item), adds each function
call whole (its arguments as one delta) and ends with `response.completed` (or
`response.incomplete` when the token budget cut it), whose response is the non-streamed answer
for the same tokens. A failure after the stream began ends it with `response.failed`. Every
event carries the next `sequence_number`, from 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from lockgate.gateway.dialects.responses import message_item, output_text, reasoning_item
from lockgate.gateway.errors import GatewayError


@dataclass
class _Item:
    """An output item being streamed: its place, id and the text sent so far."""

    index: int
    item_id: str
    sent: str = ""
    closed: bool = False


class ResponseEvents:
    """The events of one streamed response, numbered in the order they are made."""

    def __init__(self, shell: dict[str, Any]) -> None:
        self.shell = shell
        self.suffix = shell["id"].removeprefix("resp_")
        self.seq = 0
        self.next_index = 0
        self.reasoning: _Item | None = None
        self.message: _Item | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def start(self) -> bytes:
        return self.event("response.created", response=self.shell) + self.event(
            "response.in_progress", response=self.shell
        )

    def delta(self, reasoning: str, content: str) -> bytes:
        """The events for new reasoning and text (reasoning first, as the model writes it)."""
        out = b""
        if reasoning and self.message is None:
            out += self._reasoning_delta(reasoning)
        if content:
            out += self._close_reasoning(None)
            out += self._text_delta(content)
        return out

    def _reasoning_delta(self, text: str) -> bytes:
        out = b""
        if self.reasoning is None:
            self.reasoning = item = _Item(self.next_index, f"rs_{self.suffix}")
            self.next_index += 1
            out += self.event(
                "response.output_item.added",
                output_index=item.index,
                item=reasoning_item(item.item_id, None, "in_progress"),
            )
            out += self._part("added", item, {"type": "reasoning_text", "text": ""})
        item = self.reasoning
        item.sent += text
        return out + self.event("response.reasoning_text.delta", **self._at(item), delta=text)

    def _open_message(self) -> bytes:
        if self.message is not None:
            return b""
        self.message = item = _Item(self.next_index, f"msg_{self.suffix}")
        self.next_index += 1
        added = self.event(
            "response.output_item.added",
            output_index=item.index,
            item=message_item(item.item_id, None, "in_progress"),
        )
        return added + self._part("added", item, output_text(""))

    def _text_delta(self, text: str) -> bytes:
        out = self._open_message()
        assert self.message is not None
        self.message.sent += text
        return out + self.event(
            "response.output_text.delta", **self._at(self.message), delta=text, logprobs=[]
        )

    def _at(self, item: _Item) -> dict[str, Any]:
        return {"item_id": item.item_id, "output_index": item.index, "content_index": 0}

    def _part(self, when: str, item: _Item, part: dict[str, Any]) -> bytes:
        return self.event(f"response.content_part.{when}", **self._at(item), part=part)

    def _close_reasoning(self, final: dict[str, Any] | None) -> bytes:
        """The reasoning item's last events, once the text begins or the answer is in."""
        item = self.reasoning
        if item is None or item.closed:
            return b""
        text = final["content"][0]["text"] if final else item.sent
        out = b""
        if text.startswith(item.sent) and text != item.sent:
            out += self.event(
                "response.reasoning_text.delta", **self._at(item), delta=text[len(item.sent) :]
            )
        part = {"type": "reasoning_text", "text": text}
        out += self.event("response.reasoning_text.done", **self._at(item), text=text)
        out += self._part("done", item, part)
        done = final or reasoning_item(item.item_id, text, "completed")
        out += self.event("response.output_item.done", output_index=item.index, item=done)
        item.closed = True
        return out

    def finish(self, response: dict[str, Any]) -> bytes:
        """The rest of the answer, then `response.completed` (or `.incomplete`)."""
        out = b""
        for final in response["output"]:
            kind = final["type"]
            if kind == "reasoning":
                if self.reasoning is None and self.message is None:
                    out += self._reasoning_delta(final["content"][0]["text"])
                out += self._close_reasoning(final)
            elif kind == "message":
                out += self._close_reasoning(None)
                out += self._close_message(final)
            else:
                out += self._close_reasoning(None)
                out += self._function_call(final)
        terminal = (
            "response.completed" if response["status"] == "completed" else "response.incomplete"
        )
        return out + self.event(terminal, response=response)

    def _close_message(self, final: dict[str, Any]) -> bytes:
        text = final["content"][0]["text"]
        out = self._open_message()
        item = self.message
        assert item is not None
        if text.startswith(item.sent) and text != item.sent:
            out += self._text_delta(text[len(item.sent) :])
        out += self.event("response.output_text.done", **self._at(item), text=text, logprobs=[])
        out += self._part("done", item, output_text(text))
        return out + self.event("response.output_item.done", output_index=item.index, item=final)

    def _function_call(self, final: dict[str, Any]) -> bytes:
        index = self.next_index
        self.next_index += 1
        added = {**final, "arguments": "", "status": "in_progress"}
        at = {"item_id": final["id"], "output_index": index}
        return b"".join(
            (
                self.event("response.output_item.added", output_index=index, item=added),
                self.event(
                    "response.function_call_arguments.delta", **at, delta=final["arguments"]
                ),
                self.event(
                    "response.function_call_arguments.done",
                    **at,
                    name=final["name"],
                    arguments=final["arguments"],
                ),
                self.event("response.output_item.done", output_index=index, item=final),
            )
        )

    def failed(self, exc: GatewayError) -> bytes:
        """The stream's end when the call fails after it began."""
        code = "rate_limit_exceeded" if exc.status_code == 429 else "server_error"
        response = {
            **self.shell,
            "status": "failed",
            "error": {"code": code, "message": exc.message},
        }
        return self.event("response.failed", response=response)
