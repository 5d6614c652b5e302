"""Anthropic's Messages API (`POST /v1/messages`), translated to and from a chat-completions body.

A request becomes one chat body for the call pipeline: `system` the first message, then each
Anthropic message in order. A user message's `tool_result` blocks become `tool` messages (an
error result's text marked as one, since chat has no flag for it) and its text blocks a user
message; an assistant message's `thinking` blocks become its `reasoning_content`, its text its
content and its `tool_use` blocks its `tool_calls`, each under the id the block carries. So a
history the agent echoes back translates to the same chat messages every time, and the call
continues the previous call's exact tokens as a chat call does.

The answer becomes a `message`: a thinking block, a text block, then a `tool_use` block per
call, whose id is the chat tool call's (`toolu_` where the renderer made the id up), so the next
turn's `tool_result.tool_use_id` names the call the record holds. Text blocks of one message
are joined by a newline, as their text would read.

What the gateway cannot honour (images, documents, server tools, `top_k`, thinking settings,
containers, MCP servers, citations, a final assistant message to continue) is a 400 naming the
field, never ignored. `cache_control` (on the request, its blocks and tools) is accepted and
has no effect: a session's calls go to one replica, whose prefix cache already keeps what the
previous call computed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lockgate.gateway.config import RequestLimits
from lockgate.gateway.errors import GatewayError, bad_request
from lockgate.gateway.schema import AssistantMessage, ToolCall

# Fields of the Messages API the gateway cannot honour, and why (null is accepted). Anything
# else unknown is refused as an unsupported parameter.
_REFUSED = {
    "top_k": "top_k is not supported: the run's sampling policy sets temperature and top_p only",
    "thinking": "thinking settings are not supported: the model's chat format decides",
    "container": "containers are not supported: the agent runs its own tools",
    "mcp_servers": "MCP servers are not supported: the agent runs its own tools",
    "service_tier": "service tiers are not supported",
    "context_management": "context management is not supported",
    "output_format": "structured output formats are not supported",
    "output_config": "output settings are not supported",
    "inference_geo": "inference_geo is not supported",
}

ERROR_PREFIX = "Error: "  # what a tool_result with is_error: true reads as in the chat message
_MADE_UP_CALL_ID = re.compile(r"call_([0-9a-f]{24})")  # what calls/rendering.py invents


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cache_control: dict[str, Any] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: None = None  # citations are Anthropic's document feature: refused


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


_USER_BLOCKS: dict[str, type[_Block]] = {"text": TextBlock, "tool_result": ToolResultBlock}
_ASSISTANT_BLOCKS: dict[str, type[_Block]] = {
    "text": TextBlock,
    "thinking": ThinkingBlock,
    "tool_use": ToolUseBlock,
}


class Tool(BaseModel):
    """A custom tool: the agent runs it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """A Messages API request (or a count_tokens one: no `max_tokens`) as the gateway serves it."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    system: str | list[TextBlock] | None = None
    metadata: Metadata | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: dict[str, Any] | None = None  # accepted, no effect (the module says why)


def read_request(raw: dict[str, Any], limits: RequestLimits, counting: bool) -> MessagesRequest:
    """The request validated, each refusal a 400 naming its field; list lengths are bounded
    before validation, which costs time per element. `counting`: a count_tokens body, which
    has no `max_tokens`."""
    for field, why in _REFUSED.items():
        if raw.get(field) is not None:
            raise bad_request(f"{field}: {why}", param=field)
    _refuse_server_tools(raw.get("tools"))
    _bound(raw, limits)
    try:
        req = MessagesRequest.model_validate(raw)
    except ValidationError as exc:
        raise invalid(exc) from exc
    if counting and req.stream:
        raise bad_request("stream: token counts are not streamed", param="stream")
    if not counting and req.max_tokens is None:
        raise bad_request("max_tokens: Field required", param="max_tokens")
    return req


def _bound(raw: dict[str, Any], limits: RequestLimits) -> None:
    messages, tools = raw.get("messages"), raw.get("tools")
    blocks = 0
    if isinstance(messages, list):
        blocks = sum(
            len(m["content"])
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), list)
        )
    for field, n, limit in (
        ("messages", len(messages) if isinstance(messages, list) else 0, limits.max_messages),
        ("messages", blocks, limits.max_messages),
        ("tools", len(tools) if isinstance(tools, list) else 0, limits.max_tools),
    ):
        if n > limit:
            raise bad_request(f"{field}: at most {limit} items, got {n}", param=field)


def invalid(exc: ValidationError, prefix: str = "") -> GatewayError:
    """A validation failure as a 400 naming the first offending field (under `prefix`)."""
    first = exc.errors()[0]
    where = ".".join(
        [prefix, *(str(p) for p in first["loc"])] if prefix else map(str, first["loc"])
    )
    if first["type"] == "extra_forbidden":
        return bad_request(f"unsupported parameter '{where}'", param=where)
    if where.endswith("citations"):
        return bad_request(f"{where}: citations are not supported", param=where)
    return bad_request(f"{where}: {first['msg']}", param=where or None)


def _refuse_server_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise bad_request(
                f"tools.{i}.type: server tool {kind!r} is not supported: only custom tools "
                "(name, description, input_schema), which the agent runs itself",
                param=f"tools.{i}.type",
            )


# ---------------------------------------------------------------------------------------------
# Request -> chat body


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat-completions body of a Messages request."""
    if req.messages[-1].role == "assistant":
        raise bad_request(
            f"messages.{len(req.messages) - 1}.role: a final assistant message (a prefill to "
            "continue) is not supported: end with a user message",
            param=f"messages.{len(req.messages) - 1}.role",
        )
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _joined(req.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        messages += _chat_messages(message, f"messages.{i}")
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    if req.tools:
        body["tools"] = [_chat_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        body.update(_chat_tool_choice(req.tool_choice))
    same = {
        "model": req.model,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": req.stop_sequences or None,
        "user": req.metadata.user_id if req.metadata else None,
    }
    body.update({k: v for k, v in same.items() if v is not None})
    return body


def _chat_tool(tool: Tool) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        spec["description"] = tool.description
    return {"type": "function", "function": spec}


def _chat_tool_choice(choice: ToolChoice) -> dict[str, Any]:
    """`auto` -> auto, `any` -> required, `tool` -> that function, `none` -> none."""
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice.name: required with type 'tool'", param="tool_choice")
        out: dict[str, Any] = {
            "tool_choice": {"type": "function", "function": {"name": choice.name}}
        }
    else:
        if choice.name is not None:
            raise bad_request(
                f"tool_choice.name: only with type 'tool', not {choice.type!r}",
                param="tool_choice.name",
            )
        out = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[choice.type]}
    if choice.disable_parallel_tool_use is not None:
        out["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return out


def _chat_messages(message: Message, where: str) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    kinds = _USER_BLOCKS if message.role == "user" else _ASSISTANT_BLOCKS
    blocks = [_block(b, kinds, f"{where}.content.{j}") for j, b in enumerate(message.content)]
    if message.role == "assistant":
        return [_assistant(blocks)]
    out: list[dict[str, Any]] = []
    texts: list[TextBlock] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block)
            continue
        assert isinstance(block, ToolResultBlock)
        if texts:
            out.append({"role": "user", "content": _joined(texts)})
            texts = []
        result = _result(block, f"{where}.content.{j}.content")
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
    if texts or not out:
        out.append({"role": "user", "content": _joined(texts)})
    return out


def _block(value: Any, kinds: dict[str, type[_Block]], where: str) -> _Block:
    kind = value.get("type") if isinstance(value, dict) else None
    model = kinds.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise bad_request(
            f"{where}.type: {kind!r} blocks are not supported here (only "
            f"{', '.join(kinds)}: no images, documents or server tool blocks)",
            param=f"{where}.type",
        )
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise invalid(exc, where) from exc


def _assistant(blocks: list[_Block]) -> dict[str, Any]:
    texts = [b for b in blocks if isinstance(b, TextBlock)]
    thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input)},
        }
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    out: dict[str, Any] = {"role": "assistant", "content": _joined(texts) if texts else None}
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    if calls:
        out["tool_calls"] = calls
    elif out["content"] is None:
        out["content"] = ""
    return out


