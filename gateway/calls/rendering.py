"""Chat <-> token ids, through the `renderers` library.

`ChatRenderer.render_prompt` prefers extending the previous call's exact prompt + completion
tokens (`bridge_to_next_turn`), so a multi-turn session trains on what the model really saw; it
falls back to a full render when the agent's history does not continue the previous call, and
says so. `parse_completion` turns sampled ids back into content / reasoning / tool calls.
"""

from __future__ import annotations

import json
import logging
import uuid
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import renderers
from transformers import AutoTokenizer

from lockgate.gateway.calls.chat_format import GENERIC, bridges_turns
from lockgate.gateway.calls.tokenizer import fast_tokenizer
from lockgate.gateway.errors import bad_request
from lockgate.gateway.schema import AssistantMessage, ChatMessage, FunctionCall, ToolCall, ToolSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreviousTurn:
    """What the bridge needs from the session's previous call.

    One is held for every open session between its calls, so its token ids are C arrays
    (`token_array`), not lists: the garbage collector walks every item of every list it tracks,
    and thousands of sessions' ids as lists made each full collection stop the event loop for
    a noticeable time (measured in benchmarks/README.md, "Scale simulation"). An array holds no
    objects to walk."""

    messages: list[dict[str, Any]] | None  # the previous request's messages, as dumped (None:
    # a raw completion, which no chat call continues)
    tools: list[dict[str, Any]] | None
    prompt_ids: array[int]
    completion_ids: array[int]


def token_array(ids: Iterable[int]) -> array[int]:
    return array("i", ids)


@dataclass(frozen=True)
class RenderedPrompt:
    prompt_ids: array[int]  # a C array, as PreviousTurn's: held for the call's whole life
    extends_previous: bool


@dataclass(frozen=True)
class ParsedCompletion:
    message: AssistantMessage
    has_tool_calls: bool


# The token that opens a tool call in each format's completions: a stream holds back the text
# from it on, since what follows is a call, not content. Formats without one (Llama 3 writes a
# bare JSON object) are held back whole while tools are offered (`holds_content_for_tools`).
_TOOL_CALL_OPENERS: Final[dict[str, str]] = {
    "qwen3": "<tool_call>",
    "qwen3-vl": "<tool_call>",
    "prime-qwen3": "<tool_call>",
    "glm-4.5": "<tool_call>",
    "glm-5": "<tool_call>",
    "deepseek-r1": "<\uff5ctool\u2581calls\u2581begin\uff5c>",
    "deepseek-v3": "<\uff5ctool\u2581calls\u2581begin\uff5c>",
    "kimi-k2": "<|tool_calls_section_begin|>",
    "gemma4": "<|tool_call>",
    "default": "<tool_call>",
}


# DeepSeek-R1's template drops the reasoning of every earlier turn, so `renderers` never bridges
# it by default and each call of an agent's tool loop would be a re-render. Within one tool
# cycle the model's own tokens (its reasoning included) are kept instead, as Qwen3's renderer
# does; a new user message still re-renders as the template would.
_TOOL_CYCLE_RETENTION: Final = frozenset({"deepseek-r1"})


def _renderer_config(name: str, template: str | None) -> renderers.BaseRendererConfig:
    """The typed config of format `name`; the generic renderer gets the parsers its template's
    markers call for, so a Hermes-style template still yields tool calls and reasoning."""
    if name in _TOOL_CYCLE_RETENTION:
        return renderers.config_from_name(name).model_copy(  # type: ignore[union-attr]
            update={"thinking_retention": "tool_cycle"}
        )
    if name != GENERIC:
        config = renderers.config_from_name(name)
        assert config is not None  # only `auto` has none, and it is resolved before this
        return config
    template = template or ""
    return renderers.DefaultRendererConfig(
        tool_parser="qwen3" if "<tool_call>" in template else None,
        reasoning_parser="think" if "</think>" in template else None,
    )


