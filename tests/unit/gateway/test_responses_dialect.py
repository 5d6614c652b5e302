"""OpenAI's Responses API: the pure translation (dialects/responses.py, responses_stream.py), then
the route over a fake replica driven by the official `openai` SDK and the openai-agents SDK's
default model (the real-vLLM tests are tests/vllm/test_responses_api.py)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.models.openai_responses import OpenAIResponsesModel
from openai import AsyncOpenAI, NotFoundError
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from transformers import AutoTokenizer

from lockgate.gateway.dialects.responses import (
    INSTRUCTIONS,
    chat_body,
    check_continuable,
    continued_history,
    finished_response,
    input_messages,
    output_items,
    previous_index,
    read_request,
    response_id,
    response_shell,
    stable_call_ids,
)
from lockgate.gateway.dialects.responses_stream import ResponseEvents
from lockgate.gateway.errors import GatewayError
from lockgate.gateway.schema import AssistantMessage, ChatCompletionRequest, FunctionCall, ToolCall
from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica, serve_gateway

set_tracing_disabled(True)

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def _read(**body: Any) -> Any:
    return read_request(body, max_items=64, max_tools=8)


def _chat(**body: Any) -> dict[str, Any]:
    chat = chat_body(_read(**body), [])
    ChatCompletionRequest.model_validate(chat)  # what the pipeline validates it as
    return chat


def _refusal(body: dict[str, Any]) -> GatewayError:
    with pytest.raises(GatewayError) as err:
        chat_body(read_request(body, max_items=64, max_tools=8), [])
    assert err.value.status_code == 400
    return err.value


# -- request -> chat body ----------------------------------------------------------------------


def test_a_string_input_with_instructions_is_a_system_then_a_user_message() -> None:
    chat = _chat(input="Hi", instructions="Be brief.", max_output_tokens=9, temperature=0.5)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.", "name": INSTRUCTIONS},
        {"role": "user", "content": "Hi"},
    ]
    assert chat["max_tokens"] == 9 and chat["temperature"] == 0.5 and chat["stream"] is False


def test_an_assistant_turn_is_rebuilt_from_its_reasoning_text_and_calls() -> None:
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Paris "}, {"type": "input_text", "text": "and Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "two calls"}]},
        {"type": "message", "role": "assistant", "id": "m", "status": "completed", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "a", "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "assistant", "content": "Sunny, then rain."},
        {"type": "message", "role": "assistant", "content": "A second turn."},
    ]  # fmt: skip
    messages = input_messages(items)
    assert messages == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "two calls",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "assistant", "content": "Sunny, then rain."},
        {"role": "assistant", "content": "A second turn."},
    ]  # fmt: skip
    ChatCompletionRequest.model_validate({"messages": messages})


def test_a_call_after_a_call_is_the_same_turn_and_text_after_a_call_the_next() -> None:
    call = {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"}
    text = {"role": "assistant", "content": "done"}
    roles = [
        m.get("tool_calls") is not None
        for m in input_messages([call, call | {"call_id": "b"}, text])
    ]
    assert roles == [True, False]


def test_tools_and_tool_choice_become_the_chat_ones() -> None:
    named = _chat(input="x", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    assert named["tools"] == [
        {
            "type": "function",
            "function": {k: v for k, v in TOOL.items() if k != "type"},
        }
    ]
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("auto", "none", "required"):
        assert _chat(input="x", tools=[TOOL], tool_choice=choice)["tool_choice"] == choice
    chat = _chat(
        input="x",
        tools=[TOOL],
        parallel_tool_calls=False,
        store=False,
        user="u",
        metadata={"k": "v"},
    )
    assert (chat["parallel_tool_calls"], chat["store"], chat["user"], chat["metadata"]) == (False, False, "u", {"k": "v"})  # fmt: skip


def test_stop_and_seed_are_taken_as_vllms_responses_server_takes_them() -> None:
    chat = _chat(input="x", stop=[".", "?"], seed=7)
    assert (chat["stop"], chat["seed"]) == ([".", "?"], 7)


def test_harmless_defaults_are_accepted() -> None:
    chat = _chat(
        input="x",
        include=[],
        truncation="disabled",
        text={"format": {"type": "text"}},
        background=False,
        reasoning=None,
        model="gpt-anything",
    )
    assert chat["model"] == "gpt-anything"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [TOOL, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
        ({"tools": [TOOL | {"defer_loading": True}]}, "tools.0.defer_loading"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt_cache_key": "k"}, "prompt_cache_key"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format.type"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]}, "input[0].encrypted_content"),
        ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "call_id": "a", "name": "f"}]}, "input[0].arguments"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    extra: dict[str, Any], param: str
) -> None:
    err = _refusal({"input": "x", **extra})
    assert err.param == param, err.message
    assert param.split(".")[0].split("[")[0] in err.message


def test_long_lists_are_refused_before_they_are_validated() -> None:
    with pytest.raises(GatewayError, match="at most 64 items"):
        read_request({"input": [{"role": "user", "content": "x"}] * 65}, max_items=64, max_tools=8)
    with pytest.raises(GatewayError, match="at most 8 items"):
        read_request({"input": "x", "tools": [TOOL] * 9}, max_items=64, max_tools=8)


async def test_what_the_agents_sdk_sends_by_default_is_accepted() -> None:
    """The openai-agents SDK's default model (OpenAIResponsesModel), a forced tool call then the
    tool's result: both bodies it sends translate into valid chat bodies."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        call = ToolCall(
            id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}')
        )
        first = AssistantMessage(content=None, reasoning_content="hm", tool_calls=[call])
        message = first if len(bodies) == 1 else AssistantMessage(content="Sunny.")
        shell = response_shell(_read(input="x"), "resp_t_0", int(time.time()), "tiny", {})
        return httpx.Response(200, json=finished_response(shell, message, "stop", (1, 1, 0), 0))

    client = AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))  # fmt: skip
    agent = Agent(
        name="weather",
        instructions="Use the tool.",
        tools=[_get_weather],
        model=OpenAIResponsesModel(model="tiny", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", max_tokens=32),
    )
    result = await Runner.run(agent, "Weather in Paris?", max_turns=3)
    assert result.final_output == "Sunny."
    first, second = (_chat(**b) for b in bodies)
    assert first["tool_choice"] == "required"
    assert second["messages"][: len(first["messages"])] == first["messages"]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "tool"]
    assert second["messages"][2]["reasoning_content"] == "hm"