def _result(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = [
            _block(part, {"text": TextBlock}, f"{where}.{j}") for j, part in enumerate(content)
        ]
        text = _joined([p for p in parts if isinstance(p, TextBlock)])
    return ERROR_PREFIX + text if block.is_error else text


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


# ---------------------------------------------------------------------------------------------
# Answer -> message


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def tool_use_id(call_id: str) -> str:
    """A tool_use block's id for a chat tool call's: Anthropic's prefix on an id the renderer
    made up, the model's own id as it is."""
    made_up = _MADE_UP_CALL_ID.fullmatch(call_id)
    return f"toolu_{made_up.group(1)}" if made_up else call_id


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": tool_use_id(call.id),
        "name": call.function.name,
        "input": tool_input(call.function.arguments),
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the object a tool_use block holds; arguments that are not a
    JSON object (the model wrote something else) are kept whole under `arguments`."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def thinking_block(text: str) -> dict[str, Any]:
    # No signature: the gateway's reasoning is the model's own text, with nothing to verify.
    return {"type": "thinking", "thinking": text, "signature": ""}


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def content_blocks(message: AssistantMessage) -> list[dict[str, Any]]:
    """The answer's blocks in the order the model writes them: thinking, text, tool calls."""
    blocks = []
    if message.reasoning_content:
        blocks.append(thinking_block(message.reasoning_content))
    if message.content:
        blocks.append(text_block(message.content))
    blocks += [tool_use_block(tc) for tc in message.tool_calls or []]
    return blocks


def matched_stop(text: str, stops: list[str] | None) -> str | None:
    """The stop sequence that ended `text` (the completion's text, stop included), if any:
    of those in it, the one that begins first."""
    found = [(text.find(s), s) for s in stops or [] if s and s in text]
    return min(found)[1] if found else None


def stop_reason(finish: str, has_tool_calls: bool, stop_sequence: str | None) -> StopReason:
    if finish == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if has_tool_calls else "end_turn"


def message_response(
    message_id: str,
    model: str,
    message: AssistantMessage,
    stop: tuple[StopReason, str | None],
    usage: tuple[int, int],
) -> dict[str, Any]:
    """The `message` object of an answer; `stop`: (stop_reason, stop_sequence), `usage`:
    (input tokens, output tokens)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(message),
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
    }


# ---------------------------------------------------------------------------------------------
# Errors


_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}
