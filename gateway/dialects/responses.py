"""OpenAI's Responses API (`POST /v1/responses`), translated to and from a chat-completions body.

A request becomes one chat body for the call pipeline: `instructions` the first message (a
system message named `instructions`, which renders like any system message and marks what a
continuation by `previous_response_id` leaves out, as OpenAI does), then the history a
`previous_response_id` names, then the `input` items. An assistant turn is rebuilt from the
items that make it (a `reasoning` item, an assistant `message`, its `function_call`s, in the
order the model wrote them), so a history the agent echoes back, or one rebuilt from the
previous call's record, continues the previous call's exact tokens. The answer becomes a
`response` object: a reasoning item, a message with one `output_text` part, function calls.

Responses are not stored apart: each is its call's record (the translated chat body, prompt
and completion ids), and its id names it: `resp_<session tag>_<call index>`, the tag a digest
of the session id (an id an agent logs or traces must not carry its session's id, which is a
capability on the session-path routes). A `previous_response_id` is resolved against the
record of that call in the caller's own session; an id of another session, one never
answered, or one of a call made with `store: false` cannot be continued (404).

Two extensions, which vLLM's own Responses server also takes: `stop` strings (watched as for
chat) and `seed`. Anything this API offers that the gateway cannot honour (built-in tools,
background responses, images and files, structured output formats, automatic truncation,
includes) is a 400 naming the field, never ignored.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lockgate.gateway.errors import GatewayError, bad_request, not_found
from lockgate.gateway.schema import AssistantMessage, ToolCall

INSTRUCTIONS = "instructions"  # the name of the system message `instructions` became

# Fields of OpenAI's Responses API that the gateway cannot honour, and why (null or their
# harmless default is accepted). Anything else unknown is refused as an unsupported parameter.
_REFUSED = {
    "background": "background responses are not supported: the call is answered as it runs",
    "conversation": "conversations are not stored: send the items or a previous_response_id",
    "prompt": "stored prompt templates are not supported: send instructions and input",
    "reasoning": "reasoning settings are not supported: the model's chat format decides",
    "top_logprobs": "logprobs are not served by the Responses API here: use chat completions",
    "max_tool_calls": "max_tool_calls is not supported",
    "service_tier": "service tiers are not supported",
    "prompt_cache_key": "prompt cache keys are not supported: sessions are routed sticky",
    "prompt_cache_retention": "prompt cache retention is not supported",
    "safety_identifier": "safety_identifier is not supported: use user",
    "stream_options": "stream_options are not supported",
    "context_management": "context management is not supported",
}
_HARMLESS = {"background": False}

_MADE_UP_CALL_ID = re.compile(r"call_[0-9a-f]{24}")  # what calls/rendering.py invents

# An assistant turn's items, in the order the model writes them: reasoning, text, calls.
_STAGE = {"reasoning": 0, "message": 1, "function_call": 2}


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    """`{"type": "function", "name": ...}`: this function must be called."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """A Responses API request, as far as the gateway serves it (unknown fields: a 400)."""

    model_config = ConfigDict(extra="forbid")
    input: str | list[dict[str, Any]] | None = None
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    text: TextConfig | None = None
    include: list[str] | None = Field(default=None, max_length=0)
    # Extensions, as vLLM's own Responses server takes them: chat's `stop` and `seed`.
    stop: str | list[str] | None = None
    seed: int | None = None


def read_request(raw: dict[str, Any], max_items: int, max_tools: int) -> ResponsesRequest:
    """The request validated, each refusal a 400 naming its field; the list lengths are
    bounded before validation, which costs time per element."""
    for field, why in _REFUSED.items():
        value = raw.get(field)
        if value is not None and value != _HARMLESS.get(field, None):
            raise bad_request(f"{field}: {why}", param=field)
    _refuse_built_in_tools(raw.get("tools"))
    for field, limit in (("input", max_items), ("tools", max_tools)):
        value = raw.get(field)
        if isinstance(value, list) and len(value) > limit:
            raise bad_request(f"{field}: at most {limit} items, got {len(value)}", param=field)
    try:
        return ResponsesRequest.model_validate({k: v for k, v in raw.items() if k not in _REFUSED})
    except ValidationError as exc:
        raise _invalid(exc) from exc


def _invalid(exc: ValidationError) -> GatewayError:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return bad_request(f"unsupported parameter '{where}'", param=where)
    if where.startswith("include"):
        return bad_request("include: no extra output data can be included", param="include")
    if where.startswith("tool_choice"):
        return bad_request(
            "tool_choice: 'auto', 'none', 'required' or {'type': 'function', 'name': ...} (no "
            "built-in tools)",
            param="tool_choice",
        )
    return bad_request(f"{where}: {first['msg']}", param=where or None)


def _refuse_built_in_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(
                f"tools[{i}]: tool type {kind!r} is not supported: only function tools, which "
                "the agent runs itself",
                param=f"tools[{i}].type",
            )


# ---------------------------------------------------------------------------------------------
# Request -> chat body


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body of a Responses request; `history`: the chat messages a
    `previous_response_id` continues (`continued_history`), empty without one."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions, "name": INSTRUCTIONS})
    messages += history
    items: list[Any] = (
        [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input or []
    )
    called = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    messages += input_messages(items, called)
    if not messages or (not items and not history):
        raise bad_request("input: the request has no input", param="input")
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    if req.tools:
        body["tools"] = [_chat_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = (
            req.tool_choice
            if isinstance(req.tool_choice, str)
            else {"type": "function", "function": {"name": req.tool_choice.name}}
        )
    same = {
        "model": req.model,
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "store": req.store,
        "metadata": req.metadata,
        "user": req.user,
        "stop": req.stop,
        "seed": req.seed,
    }
    body.update({k: v for k, v in same.items() if v is not None})
    return body


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    spec = tool.model_dump(exclude_none=True, exclude={"type"})
    return {"type": "function", "function": spec}


def input_messages(items: list[Any], called: set[str] | None = None) -> list[dict[str, Any]]:
    """Input items as chat messages: each assistant turn's reasoning, text and function calls
    joined into one assistant message, each function call output a `tool` message, which must
    answer a call made before it (in `called`, the history's, or in the items)."""
    turns = _Turns()
    called = set(called or ())
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: an input item is a JSON object", param=where)
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") != "assistant":
            _fields(item, where, {"type", "role", "content", "id", "status"})
            role = item.get("role")
            if role not in ("user", "system", "developer"):
                raise bad_request(f"{where}.role: {role!r} is not a role", param=f"{where}.role")
            turns.add({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind in _STAGE:
            part = _assistant_part(kind, item, where)
            if kind == "function_call":
                called.add(part["id"])
            turns.assistant(kind, part)
        elif kind == "function_call_output":
            _fields(item, where, {"type", "call_id", "output", "id", "status"})
            output = _text(item.get("output"), f"{where}.output")
            call_id = _str(item, "call_id", where)
            if call_id not in called:
                raise bad_request(
                    f"{where}.call_id: {call_id[:64]!r} answers no function call before it",
                    param=f"{where}.call_id",
                )
            turns.add({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise bad_request(
                f"{where}.type: input items of type {kind!r} are not supported (messages, "
                "function calls and their outputs, reasoning)",
                param=f"{where}.type",
            )
    return turns.done()


class _Turns:
    """Chat messages being built, with the assistant turn not yet closed."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.turn: dict[str, Any] | None = None
        self.stage = -1

    def add(self, message: dict[str, Any]) -> None:
        self._close()
        self.messages.append(message)

    def assistant(self, kind: str, part: dict[str, Any]) -> None:
        stage = _STAGE[kind]
        # A part the model writes before one already in the turn begins the next turn.
        if self.turn is None or stage < self.stage or (stage == self.stage and stage < 2):
            self._close()
            self.turn = {"role": "assistant", "content": None}
        self.stage = stage
        if kind == "function_call":
            self.turn.setdefault("tool_calls", []).append(part)
        else:
            self.turn.update(part)

    def _close(self) -> None:
        if self.turn is not None:
            self.messages.append(self.turn)
        self.turn, self.stage = None, -1

    def done(self) -> list[dict[str, Any]]:
        self._close()
        return self.messages


def _assistant_part(kind: str, item: dict[str, Any], where: str) -> dict[str, Any]:
    if kind == "message":
        _fields(item, where, {"type", "role", "content", "id", "status", "phase"})
        return {"content": _text(item.get("content"), f"{where}.content")}
    if kind == "reasoning":
        _fields(item, where, {"type", "id", "summary", "content", "encrypted_content", "status"})
        if item.get("encrypted_content") is not None:
            raise bad_request(
                f"{where}.encrypted_content: encrypted reasoning is not supported",
                param=f"{where}.encrypted_content",
            )
        parts = item.get("content") or item.get("summary") or []
        return {"reasoning_content": _text(parts, f"{where}.content", "\n\n")}
    _fields(item, where, {"type", "call_id", "name", "arguments", "id", "status"})
    return {
        "id": _str(item, "call_id", where),
        "type": "function",
        "function": {
            "name": _str(item, "name", where),
            "arguments": _str(item, "arguments", where),
        },
    }


_TEXT_PARTS = ("input_text", "output_text", "reasoning_text", "summary_text")


def _text(content: Any, where: str, joiner: str = "") -> str:
    """A content given as a string or as text parts, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}[{j}]: content parts of type {kind!r} are not supported: text only "
                "(no images, files or audio)",
                param=f"{where}[{j}].type",
            )
        texts.append(part["text"])
    return joiner.join(texts)


def _fields(item: dict[str, Any], where: str, allowed: set[str]) -> None:
    for key in item:
        if key not in allowed:
            raise bad_request(f"unsupported parameter '{where}.{key}'", param=f"{where}.{key}")


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: a string is required", param=f"{where}.{key}")
    return value


# ---------------------------------------------------------------------------------------------
# Response ids and continuation


def session_tag(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()[:20]


def response_id(session_id: str, index: int) -> str:
    return f"resp_{session_tag(session_id)}_{index}"


def previous_index(previous_response_id: str, session_id: str) -> int:
    """The call index a `previous_response_id` names in this session (a 404 otherwise)."""
    tag, _, index = previous_response_id.removeprefix("resp_").rpartition("_")
    if (
        not previous_response_id.startswith("resp_")
        or tag != session_tag(session_id)
        or not index.isdigit()
    ):
        raise _no_response(previous_response_id)
    return int(index)


def check_continuable(
    previous_response_id: str, chat: dict[str, Any] | None, finish_reason: str | None
) -> None:
    """A recorded call can be continued by id if it was a chat call that finished and was
    stored (`store` not false); `chat`: its recorded request, None if there is no record."""
    if chat is None or "messages" not in chat or finish_reason in (None, "interrupted"):
        raise _no_response(previous_response_id)
    if chat.get("store") is False:
        raise not_found(
            f"response '{previous_response_id[:64]}' was created with store: false and "
            "cannot be continued by id: send its items as input instead"
        )


def _no_response(previous_response_id: str) -> GatewayError:
    err = not_found(f"no response '{previous_response_id[:64]}' in this session")
    err.param = "previous_response_id"
    return err


def continued_history(
    chat: dict[str, Any], message: AssistantMessage, previous_response_id: str
) -> list[dict[str, Any]]:
    """The chat messages a continuation starts from: the previous call's (its instructions
    left out, as OpenAI does), then its answer, rebuilt exactly as an agent echoing its output
    items would send it."""
    messages = list(chat["messages"])
    if messages and messages[0].get("role") == "system" and messages[0].get("name") == INSTRUCTIONS:
        messages = messages[1:]
    return messages + input_messages(output_items(message, previous_response_id, "completed"))


# ---------------------------------------------------------------------------------------------
# Answer -> response


def stable_call_ids(message: AssistantMessage, rid: str) -> AssistantMessage:
    """The message with the tool call ids the renderer made up (formats whose calls carry no
    id) replaced by ids derived from the response: a response rebuilt from its record later
    then names the same calls its function call outputs answer."""
    if not message.tool_calls:
        return message
    suffix = rid.removeprefix("resp_")
    calls = [
        c.model_copy(update={"id": f"call_{suffix}_{i}"}) if _MADE_UP_CALL_ID.fullmatch(c.id) else c
        for i, c in enumerate(message.tool_calls)
    ]
    return message.model_copy(update={"tool_calls": calls})


def output_items(message: AssistantMessage, rid: str, status: str) -> list[dict[str, Any]]:
    """The output items of an answer: reasoning, the message (unless the answer is only
    function calls), each function call."""
    suffix = rid.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        items.append(reasoning_item(f"rs_{suffix}", message.reasoning_content, "completed"))
    if message.content or not message.tool_calls:
        items.append(message_item(f"msg_{suffix}", message.content or "", status))
    items += [
        function_call_item(f"fc_{suffix}_{i}", call, "completed")
        for i, call in enumerate(message.tool_calls or ())
    ]
    return items


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [output_text(text)],
    }


def function_call_item(
    item_id: str, call: ToolCall, status: str, arguments: str | None = None
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.function.name,
        "arguments": call.function.arguments if arguments is None else arguments,
        "status": status,
    }


def response_shell(
    req: ResponsesRequest, rid: str, created_at: int, model: str, sampling: dict[str, Any]
) -> dict[str, Any]:
    """The response object before any output: what `response.created` carries."""
    choice = req.tool_choice or "auto"
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "store": req.store is not False,
        "temperature": sampling.get("temperature"),
        "top_p": sampling.get("top_p"),
        "text": {"format": {"type": "text"}},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [t.model_dump() for t in req.tools or ()],
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
    }


def finished_response(
    shell: dict[str, Any],
    message: AssistantMessage,
    finish_reason: str,
    usage: tuple[int, int, int],
    completed_at: int,
) -> dict[str, Any]:
    """The finished response: `usage` is (input, output, reasoning) tokens. An answer cut by
    its token budget is `incomplete`, as OpenAI's is."""
    cut = finish_reason == "length"
    n_in, n_out, n_reasoning = usage
    return {
        **shell,
        "status": "incomplete" if cut else "completed",
        "completed_at": None if cut else completed_at,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output_items(message, shell["id"], "incomplete" if cut else "completed"),
        "usage": {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": n_reasoning},
            "total_tokens": n_in + n_out,
        },
    }