@function_tool(name_override="get_weather")
def _get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


# -- answer -> response --------------------------------------------------------------------------


def _message(content: str | None, reasoning: str | None = None, calls: int = 0) -> AssistantMessage:
    tool_calls = [
        ToolCall(id=f"call_{'0' * 23}{i}", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
        for i in range(calls)
    ]  # fmt: skip
    return AssistantMessage(
        content=content, reasoning_content=reasoning, tool_calls=tool_calls or None
    )


def _response(message: AssistantMessage, finish: str = "stop", **req: Any) -> dict[str, Any]:
    rid = response_id("session-a", 3)
    shell = response_shell(
        _read(input="x", **req), rid, 100, "tiny", {"temperature": 1.0, "top_p": 1.0}
    )
    return finished_response(shell, stable_call_ids(message, rid), finish, (10, 7, 3), 101)


def test_an_answer_is_a_response_the_sdk_parses_with_items_in_the_models_order() -> None:
    body = _response(_message("It is sunny.", "hm", calls=2), tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    r = Response.model_validate(body)
    assert r.id.startswith("resp_") and r.status == "completed" and r.incomplete_details is None
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call", "function_call"]
    assert r.output_text == "It is sunny."
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.call_id for c in calls] == [f"call_{r.id[5:]}_0", f"call_{r.id[5:]}_1"]
    assert r.usage is not None and (
        r.usage.input_tokens,
        r.usage.output_tokens,
        r.usage.total_tokens,
    ) == (10, 7, 17)
    assert r.usage.output_tokens_details.reasoning_tokens == 3
    assert r.tool_choice.type == "function" and r.tools[0].name == "get_weather"  # type: ignore[union-attr]


def test_calls_alone_have_no_message_item_and_a_cut_answer_is_incomplete() -> None:
    only_calls = Response.model_validate(_response(_message(None, calls=1)))
    assert [o.type for o in only_calls.output] == ["function_call"]
    cut = Response.model_validate(_response(_message("It is"), finish="length"))
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"  # type: ignore[union-attr]


def test_ids_the_model_wrote_are_kept_and_made_up_ones_derived_from_the_response() -> None:
    mine = ToolCall(id="functions.get_weather:0", function=FunctionCall(name="f", arguments="{}"))
    message = AssistantMessage(
        content=None, tool_calls=[mine, *(_message(None, calls=1).tool_calls or [])]
    )
    ids = [c.id for c in stable_call_ids(message, "resp_x_4").tool_calls or []]
    assert ids == ["functions.get_weather:0", "call_x_4_1"]


# -- stream events ------------------------------------------------------------------------------


def _stream(deltas: list[tuple[str, str]], final: dict[str, Any]) -> list[Any]:
    shell = {k: v for k, v in final.items()}
    shell.update(status="in_progress", output=[], usage=None, incomplete_details=None)
    events = ResponseEvents(shell)
    raw = events.start() + b"".join(events.delta(r, c) for r, c in deltas) + events.finish(final)
    out = []
    for block in raw.decode().strip().split("\n\n"):
        kind, data = block.split("\n")
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {event.type}"
        out.append(event)
    return out


def test_stream_events_come_in_order_numbered_and_add_up_to_the_answer() -> None:
    final = _response(_message("It is sunny.", "I think", calls=1), tools=[TOOL])
    events = _stream([("I ", ""), ("think", ""), ("", "It is"), ("", " sunny")], final)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",  # the "." held back until the end
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "It is sunny."
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [d.model_dump() for d in done] == [o.model_dump() for o in events[-1].response.output]
    assert events[-1].response.model_dump() == Response.model_validate(final).model_dump()


def test_a_cut_stream_ends_incomplete_and_a_failed_one_says_why() -> None:
    events = _stream([], _response(_message("It is"), finish="length"))
    assert events[-1].type == "response.incomplete"
    shell = _response(_message("x"))
    failed = ResponseEvents(shell).failed(GatewayError(503, "no replica"))
    event = EVENTS.validate_python(json.loads(failed.decode().split("data: ")[1]))
    assert event.type == "response.failed" and event.response.error.message == "no replica"


# -- previous_response_id -----------------------------------------------------------------------


def test_a_response_id_names_its_call_in_its_own_session_only() -> None:
    rid = response_id("session-a", 12)
    assert previous_index(rid, "session-a") == 12
    assert "session-a" not in rid  # the session id is a capability: never in an id agents log
    for bad, session in (
        (rid, "session-b"),
        ("resp_nope", "session-a"),
        ("chatcmpl-1", "session-a"),
    ):
        with pytest.raises(GatewayError) as err:
            previous_index(bad, session)
        assert err.value.status_code == 404 and err.value.param == "previous_response_id"


@pytest.mark.parametrize(
    ("chat", "finish", "needle"),
    [
        (None, None, "no response"),
        ({"prompt": "raw"}, "stop", "no response"),
        ({"messages": []}, "interrupted", "no response"),
        ({"messages": [], "store": False}, "stop", "store: false"),
    ],
)
def test_only_a_stored_finished_chat_call_can_be_continued(
    chat: dict[str, Any] | None, finish: str | None, needle: str
) -> None:
    with pytest.raises(GatewayError, match=needle) as err:
        check_continuable("resp_x_1", chat, finish)
    assert err.value.status_code == 404
    check_continuable("resp_x_1", {"messages": [], "store": True}, "length")


def test_a_continuation_drops_the_old_instructions_and_adds_the_answer_as_echoed() -> None:
    old = _chat(input="Hi", instructions="Be brief.")
    message = stable_call_ids(_message("Checking.", "hm", calls=1), "resp_x_0")
    history = continued_history(old, message, "resp_x_0")
    echoed = input_messages(output_items(message, "resp_x_0", "completed"))
    assert history == [{"role": "user", "content": "Hi"}, *echoed]
    again = chat_body(_read(input=[{"type": "function_call_output", "call_id": "call_x_0_0", "output": "ok"}], instructions="Be brief."), history)  # fmt: skip
    assert again["messages"][:2] == old["messages"]
    ChatCompletionRequest.model_validate(again)


# -- the route, over a fake replica ---------------------------------------------------------------


class _Gateway:
    def __init__(self, client: httpx.AsyncClient, app: Any, replica: FakeReplica, tok: Any) -> None:
        self.client, self.app, self.replica, self.tok = client, app, replica, tok

    def answer(self, text: str) -> None:
        end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.replica.completion = self.tok.encode(text, add_special_tokens=False) + [end]

    async def session(self) -> dict[str, Any]:
        r = await self.client.post("/admin/sessions", json={"task_id": "t"}, headers=_ADMIN)
        return dict(r.json())

    def sdk(self, base_url: str, api_key: str = "unused") -> AsyncOpenAI:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app))
        return AsyncOpenAI(base_url="http://gw" + base_url, api_key=api_key, http_client=http, max_retries=0)  # fmt: skip

    async def calls(self, sid: str) -> list[dict[str, Any]]:
        r = await self.client.get(f"/admin/sessions/{sid}/calls", headers=_ADMIN)
        return list(r.json()["calls"])


