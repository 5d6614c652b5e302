"""Anthropic's Messages API: the pure translation (dialects/messages.py, messages_stream.py), then
the routes over a fake replica driven by the official `anthropic` SDK: answers, streams, token
counts and every refusal in Anthropic's error shape (the real-vLLM tests are
tests/vllm/test_anthropic_sdk.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message as SdkMessage
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter
from transformers import AutoTokenizer

from lockgate.gateway.config import RequestLimits
from lockgate.gateway.dialects.messages import (
    ERROR_PREFIX,
    chat_body,
    content_blocks,
    error_body,
    matched_stop,
    message_response,
    read_request,
    stop_reason,
    tool_use_id,
)
from lockgate.gateway.dialects.messages_stream import MessageEvents
from lockgate.gateway.errors import GatewayError
from lockgate.gateway.schema import AssistantMessage, ChatCompletionRequest, FunctionCall, ToolCall
from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica, serve_gateway

LIMITS = RequestLimits()
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


def _body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "lockgate",
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "Hi"}],
        **extra,
    }


def _chat(**extra: Any) -> dict[str, Any]:
    chat = chat_body(read_request(_body(**extra), LIMITS, counting=False))
    ChatCompletionRequest.model_validate(chat)  # what the pipeline validates it as
    return chat


def _refusal(body: dict[str, Any], counting: bool = False) -> GatewayError:
    with pytest.raises(GatewayError) as err:
        chat_body(read_request(body, LIMITS, counting))
    assert err.value.status_code == 400
    return err.value


# -- request -> chat body ----------------------------------------------------------------------


def test_system_blocks_and_messages_become_chat_messages_in_order() -> None:
    chat = _chat(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        temperature=0.5,
        top_p=0.9,
        stop_sequences=["END"],
        metadata={"user_id": "u1"},
        cache_control={"type": "ephemeral"},
    )
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
    ]
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"]) == (32, 0.5, 0.9)
    assert chat["stop"] == ["END"] and chat["user"] == "u1" and chat["stream"] is False


def test_a_tool_turn_becomes_an_assistant_call_and_tool_messages() -> None:
    chat = _chat(
        tools=[TOOL],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use the tool", "signature": ""},
                    {"type": "text", "text": "Checking.", "citations": None},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": "get_weather",
                        "input": {"city": "Rome"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no such city"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "And London?"},
                ],
            },
        ],
    )
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": TOOL["input_schema"],
            },
        }
    ]
    _, assistant, first, second, user = chat["messages"]
    assert assistant == {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "use the tool",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "toolu_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    }
    assert first == {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"}
    assert second == {
        "role": "tool",
        "tool_call_id": "toolu_2",
        "content": ERROR_PREFIX + "no such city",
    }
    assert user == {"role": "user", "content": "And London?"}


def test_the_same_history_translates_to_the_same_chat_messages() -> None:
    """What lets the next call bridge: the record holds the chat body, and the agent's echo of
    the history gives the same one again."""
    history = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_x", "name": "f", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]},
    ]
    one = _chat(messages=history)
    two = _chat(messages=json.loads(json.dumps(history)) + [])
    assert one == two
    assert one["messages"][1]["content"] is None and one["messages"][2]["content"] == ""


@pytest.mark.parametrize(
    ("choice", "chat"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        (
            {"type": "tool", "name": "get_weather"},
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        ),
        (
            {"type": "any", "disable_parallel_tool_use": True},
            {"tool_choice": "required", "parallel_tool_calls": False},
        ),
    ],
)
def test_tool_choice_maps_to_the_chat_one(choice: dict[str, Any], chat: dict[str, Any]) -> None:
    body = _chat(tools=[TOOL], tool_choice=choice)
    assert {k: body[k] for k in chat} == chat
    assert "parallel_tool_calls" in body or "parallel_tool_calls" not in chat


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_k": 5}, "top_k"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"container": "c1"}, "container"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"service_tier": "auto"}, "service_tier"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [{**TOOL, "strict": True}]}, "tools.0.strict"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"metadata": {"user_id": "u", "team": "t"}}, "metadata.team"),
        ({"temperature": 1.5}, "temperature"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}
                ]
            },
            "messages.0.content.0.citations",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                    {"role": "user", "content": "r"},
                ]
            },
            "messages.1.content.0.type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "image", "source": {}}],
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0.content.0.type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "prefill"},
                ]
            },
            "messages.1.role",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"max_tokens": None}, "max_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    extra: dict[str, Any], param: str
) -> None:
    err = _refusal(_body(**extra))
    assert err.param == param, err.message
    assert param.split(".")[-1] in err.message or param.split(".")[0] in err.message


def test_long_lists_are_refused_before_they_are_validated() -> None:
    limits = RequestLimits(max_messages=4, max_tools=1)
    with pytest.raises(GatewayError, match="messages: at most 4"):
        read_request(_body(messages=[{"role": "user", "content": "x"}] * 5), limits, False)
    with pytest.raises(GatewayError, match="tools: at most 1"):
        read_request(_body(tools=[TOOL, TOOL]), limits, False)


def test_a_count_needs_no_max_tokens_and_is_not_streamed() -> None:
    body = _body()
    del body["max_tokens"]
    assert read_request(body, LIMITS, counting=True).max_tokens is None
    assert _refusal({**body, "stream": True}, counting=True).param == "stream"


# -- answer -> message -------------------------------------------------------------------------


def _call(call_id: str, args: str) -> ToolCall:
    return ToolCall(id=call_id, function=FunctionCall(name="get_weather", arguments=args))


def test_an_answer_is_thinking_text_then_tool_use_blocks_the_sdk_parses() -> None:
    message = AssistantMessage(
        content="Checking.",
        reasoning_content="hmm",
        tool_calls=[_call("call_" + "a" * 24, '{"city": "Paris"}'), _call("functions.f:0", "[1]")],
    )
    body = message_response("msg_1", "m", message, ("tool_use", None), (10, 7))
    parsed = SdkMessage.model_validate(body)
    assert [b.type for b in parsed.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert body["content"][2] == {
        "type": "tool_use",
        "id": "toolu_" + "a" * 24,
        "name": "get_weather",
        "input": {"city": "Paris"},
    }
    # An id the model wrote is kept; arguments that are not an object are kept whole.
    assert body["content"][3]["id"] == "functions.f:0"
    assert body["content"][3]["input"] == {"arguments": [1]}
    assert parsed.usage.input_tokens == 10 and parsed.usage.output_tokens == 7
    assert tool_use_id("call_" + "b" * 24) == "toolu_" + "b" * 24


def test_empty_text_and_thinking_make_no_blocks() -> None:
    assert content_blocks(AssistantMessage(content="")) == []
    assert content_blocks(AssistantMessage(content=None, tool_calls=[_call("c", "{}")])) == [
        {"type": "tool_use", "id": "c", "name": "get_weather", "input": {}}
    ]


@pytest.mark.parametrize(
    ("finish", "calls", "sequence", "reason"),
    [
        ("stop", False, None, "end_turn"),
        ("stop", True, None, "tool_use"),
        ("length", True, None, "max_tokens"),
        ("stop", False, "END", "stop_sequence"),
    ],
)
def test_stop_reasons(finish: str, calls: bool, sequence: str | None, reason: str) -> None:
    assert stop_reason(finish, calls, sequence) == reason


def test_the_stop_sequence_found_is_the_one_that_begins_first() -> None:
    assert matched_stop("abc END", ["ND", "END", "zz"]) == "END"
    assert matched_stop("abc", ["END"]) is None
    assert matched_stop("abc", None) is None


def test_errors_have_anthropics_types() -> None:
    kinds = {
        s: error_body(s, "m")["error"]["type"]
        for s in (400, 401, 404, 409, 413, 429, 500, 502, 503)
    }
    assert kinds == {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        409: "invalid_request_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        502: "api_error",
        503: "overloaded_error",
    }
    assert error_body(400, "m") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "m"},
    }


# -- stream events -----------------------------------------------------------------------------


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        kind, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == "event: " + payload["type"]
        out.append(payload)
    return out


def test_stream_events_come_in_order_and_add_up_to_the_answer() -> None:
    message = AssistantMessage(
        content="Hello there",
        reasoning_content="think more",
        tool_calls=[_call("call_" + "c" * 24, '{"city": "Paris"}')],
    )
    events = MessageEvents("msg_1", "m", 10)
    raw = events.start()
    raw += events.delta("think", "")
    raw += events.delta(" more", "Hello")
    raw += events.delta("", " ")
    raw += events.finish(("", "there"), message, ("tool_use", None), 7)
    parsed = _events(raw)
    assert [e["type"] for e in parsed] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [e["index"] for e in parsed if e["type"] == "content_block_stop"] == [0, 1, 2]
    # The SDK's own accumulator (what `get_final_message` returns) rebuilds the plain answer.
    snapshot = None
    for event in parsed:
        if event["type"] != "ping":
            snapshot = accumulate_event(
                event=EVENTS.validate_python(event), current_snapshot=snapshot, json_bufs={}
            )
    assert snapshot is not None
    expected = message_response("msg_1", "m", message, ("tool_use", None), (10, 7))
    assert snapshot.model_dump(exclude_none=True) == SdkMessage.model_validate(expected).model_dump(
        exclude_none=True
    )


def test_a_failed_stream_ends_with_an_error_event() -> None:
    events = MessageEvents("msg_1", "m", 3)
    (event,) = _events(events.failed(503, "paused too long"))
    assert event == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "paused too long"},
    }


# -- the routes over a fake replica ------------------------------------------------------------


class _Gateway:
    def __init__(self, client: httpx.AsyncClient, replica: FakeReplica, app: Any) -> None:
        self.client, self.replica, self.app = client, replica, app

    async def session(self) -> dict[str, Any]:
        r = await self.client.post(
            "/admin/sessions", json={"task_id": "t"}, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert r.status_code == 201, r.text
        return r.json()

    async def calls(self, sid: str) -> list[dict[str, Any]]:
        r = await self.client.get(
            f"/admin/sessions/{sid}/calls", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        return r.json()["calls"]

    def sdk(self, api_key: str, base: str = "") -> anthropic.AsyncAnthropic:
        # This SDK speaks through httpx2, which has the same in-process ASGI transport.
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.app))
        return anthropic.AsyncAnthropic(
            base_url="http://gw" + base, api_key=api_key, http_client=http, max_retries=0
        )


@pytest.fixture
async def gw(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[_Gateway]:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "<think>\nweighing it\n</think>\n\nHello there END more"
    completion = tok.encode(text, add_special_tokens=False) + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    replica = FakeReplica(completion=completion)
    async with serve_gateway(
        tiny_model_dir,
        tmp_path,
        {REPLICA: replica},
        max_pause_wait_s=2.0,
        limits=RequestLimits(max_request_bytes=4096, max_calls_in_flight_per_session=1),
    ) as (client, app):
        yield _Gateway(client, replica, app)


async def test_streamed_and_plain_answers_of_the_same_tokens_are_the_same_message(
    gw: _Gateway,
) -> None:
    s = await gw.session()
    client = gw.sdk(s["api_key"])  # by key, sent as x-api-key
    plain = await client.messages.create(
        model="m", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
    )
    assert [b.type for b in plain.content] == ["thinking", "text"]
    assert plain.content[0].thinking == "weighing it"  # type: ignore[union-attr]
    assert plain.content[1].text == "Hello there END more"  # type: ignore[union-attr]
    assert plain.stop_reason == "end_turn" and plain.stop_sequence is None
    async with client.messages.stream(
        model="m", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Hello there END more"
    assert final.model_dump(exclude={"id"}) == plain.model_dump(exclude={"id"})
    calls = await gw.calls(s["session_id"])
    assert len(calls) == 2 and calls[0]["completion_ids"] == calls[1]["completion_ids"]
    assert plain.usage.input_tokens == len(calls[0]["prompt_ids"])
    assert plain.usage.output_tokens == len(calls[0]["completion_ids"])


async def test_a_stop_sequence_cuts_the_text_and_is_named(gw: _Gateway) -> None:
    s = await gw.session()
    client = gw.sdk("unused", s["base_url"].removesuffix("/v1"))  # by session path
    for stream in (False, True):
        kwargs: dict[str, Any] = {
            "model": "m",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "Hi"}],
            "stop_sequences": ["END"],
        }
        if stream:
            async with client.messages.stream(**kwargs) as events:
                out = await events.get_final_message()
        else:
            out = await client.messages.create(**kwargs)
        assert out.content[-1].text == "Hello there "  # type: ignore[union-attr]
        assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", "END")


async def test_a_token_count_is_the_prompt_a_call_sends(gw: _Gateway) -> None:
    s = await gw.session()
    client = gw.sdk(s["api_key"])
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [TOOL],
    }
    counted = await client.messages.count_tokens(**body)
    await client.messages.create(max_tokens=8, **body)
    (call,) = await gw.calls(s["session_id"])
    assert counted.input_tokens == len(call["prompt_ids"])


def _anthropic_error(resp: httpx.Response, status: int, kind: str, needle: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert needle in body["error"]["message"], body


async def test_every_refusal_on_the_messages_paths_is_in_anthropics_shape(gw: _Gateway) -> None:
    s = await gw.session()
    key = {"x-api-key": s["api_key"]}
    ok = _body()
    by_path = s["base_url"] + "/messages"
    cases = [
        ("/v1/messages", {}, ok, 401, "authentication_error", "missing API key"),
        (
            "/v1/messages",
            {"x-api-key": "sk-nope"},
            ok,
            401,
            "authentication_error",
            "invalid API key",
        ),
        ("/sessions/nope/v1/messages", {}, ok, 404, "not_found_error", "unknown session"),
        ("/v1/messages", key, {**ok, "top_k": 3}, 400, "invalid_request_error", "top_k"),
        ("/v1/messages", key, {"messages": []}, 400, "invalid_request_error", "messages"),
        (
            "/v1/messages/count_tokens",
            key,
            {**ok, "images": 1},
            400,
            "invalid_request_error",
            "images",
        ),
        (by_path, {}, {**ok, "system": "x" * 5000}, 413, "request_too_large", "limit"),
        ("/v1/messages/batches", key, ok, 404, "not_found_error", "Invalid URL"),
    ]
    for path, headers, body, status, kind, needle in cases:
        resp = await gw.client.post(path, json=body, headers=headers)
        _anthropic_error(resp, status, kind, needle)
    _anthropic_error(
        await gw.client.get("/v1/messages", headers=key), 405, "invalid_request_error", "Method"
    )
    not_json = await gw.client.post("/v1/messages", content=b"{", headers=key)
    _anthropic_error(not_json, 400, "invalid_request_error", "not valid JSON")
    # The same refusals elsewhere keep OpenAI's shape.
    chat = await gw.client.post("/v1/chat/completions", json={"messages": []})
    assert set(chat.json()["error"]) == {"message", "type", "param", "code"}


async def test_a_finished_session_and_a_busy_one_are_refused_in_anthropics_shape(
    gw: _Gateway,
) -> None:
    s = await gw.session()
    key = {"x-api-key": s["api_key"]}
    release = gw.app.state.gateway.admission.admit(s["session_id"])  # its one slot, held
    busy = await gw.client.post("/v1/messages", json=_body(), headers=key)
    _anthropic_error(busy, 429, "rate_limit_error", "in flight")
    release()
    finished = await gw.client.post(
        f"/admin/sessions/{s['session_id']}/finish",
        json={"status": "finished"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert finished.status_code < 300, finished.text
    gone = await gw.client.post("/v1/messages", json=_body(), headers=key)
    _anthropic_error(gone, 409, "invalid_request_error", "finished")


async def test_the_sdk_raises_its_own_error_types(gw: _Gateway) -> None:
    s = await gw.session()
    client = gw.sdk(s["api_key"])
    with pytest.raises(anthropic.BadRequestError) as err:
        await client.messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"top_k": 3},
        )
    assert err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        await gw.sdk("sk-wrong").messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )


async def test_a_tool_result_turn_extends_the_tool_use_turns_exact_tokens(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    completion = tok.encode(call, add_special_tokens=False) + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    replica = FakeReplica(completion)
    async with serve_gateway(tiny_model_dir, tmp_path, {REPLICA: replica}) as (client, app):
        gw = _Gateway(client, replica, app)
        s = await gw.session()
        sdk = gw.sdk(s["api_key"])
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await sdk.messages.create(
            model="m", max_tokens=64, tools=[TOOL], tool_choice={"type": "any"}, messages=messages
        )
        assert first.stop_reason == "tool_use"
        (use,) = first.content
        assert (
            use.type == "tool_use"
            and use.id.startswith("toolu_")
            and use.input == {"city": "Paris"}
        )
        messages.append({"role": "assistant", "content": first.content})  # the SDK's objects
        messages.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}],
            }
        )
        async with sdk.messages.stream(
            model="m", max_tokens=64, tools=[TOOL], messages=messages
        ) as stream:
            second = await stream.get_final_message()
        assert second.stop_reason == "tool_use"
        c0, c1 = await gw.calls(s["session_id"])
        assert c1["extends_previous"]
        assert c1["prompt_ids"][: len(c0["prompt_ids"]) + len(c0["completion_ids"])] == (
            c0["prompt_ids"] + c0["completion_ids"]
        )
        assert c1["request"]["messages"][-1] == {
            "role": "tool",
            "tool_call_id": use.id,
            "content": "21 C",
        }
