"""A gateway process over the session's real replicas for tests that drive it through an SDK,
and the admin calls those tests make."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.coordinator.launch.gateway import GatewayProcess
from lockgate.gateway.config import GatewayConfig, SamplingPolicy


@contextlib.contextmanager
def sdk_gateway(
    model_dir: Path, replica_urls: list[str], run_dir: Path, admin_token: str, **config: Any
) -> Iterator[str]:
    """A started gateway (its URL) of the tiny model; `config`: GatewayConfig fields."""
    gateway = GatewayProcess(
        GatewayConfig(
            model_dir=model_dir,
            replicas=replica_urls,
            db_path=run_dir / "trajectories.sqlite",
            admin_token=admin_token,
            max_model_len=2048,
            **config,
        ),
        run_dir,
    )
    gateway.start()
    try:
        yield gateway.url
    finally:
        gateway.stop()


def greedy_gateway_url(admin_token: str, name: str) -> Any:
    """A module fixture: the URL of a gateway process over the session's replicas that honours
    the agent's sampling (a test that asks temperature 0 is greedy, so it can be exact) and has
    forced tool calls come first, without thinking. `name`: its run folder's."""

    @pytest.fixture(scope="module")
    def gateway_url(
        tiny_model_dir: Path, replicas: Any, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[str]:
        with sdk_gateway(
            tiny_model_dir,
            replicas.urls,
            tmp_path_factory.mktemp(name),
            admin_token,
            sampling=SamplingPolicy(mode="honor"),
            constrained_reasoning="disabled",
        ) as url:
            yield url

    return gateway_url


def admin_call(url: str, token: str, method: str, path: str, body: Any = None) -> Any:
    """An admin route's JSON answer; a failure status fails the test with the body."""
    resp = httpx.request(
        method, url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60
    )
    assert resp.status_code < 300, resp.text
    return resp.json()


async def agents_forced_turn(base_url: str, tool_fn: Any, max_tokens: int) -> str:
    """One turn of the openai-agents SDK's chat model with `tool_choice="required"` at a
    session's `base_url`; the run ends with the tool's result (its final output), so only the
    forced turn is under test."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    # The SDK would otherwise try to export traces to OpenAI's servers.
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    agent = Agent(
        name="weather",
        instructions="Answer with the tool.",
        tools=[function_tool(tool_fn)],
        model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", max_tokens=max_tokens),
        tool_use_behavior="stop_on_first_tool",
    )
    try:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=2)
    finally:
        await client.close()
    return str(result.final_output)