_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
_CALL = '<think>\nweather\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'  # fmt: skip


@pytest.fixture
async def gw(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[_Gateway]:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    replica = FakeReplica(completion=[])
    async with serve_gateway(tiny_model_dir, tmp_path, {REPLICA: replica}, max_model_len=2048) as (client, app):  # fmt: skip
        yield _Gateway(client, app, replica, tok)


async def test_streamed_and_plain_answers_of_the_same_tokens_are_the_same_response(
    gw: _Gateway,
) -> None:
    gw.answer(_CALL)
    s = await gw.session()
    sdk = gw.sdk(s["base_url"])
    args: dict[str, Any] = {"model": "m", "input": "Weather?", "tools": [TOOL]}
    plain = await sdk.responses.create(**args)
    async with sdk.responses.stream(**args) as stream:
        events = [e async for e in stream]
        streamed = await stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    keep = {"output", "usage", "status", "tools", "tool_choice", "model"}
    suffixes = (plain.id[5:], streamed.id[5:])
    as_plain = streamed.model_dump_json(include=keep).replace(suffixes[1], suffixes[0])
    parsed = json.loads(as_plain)
    for item in parsed["output"]:
        item.pop("parsed_arguments", None)  # what the SDK's stream helper adds to a call
    assert parsed == json.loads(plain.model_dump_json(include=keep))
    assert [o.type for o in plain.output] == ["reasoning", "function_call"]


async def test_a_stop_string_ends_the_text_streamed_or_not(gw: _Gateway) -> None:
    gw.answer("It is sunny. It rains.")
    s = await gw.session()
    sdk = gw.sdk(s["base_url"])
    plain = await sdk.responses.create(model="m", input="Weather?", extra_body={"stop": ["."]})
    events = [e async for e in await sdk.responses.create(model="m", input="Weather?", stream=True, extra_body={"stop": ["."]})]  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert plain.output_text == deltas == events[-1].response.output_text == "It is sunny"
    assert plain.status == "completed"


async def test_previous_response_id_continues_the_exact_tokens_unless_store_was_false(
    gw: _Gateway,
) -> None:
    gw.answer(_CALL)
    s = await gw.session()
    sdk = gw.sdk("/v1", api_key=s["api_key"])  # by session key
    first = await sdk.responses.create(model="m", input="Weather?", instructions="Brief.", tools=[TOOL])  # fmt: skip
    (call,) = [o for o in first.output if o.type == "function_call"]
    gw.answer("Sunny.")
    output = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = await sdk.responses.create(
        model="m", input=output, previous_response_id=first.id, instructions="Brief.", tools=[TOOL], store=False
    )  # fmt: skip
    assert second.output_text == "Sunny." and second.previous_response_id == first.id
    a, b = await gw.calls(s["session_id"])
    assert b["extends_previous"] and b["prompt_ids"][: len(a["prompt_ids"]) + len(a["completion_ids"])] == a["prompt_ids"] + a["completion_ids"]  # fmt: skip
    with pytest.raises(NotFoundError, match="store: false"):
        await sdk.responses.create(model="m", input="More?", previous_response_id=second.id)
    other = await gw.session()
    with pytest.raises(NotFoundError, match="no response"):
        await gw.sdk(other["base_url"]).responses.create(model="m", input="x", previous_response_id=first.id)  # fmt: skip
    assert len(await gw.calls(s["session_id"])) == 2  # refused calls are not made


async def test_continuing_an_older_response_branches_and_is_counted_as_a_re_render(
    gw: _Gateway,
) -> None:
    gw.answer(_CALL)
    s = await gw.session()
    sdk = gw.sdk(s["base_url"])
    first = await sdk.responses.create(model="m", input="Weather?", tools=[TOOL])
    (call,) = [o for o in first.output if o.type == "function_call"]
    gw.answer("Sunny.")
    output = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    for _ in range(2):  # the second continues `first` again, after another call
        await sdk.responses.create(
            model="m", input=output, previous_response_id=first.id, tools=[TOOL]
        )
    calls = await gw.calls(s["session_id"])
    assert [c["extends_previous"] for c in calls] == [False, True, False]
    assert calls[2]["request"]["messages"] == calls[1]["request"]["messages"]
    samples = (await gw.client.get(f"/admin/sessions/{s['session_id']}/samples", headers=_ADMIN)).json()  # fmt: skip
    assert samples["splits"] == 1


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_the_agents_sdk_default_model_runs_a_tool_turn_and_its_answer(
    gw: _Gateway, streamed: bool
) -> None:
    gw.answer(_CALL)
    s = await gw.session()
    agent = Agent(
        name="weather",
        instructions="Use the tool.",
        tools=[_get_weather],
        # The SDK's default model, given its client here rather than set process-wide.
        model=OpenAIResponsesModel(model="tiny", openai_client=gw.sdk(s["base_url"])),
        model_settings=ModelSettings(tool_choice="required", max_tokens=64),
    )
    original = gw.replica.handler

    def handler(request: httpx.Request) -> httpx.Response:
        response = original(request)
        if request.url.path == "/inference/v1/generate":
            gw.answer("Sunny in Paris.")  # the next turn answers in text
        return response

    gw.replica.handler = handler  # type: ignore[method-assign]
    if streamed:
        run = Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        kinds = {e.type async for e in run.stream_events()}
        assert "raw_response_event" in kinds
        final = run.final_output
    else:
        final = (await Runner.run(agent, "Weather in Paris?", max_turns=3)).final_output
    assert final == "Sunny in Paris."
    first, second = await gw.calls(s["session_id"])
    assert first["constrained"] and not second["constrained"]
    assert second["extends_previous"] and second["request"]["stream"] is streamed
    samples = (await gw.client.get(f"/admin/sessions/{s['session_id']}/samples", headers=_ADMIN)).json()  # fmt: skip
    assert samples["splits"] == 0 and len(samples["samples"]) == 1


async def test_unsupported_fields_and_bad_keys_are_openai_errors_over_http(gw: _Gateway) -> None:
    s = await gw.session()
    r = await gw.client.post(f"{s['base_url']}/responses", json={"input": "x", "tools": [{"type": "web_search"}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type"
    r = await gw.client.post("/v1/responses", json={"input": "x"}, headers={"Authorization": "Bearer nope"})  # fmt: skip
    assert r.status_code == 401 and "error" in r.json()
    assert await gw.calls(s["session_id"]) == []
