"""Bounds on one call's work, each checked before the work it bounds.

Every call shares one event loop, so what one agent sends must not cost the gateway more than
a bounded amount of it. In the order a call meets them:

1. The body's size (api/body_limit.py, before it is read).
2. The lengths of the lists and maps an agent controls, on the parsed JSON before the schema
   validates it: validation costs time per element (a million one-letter messages took a
   second), and pydantic only counts a list's elements after validating every one of them.
3. What OpenAI itself refuses: `max_tokens` beyond the context, a `tool` message without a
   `tool_call_id` or answering no tool call made before it.
4. The prompt's characters against what the context can hold, before tokenizing (which costs
   about a microsecond a character and would be wasted on a prompt that cannot fit).
5. A prompt that passes but is large is rendered and tokenized off the event loop
   (`OFF_LOOP_CHARS`, pipeline.py).

These bounds are the request path's policy, not the schema's: records written before a bound
was tightened are validated against the schema again when a session continues after a restart,
and must stay readable.
"""

from __future__ import annotations

from typing import Any

import orjson

from lockgate.gateway.config import GatewayConfig, RequestLimits
from lockgate.gateway.errors import bad_request
from lockgate.gateway.schema import ChatCompletionRequest, ChatMessage, CompletionRequest

# OpenAI's limits.
MAX_STOPS = 4
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# The stop scanner decodes up to 4 tokens per character of the longest stop string for every
# token generated (stops.py): this keeps that window at about a thousand tokens.
MAX_STOP_CHARS = 256
# Prompts with more characters than this are rendered and tokenized in a worker thread: below
# it a render holds the loop for well under a millisecond per kilobyte, a few ms at most.
OFF_LOOP_CHARS = 64 * 1024


def check_chat_body(raw: dict[str, Any], limits: RequestLimits) -> None:
    """The lengths of a chat body's lists, before the schema validates their elements."""
    messages = raw.get("messages")
    if isinstance(messages, list):
        _at_most(len(messages), limits.max_messages, "messages", "messages")
        items = sum(
            _length(m.get("content")) + _length(m.get("tool_calls"))
            for m in messages
            if isinstance(m, dict)
        )
        _at_most(items, limits.max_messages, "messages", "content parts and tool calls in all")
    tools = raw.get("tools")
    if isinstance(tools, list):
        _at_most(len(tools), limits.max_tools, "tools", "tools")
    _check_stop(raw.get("stop"))
    _check_metadata(raw.get("metadata"))


def check_completion_body(raw: dict[str, Any], config: GatewayConfig) -> None:
    """The same for `/v1/completions`: its stop strings and a token-id prompt's length."""
    prompt = raw.get("prompt")
    if isinstance(prompt, list):
        _too_long_for_context(len(prompt), config.max_model_len, "prompt")
    _check_stop(raw.get("stop"))


def check_chat_request(req: ChatCompletionRequest, max_model_len: int) -> None:
    """What OpenAI refuses in a validated chat request and the schema does not catch."""
    check_token_budget(req, max_model_len)
    _check_tool_messages(req.messages)


def check_token_budget(req: ChatCompletionRequest | CompletionRequest, max_model_len: int) -> None:
    """A completion budget the context cannot hold beside even a one-token prompt is a 400.

    A budget that fits the context but not beside this prompt is cut to the room left
    (pipeline.py), as before: the call then ends with `finish_reason: "length"`.
    """
    budgets = {"max_tokens": req.max_tokens}
    if isinstance(req, ChatCompletionRequest):
        budgets["max_completion_tokens"] = req.max_completion_tokens
    for param, budget in budgets.items():
        if budget is not None and budget >= max_model_len:
            raise bad_request(
                f"{param} is {budget}; this model's context is {max_model_len} tokens, prompt "
                f"and completion together",
                param=param,
            )


def chat_prompt_chars(req: ChatCompletionRequest, raw: dict[str, Any]) -> int:
    """The characters a chat call's messages and tools put into its prompt (the chat
    template's own markers left out: this is a lower bound)."""
    chars = sum(_message_chars(m) for m in req.messages)
    if req.tools:
        chars += len(orjson.dumps(raw["tools"]))  # templates paste each tool's JSON as sent
    return chars


def check_prompt_chars(chars: int, config: GatewayConfig, param: str) -> None:
    """A prompt with clearly more characters than the context holds, refused untokenized."""
    per_token = config.limits.max_prompt_chars_per_token
    bound = int(config.max_model_len * per_token)
    if chars > bound:
        raise bad_request(
            f"the prompt has {chars} characters; this model's context is "
            f"{config.max_model_len} tokens, which hold at most about {bound} characters "
            f"({per_token:g} a token)",
            param=param,
            code="context_length_exceeded",
        )


def _too_long_for_context(tokens: int, max_model_len: int, param: str) -> None:
    if tokens >= max_model_len:
        raise bad_request(
            f"the prompt is {tokens} tokens; this model's context is {max_model_len} tokens",
            param=param,
            code="context_length_exceeded",
        )


def _message_chars(m: ChatMessage) -> int:
    if m.content is None:
        chars = 0
    elif isinstance(m.content, str):
        chars = len(m.content)
    else:
        chars = sum(len(part.text) for part in m.content)
    for text in (m.reasoning_content, m.name, m.tool_call_id):
        chars += len(text or "")
    for call in m.tool_calls or ():
        chars += len(call.id) + len(call.function.name) + len(call.function.arguments)
    return chars


def _check_tool_messages(messages: list[ChatMessage]) -> None:
    """Each `tool` message answers, by its `tool_call_id`, a call an earlier assistant message
    made (OpenAI's rule; a template given an unanswerable tool result renders nonsense)."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            called.update(call.id for call in m.tool_calls or ())
        elif m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(
                    f"messages.{i}: a message with role 'tool' needs the 'tool_call_id' of the "
                    f"tool call it answers",
                    param="messages",
                )
            if m.tool_call_id not in called:
                raise bad_request(
                    f"messages.{i}: tool_call_id {m.tool_call_id[:64]!r} answers no tool call "
                    f"of an earlier assistant message",
                    param="messages",
                )


def _check_stop(stop: Any) -> None:
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    _at_most(len(stops), MAX_STOPS, "stop", "stop sequences")
    for s in stops:
        if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
            raise bad_request(
                f"stop: a stop sequence has {len(s)} characters; at most {MAX_STOP_CHARS}",
                param="stop",
            )


def _check_metadata(metadata: Any) -> None:
    if not isinstance(metadata, dict):
        return
    _at_most(len(metadata), MAX_METADATA_KEYS, "metadata", "keys")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or (
            isinstance(value, str) and len(value) > MAX_METADATA_VALUE_CHARS
        ):
            raise bad_request(
                f"metadata: keys take at most {MAX_METADATA_KEY_CHARS} characters and values "
                f"at most {MAX_METADATA_VALUE_CHARS}",
                param="metadata",
            )


def _at_most(count: int, limit: int, param: str, what: str) -> None:
    if count > limit:
        raise bad_request(f"{param}: at most {limit} {what}, got {count}", param=param)


def _length(value: Any) -> int:
    return len(value) if isinstance(value, list) else 0
