"""Hypothesis strategies for chat conversations an agent could really send (issue 18).

Schema-driven generation (tests/gateway_openapi.py) mostly makes bodies the gateway refuses
early (a tool message answering no call, a prompt over the context): right for the refusals,
but it seldom reaches the renderer, the parser or the store. These make well-formed
conversations (roles in a plausible order, tool calls answered by tool messages, tools offered
and chosen) with hostile text in them: multi-byte characters, the chat format's own markers.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# The chat format's markers among ordinary text: a template must not be confused by them.
_MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_end|>", "<|im_start|>"]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}},
]


def texts(max_size: int = 40) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.text(max_size=12),
        st.sampled_from(["hello", " ", "\n", "é", "🎉", "日本", "{", '"', *_MARKERS]),
    )
    return st.lists(piece, max_size=max_size // 8).map("".join)


@st.composite
def tool_calls(draw: st.DrawFn, prefix: str) -> list[dict[str, Any]]:
    count = draw(st.integers(min_value=1, max_value=2))
    out = []
    for i in range(count):
        name = draw(st.sampled_from([t["function"]["name"] for t in TOOLS]))
        arguments = draw(
            st.one_of(
                st.fixed_dictionaries({"a": st.integers(), "b": st.integers()}).map(json.dumps),
                st.just("{}"),
                texts(12),  # not JSON: the template gets the agent's string as is
            )
        )
        out.append(
            {
                "id": f"call_{prefix}_{i}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return out


@st.composite
def conversations(draw: st.DrawFn, with_tools: bool = True) -> list[dict[str, Any]]:
    """system? (user (assistant [tool...])*)+, ending with a user or tool message."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        role = draw(st.sampled_from(["system", "developer"]))
        messages.append({"role": role, "content": draw(texts())})
    turns = draw(st.integers(min_value=1, max_value=3))
    for turn in range(turns):
        content: Any = draw(texts())
        if draw(st.integers(min_value=0, max_value=4)) == 0:
            content = [
                {"type": "text", "text": part} for part in draw(st.lists(texts(), max_size=3))
            ]
        messages.append({"role": "user", "content": content})
        if turn == turns - 1 and draw(st.booleans()):
            break
        assistant: dict[str, Any] = {"role": "assistant", "content": draw(texts())}
        if draw(st.booleans()):
            assistant["reasoning_content"] = draw(texts())
        calls = draw(tool_calls(str(turn))) if with_tools and draw(st.booleans()) else []
        if calls:
            assistant["tool_calls"] = calls
            if draw(st.booleans()):
                assistant["content"] = None
        messages.append(assistant)
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": draw(texts())})
        if calls and turn == turns - 1:
            break
        if not calls and turn == turns - 1:
            messages.append({"role": "user", "content": draw(texts())})
    return messages


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A chat request as an OpenAI client would send it, options included."""
    tools = draw(st.sampled_from([None, TOOLS[:1], TOOLS]))
    body: dict[str, Any] = {"model": "lockgate", "messages": draw(conversations())}
    if tools is not None:
        body["tools"] = tools
        choice = draw(
            st.sampled_from(
                ["auto", "none", "required", {"type": "function", "function": {"name": "add"}}]
            )
        )
        body["tool_choice"] = choice
    optional: dict[str, st.SearchStrategy[Any]] = {
        "stream": st.booleans(),
        "stop": st.one_of(texts(8), st.lists(texts(8), max_size=4)),
        "max_tokens": st.integers(min_value=1, max_value=64),
        "temperature": st.floats(min_value=0, max_value=2),
        "seed": st.integers(min_value=0, max_value=2**31),
        "logprobs": st.booleans(),
        "parallel_tool_calls": st.booleans(),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            body[key] = draw(strategy)
    if body.get("logprobs") and draw(st.booleans()):
        body["top_logprobs"] = draw(st.integers(min_value=0, max_value=20))
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


@st.composite
def completion_bodies(draw: st.DrawFn, vocab: int = 1024) -> dict[str, Any]:
    prompt = draw(
        st.one_of(
            texts().filter(bool),
            st.lists(st.integers(min_value=0, max_value=vocab - 1), min_size=1, max_size=40),
        )
    )
    body: dict[str, Any] = {"prompt": prompt}
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(min_value=1, max_value=64))
    if draw(st.booleans()):
        body["stop"] = draw(st.one_of(texts(8), st.lists(texts(8), max_size=4)))
    if draw(st.booleans()):
        body["logprobs"] = draw(st.integers(min_value=0, max_value=5))
    return body