class ChatRenderer:
    def __init__(self, model_dir: Path | str, renderer_name: str = "qwen3") -> None:
        hf = AutoTokenizer.from_pretrained(str(model_dir))
        self.format = renderer_name
        # Everything that tokenizes on the request path (the renderer included) uses the Rust
        # tokenizer directly: same ids, a fraction of transformers' cost (gateway/calls/tokenizer.py).
        # The generic renderer renders through the model's Jinja template, which only
        # transformers' tokenizer carries.
        self.tokenizer = fast_tokenizer(hf) if renderer_name != GENERIC else hf
        config = _renderer_config(renderer_name, getattr(hf, "chat_template", None))
        self._renderer = renderers.create_renderer(self.tokenizer, config)
        if not bridges_turns(renderer_name):
            log.warning(
                "chat format '%s' (the model's own template) cannot extend a previous call's "
                "tokens: every later turn of a session is re-rendered and counted as a split",
                renderer_name,
            )
        self.stop_token_ids: list[int] = list(self._renderer.get_stop_token_ids())
        # Added tokens (chat markers such as <tool_call>, </think>): text -> id.
        self.special_tokens: dict[str, int] = dict(hf.get_added_vocab())
        # The ids an answer's text leaves out (`skip_special_tokens`): they decode to nothing.
        self.silent_token_ids: frozenset[int] = frozenset(
            i
            for i in self.special_tokens.values()
            if not self.tokenizer.decode([i], skip_special_tokens=True)
        )
        opener = self.special_tokens.get(_TOOL_CALL_OPENERS.get(renderer_name, ""))
        self.tool_call_start_id: int | None = opener
        # A format whose calls begin with no marker token: its text cannot be streamed as
        # content while tools are offered, since it may turn out to be a call.
        self.holds_content_for_tools = opener is None

    def render_prompt(
        self,
        messages: list[ChatMessage],
        tools: list[ToolSpec] | None,
        previous: PreviousTurn | None,
    ) -> RenderedPrompt:
        spec = _tool_specs(tools)
        converted = _renderer_messages(messages)
        if previous is not None:
            start = _continuation(messages, tools, previous)
            if start is not None:
                bridged = self._renderer.bridge_to_next_turn(
                    previous.prompt_ids.tolist(),
                    previous.completion_ids.tolist(),
                    converted[start:],
                    tools=spec,
                )
                if bridged is not None:
                    return RenderedPrompt(token_array(bridged.token_ids), extends_previous=True)
        try:
            ids = self._renderer.render_ids(converted, tools=spec, add_generation_prompt=True)
        except ValueError as exc:
            # What the format cannot write (Llama 3: one tool call per assistant turn) is the
            # agent's request to change, not a fault of the gateway.
            raise bad_request(
                f"the '{self.format}' chat format cannot render these messages: {exc}",
                param="messages",
            ) from None
        return RenderedPrompt(token_array(ids), extends_previous=False)

    def parse_completion(
        self, completion_ids: list[int], prompt_ids: Sequence[int], tools: list[ToolSpec] | None
    ) -> ParsedCompletion:
        parsed = self._renderer.parse_response(
            list(completion_ids), tools=_tool_specs(tools), prompt_ids=list(prompt_ids)
        )
        calls = [
            ToolCall(
                id=tc.id or f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCall(
                    name=tc.name or "",
                    arguments=tc.arguments
                    if isinstance(tc.arguments, str)
                    else json.dumps(tc.arguments or {}),
                ),
            )
            for tc in parsed.tool_calls
            if tc.status == renderers.ToolCallParseStatus.OK and tc.name
        ]
        # The parser strips reasoning it saw closed, but gives reasoning cut short (no
        # </think>: a budget or stop string ended it) as it came; a stream cannot know which it
        # will be and sends it stripped (api/streaming.py). Stripped here too, the streamed
        # deltas concatenate to this answer (they lost its leading newline and, diverging,
        # the rest: found by property tests, issue 18). The tokens are recorded as sampled.
        reasoning = (parsed.reasoning_content or "").strip()
        # Leading whitespace is the format's separator after its reasoning block (GLM's "\n"),
        # which Qwen3's parser already drops and a stream never sends: dropped for every format.
        content = (parsed.content or "").lstrip()
        message = AssistantMessage(
            content=content or (None if calls else ""),
            reasoning_content=reasoning or None,
            tool_calls=calls or None,
        )
        return ParsedCompletion(message=message, has_tool_calls=bool(calls))

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _continuation(
    messages: list[ChatMessage], tools: list[ToolSpec] | None, previous: PreviousTurn
) -> int | None:
    """Where the messages after the previous call's reply start, or None if this is not its
    continuation."""
    if previous.messages is None:
        return None
    dumped_tools = None if tools is None else [t.model_dump(exclude_none=True) for t in tools]
    if dumped_tools != previous.tools:
        return None
    n = len(previous.messages)
    if len(messages) < n + 2 or messages[n].role != "assistant":
        return None
    if [m.model_dump(exclude_none=True) for m in messages[:n]] != previous.messages:
        return None
    return n + 1


def _tool_specs(tools: list[ToolSpec] | None) -> list[renderers.ToolSpec] | None:
    """Tools exactly as the agent sent them (OpenAI's {"type", "function"} shape).

    Chat templates paste each tool's JSON into the system prompt as given; real Qwen3 models
    were trained on, and vLLM's own chat endpoint renders, the OpenAI shape, so flattening it
    here would give the model a prompt it has never seen.
    """
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]  # type: ignore[misc]


def _renderer_messages(messages: list[ChatMessage]) -> list[renderers.Message]:
    """The messages as `renderers` takes them, each tool result named after the function of the
    call it answers when the client left `name` out (OpenAI clients do): formats that head a
    result with its tool's name (gpt-oss's `functions.<name>`, Kimi-K2's) read it from `name`
    and would otherwise write an unknown author, and `renderers` leaves filling it to us."""
    called: dict[str, str] = {}
    out = []
    for message in messages:
        for call in message.tool_calls or []:
            called[call.id] = call.function.name
        name = message.name
        if message.role == "tool" and name is None and message.tool_call_id is not None:
            name = called.get(message.tool_call_id)
        out.append(_to_renderer_message(message, name))
    return out


def _to_renderer_message(message: ChatMessage, tool_name: str | None) -> renderers.Message:
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "type": "function",
                "id": tc.id,
                "function": {
                    "name": tc.function.name,
                    "arguments": _arguments(tc.function.arguments),
                },
            }
            for tc in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if tool_name is not None and message.role == "tool":
        out["name"] = tool_name
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    return out  # type: ignore[return-value]


def _arguments(text: str) -> dict[str, Any] | str:
    # Templates render argument objects; keep the agent's string if it is not a JSON object.
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text
