"""`GET /metrics`: the Prometheus counters and gauges move as calls go through the gateway."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fake_gateway import ADMIN, FakeReplica, serve_gateway, sse_chunks

CHAT_ROUTE = "/sessions/{session_id}/v1/chat/completions"
UP_A, UP_B = "http://replica-a:8000", "http://replica-b:8000"


@dataclass
class Rig:
    client: httpx.AsyncClient
    replicas: dict[str, FakeReplica]

    async def session(self) -> dict[str, Any]:
        r = await self.client.post("/admin/sessions", json={"task_id": "t"}, headers=ADMIN_H)
        assert r.status_code == 201, r.text
        return r.json()

    async def chat(self, sid: str, content: str = "hi", **extra: Any) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": content}], **extra}
        return await self.client.post(f"/sessions/{sid}/v1/chat/completions", json=body)

    async def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of the current exposition (0 if absent)."""
        text = (await self.client.get("/metrics")).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return sample.value
        return 0.0


ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
async def rig(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Rig]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    completion = tok.encode("hello there, friend", add_special_tokens=False) + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    replicas = {UP_A: FakeReplica(completion=completion), UP_B: FakeReplica(completion=completion)}
    async with serve_gateway(tiny_model_dir, tmp_path, replicas, max_pause_wait_s=5.0) as (
        client,
        _,
    ):
        yield Rig(client, replicas)


async def _streamed(resp: httpx.Response) -> str:
    content = ""
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                content += choice["delta"].get("content") or ""
    return content


async def test_calls_count_requests_latency_and_tokens(rig: Rig) -> None:
    s = await rig.session()
    plain = await rig.chat(s["session_id"])
    streamed = await rig.chat(s["session_id"], stream=True)
    assert plain.status_code == streamed.status_code == 200
    assert await _streamed(streamed) == plain.json()["choices"][0]["message"]["content"]

    assert await rig.metric("lockgate_gateway_requests_total", route=CHAT_ROUTE, status="200") == 2
    assert await rig.metric("lockgate_gateway_request_seconds_count", route=CHAT_ROUTE) == 2
    assert await rig.metric("lockgate_gateway_calls_total", finish_reason="stop") == 2
    calls = (
        await rig.client.get(f"/admin/sessions/{s['session_id']}/calls", headers=ADMIN_H)
    ).json()["calls"]
    prompt = sum(len(c["prompt_ids"]) for c in calls)
    completion = sum(len(c["completion_ids"]) for c in calls)
    assert await rig.metric("lockgate_gateway_prompt_tokens_total") == prompt
    assert await rig.metric("lockgate_gateway_completion_tokens_total") == completion
    # The same one-message chat twice does not extend the first call's tokens: one split.
    assert await rig.metric("lockgate_gateway_rerender_splits_total") == 1
    # Admin routes are counted under their template too; session ids never become labels.
    assert await rig.metric("lockgate_gateway_requests_total", route="/admin/sessions") == 1
    text = (await rig.client.get("/metrics")).text
    assert s["session_id"] not in text


async def test_errors_are_counted_by_kind_and_status(rig: Rig) -> None:
    s = await rig.session()
    assert (await rig.chat(s["session_id"], n=2)).status_code == 400
    assert (await rig.chat("nope")).status_code == 404
    assert (await rig.client.get("/no/such/path")).status_code == 404
    assert await rig.metric("lockgate_gateway_errors_total", kind="invalid_request_error") == 1
    assert await rig.metric("lockgate_gateway_errors_total", kind="not_found") == 1
    assert await rig.metric("lockgate_gateway_requests_total", route=CHAT_ROUTE, status="400") == 1
    assert await rig.metric("lockgate_gateway_requests_total", route=CHAT_ROUTE, status="404") == 1
    assert await rig.metric("lockgate_gateway_requests_total", route="unmatched") == 1


async def test_queue_depth_at_the_pause_gate_and_in_flight_per_replica(rig: Rig) -> None:
    s = await rig.session()
    assert await rig.metric("lockgate_gateway_replica_in_flight", replica=UP_A) == 0
    await rig.client.post("/admin/pause", json={}, headers=ADMIN_H)
    pending = asyncio.create_task(rig.chat(s["session_id"]))
    for _ in range(50):
        await asyncio.sleep(0.02)
        if await rig.metric("lockgate_gateway_gate_waiting") == 1:
            break
    assert await rig.metric("lockgate_gateway_gate_waiting") == 1
    r = await rig.client.post("/admin/resume", json={"version": 0}, headers=ADMIN_H)
    assert r.status_code == 200, r.text
    assert (await pending).status_code == 200
    assert await rig.metric("lockgate_gateway_gate_waiting") == 0
    assert await rig.metric("lockgate_gateway_replica_in_flight", replica=UP_B) == 0


async def test_failovers_and_interruptions_are_counted(rig: Rig) -> None:
    s = await rig.session()
    # Replica A is picked first (least loaded, then by URL) and is down: the call moves to B.
    rig.replicas[UP_A].down = True
    assert (await rig.chat(s["session_id"])).status_code == 200
    assert await rig.metric("lockgate_gateway_failovers_total") == 1
    assert await rig.metric("lockgate_gateway_replica_healthy", replica=UP_A) == 0

    # Replica B aborts the next generation after two tokens (as vLLM does for a sync), then
    # serves the continuation: one interruption, and the call still succeeds.
    b = rig.replicas[UP_B]
    answer = b.handler

    def abort_once(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/inference/v1/generate" and not getattr(abort_once, "done", 0):
            abort_once.done = 1  # type: ignore[attr-defined]
            return httpx.Response(200, content=sse_chunks(b.completion[:2], [-0.1, -0.2], "abort"))
        return answer(request)

    b.handler = abort_once  # type: ignore[method-assign]
    assert (await rig.chat(s["session_id"], "again")).status_code == 200
    assert await rig.metric("lockgate_gateway_interruptions_total") == 1


async def test_a_stalled_event_loop_shows_in_the_loop_lag_histogram_and_the_log(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    await asyncio.sleep(0.25)  # the heartbeat's first wake-ups, on time
    before = await rig.metric("lockgate_gateway_loop_lag_seconds_bucket", le="0.25")
    assert before >= 1
    with caplog.at_level("WARNING", logger="lockgate.gateway.api.event_loop_lag"):
        time.sleep(0.4)  # noqa: ASYNC251 - what a blocking call in the gateway does to every call
        await asyncio.sleep(0.15)  # the heartbeat wakes, late
    assert await rig.metric("lockgate_gateway_loop_lag_seconds_count") > before
    # The late wake-up lands above 0.25 s: the 0.25 bucket grew less than the count did.
    late = await rig.metric("lockgate_gateway_loop_lag_seconds_count") - await rig.metric(
        "lockgate_gateway_loop_lag_seconds_bucket", le="0.25"
    )
    assert late >= 1
    assert any("ran" in r.message and "ms late" in r.message for r in caplog.records)
