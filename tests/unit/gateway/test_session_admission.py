"""Per-session admission (gateway/api/session_admission.py): a session over its in-flight or
per-minute bound gets a 429 in OpenAI's shape, records nothing, and holds up no other session."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.gateway.api.session_admission import SessionAdmission
from lockgate.gateway.errors import GatewayError
from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica, serve_gateway

# -- the bookkeeping -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_in_flight_calls_are_bounded_per_session_and_released() -> None:
    admission = SessionAdmission(max_in_flight=2)
    first, second = admission.admit("a"), admission.admit("a")
    with pytest.raises(GatewayError) as refused:
        admission.admit("a")
    assert (refused.value.status_code, refused.value.code) == (429, "rate_limit_exceeded")
    assert "2 calls in flight" in refused.value.message
    admission.admit("b")  # another session is not held up by this one
    first()
    first()  # a second release of the same slot frees nothing more
    assert admission.in_flight("a") == 1
    admission.admit("a")
    with pytest.raises(GatewayError):
        admission.admit("a")
    second()
    assert admission.in_flight("a") == 1


def test_the_per_minute_rate_is_a_token_bucket_with_a_burst() -> None:
    clock = Clock()
    admission = SessionAdmission(per_minute=30, burst=2, clock=clock)
    admission.admit("a")()
    admission.admit("a")()
    with pytest.raises(GatewayError) as refused:
        admission.admit("a")
    assert refused.value.status_code == 429
    assert "retry in 2.0 s" in refused.value.message  # one call per 2 s at 30 a minute
    admission.admit("b")()  # its own bucket
    clock.now += 1.9
    with pytest.raises(GatewayError):
        admission.admit("a")
    clock.now += 0.2
    admission.admit("a")()
    clock.now += 3600  # a long pause refills to the burst, not beyond
    for _ in range(2):
        admission.admit("a")()
    with pytest.raises(GatewayError):
        admission.admit("a")


def test_no_bounds_by_default_means_none() -> None:
    admission = SessionAdmission()
    releases = [admission.admit("a") for _ in range(1000)]
    assert admission.in_flight("a") == 1000
    for release in releases:
        release()
    assert admission.in_flight("a") == 0


# -- through the gateway ---------------------------------------------------------------------


class HeldReplica(FakeReplica):
    """Streams its answer only once `go` is set: calls stay in flight as long as a test needs."""

    go: asyncio.Event
    arrived: asyncio.Semaphore  # released once per generate request

    async def wait_for(self, requests: int) -> None:
        async with asyncio.timeout(5.0):
            for _ in range(requests):
                await self.arrived.acquire()

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/inference/v1/generate":
            return super().handler(request)
        self.requests.append(json.loads(request.content))
        self.arrived.release()

        async def body() -> AsyncIterator[bytes]:
            await self.go.wait()
            choice = {
                "token_ids": self.completion,
                "logprobs": {"content": [{"logprob": -0.5} for _ in self.completion]},
                "finish_reason": "stop",
            }
            yield b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


def _ok(model_dir: Path) -> list[int]:
    """The replicas' answer: "ok" and the end of the turn."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [*tok.encode("ok", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]


def _chat(stream: bool = False) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream}


async def _session(client: httpx.AsyncClient) -> str:
    r = await client.post(
        "/admin/sessions", json={"task_id": "t"}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert r.status_code == 201, r.text
    return str(r.json()["session_id"])


async def _calls(client: httpx.AsyncClient, sid: str) -> int:
    r = await client.get(
        f"/admin/sessions/{sid}/calls", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    return len(r.json()["calls"])


async def test_a_session_over_its_in_flight_bound_gets_a_429_and_others_go_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    replica = HeldReplica(completion=_ok(tiny_model_dir))
    replica.go, replica.arrived = asyncio.Event(), asyncio.Semaphore(0)
    async with serve_gateway(
        tiny_model_dir,
        tmp_path,
        {REPLICA: replica},
        limits={"max_calls_in_flight_per_session": 2},
    ) as (client, app):
        busy, other = await _session(client), await _session(client)
        url = f"/sessions/{busy}/v1/chat/completions"
        held = [asyncio.create_task(client.post(url, json=_chat(stream=s))) for s in (False, True)]
        await replica.wait_for(2)

        refused = await client.post(url, json=_chat())
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert "max_calls_in_flight_per_session" in error["message"]
        assert len(replica.requests) == 2  # refused before it reached a replica

        # Another session is served meanwhile (its call waits on the replica like the others).
        served = asyncio.create_task(
            client.post(f"/sessions/{other}/v1/chat/completions", json=_chat())
        )
        await replica.wait_for(1)
        replica.go.set()
        answers = await asyncio.gather(*held, served)
        assert [a.status_code for a in answers] == [200, 200, 200]
        # The slots came back when the answers (the stream's last chunk included) went out.
        assert app.state.gateway.admission.in_flight(busy) == 0
        again = await client.post(url, json=_chat())
        assert again.status_code == 200
        assert await _calls(client, busy) == 3  # the refused call left no record


async def test_a_session_over_its_call_rate_gets_a_429_saying_when_to_retry(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    replica = FakeReplica(completion=_ok(tiny_model_dir))
    async with serve_gateway(
        tiny_model_dir,
        tmp_path,
        {REPLICA: replica},
        limits={"max_calls_per_minute_per_session": 6, "calls_burst_per_session": 2},
    ) as (client, _app):
        sid = await _session(client)
        url = f"/sessions/{sid}/v1/chat/completions"
        assert [(await client.post(url, json=_chat())).status_code for _ in range(2)] == [200, 200]
        refused = await client.post(url, json=_chat())
        assert refused.status_code == 429
        assert "retry in" in refused.json()["error"]["message"]
        completions = await client.post(
            f"/sessions/{sid}/v1/completions", json={"prompt": "hi", "max_tokens": 4}
        )
        assert completions.status_code == 429  # /v1/completions shares the session's budget
        assert await _calls(client, sid) == 2


async def test_a_call_whose_client_leaves_gives_its_slot_back(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    replica = HeldReplica(completion=_ok(tiny_model_dir))
    replica.go, replica.arrived = asyncio.Event(), asyncio.Semaphore(0)
    async with serve_gateway(
        tiny_model_dir,
        tmp_path,
        {REPLICA: replica},
        limits={"max_calls_in_flight_per_session": 1},
    ) as (client, app):
        sid = await _session(client)
        url = f"/sessions/{sid}/v1/chat/completions"
        for stream in (False, True):
            left = asyncio.create_task(client.post(url, json=_chat(stream=stream)))
            await replica.wait_for(1)
            assert app.state.gateway.admission.in_flight(sid) == 1
            left.cancel()  # the agent gave up on the call
            with contextlib.suppress(asyncio.CancelledError):
                await left
            assert app.state.gateway.admission.in_flight(sid) == 0
        replica.go.set()
        assert (await client.post(url, json=_chat())).status_code == 200
