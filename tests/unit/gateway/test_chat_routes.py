"""The chat routes answered ahead of FastAPI (gateway/api/chat_routes.py): a streamed answer stops,
and its upstream generation with it, when the client disconnects."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica, serve_gateway

TOKENS = 200
TOKEN_INTERVAL_S = 0.02


class SlowReplica(FakeReplica):
    """Streams one token per interval, as a replica generating a long answer does."""

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/inference/v1/generate":
            return super().handler(request)

        async def body() -> AsyncIterator[bytes]:
            for i in range(TOKENS):
                await asyncio.sleep(TOKEN_INTERVAL_S)
                choice = {
                    "token_ids": [self.completion[i % len(self.completion)]],
                    "logprobs": {"content": [{"logprob": -0.5}]},
                    "finish_reason": "length" if i == TOKENS - 1 else None,
                }
                yield b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


def _chat_scope(sid: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": f"/sessions/{sid}/v1/chat/completions",
        "raw_path": f"/sessions/{sid}/v1/chat/completions".encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "server": ("gw", 80),
        "client": ("agent", 1234),
    }


async def test_a_stream_whose_client_disconnects_stops(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    replica = SlowReplica(completion=tok.encode(" hello there", add_special_tokens=False))
    async with serve_gateway(tiny_model_dir, tmp_path, {REPLICA: replica}) as (client, app):
        r = await client.post(
            "/admin/sessions", json={"task_id": "t"}, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        sid = r.json()["session_id"]
        request = json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        ).encode()
        gone = asyncio.Event()
        sent: list[dict[str, Any]] = []
        received = 0

        async def receive() -> dict[str, Any]:
            nonlocal received
            received += 1
            if received == 1:
                return {"type": "http.request", "body": request, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if len(sent) == 4:  # the headers and three bursts of events
                gone.set()

        scope = _chat_scope(sid)
        started = time.monotonic()
        await asyncio.wait_for(app(scope, receive, send), TOKENS * TOKEN_INTERVAL_S)
        # Well before the replica would have finished: the stream stopped at the disconnect.
        assert time.monotonic() - started < TOKENS * TOKEN_INTERVAL_S / 2
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert all(m.get("more_body", True) for m in sent)  # never completed
        assert app.state.gateway.gate.in_flight == 0  # the upstream request is closed
        # The gateway still serves.
        r = await client.post(
            f"/sessions/{sid}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 200, r.text


async def test_a_stream_whose_whole_answer_arrives_at_once_is_one_write(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The replica sends every token and the finish in one read: the role, the content, the
    finish, the usage and [DONE] go out in one body message after the headers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    replica = FakeReplica(completion=tok.encode(" hello there", add_special_tokens=False))
    async with serve_gateway(tiny_model_dir, tmp_path, {REPLICA: replica}) as (client, app):
        r = await client.post(
            "/admin/sessions", json={"task_id": "t"}, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        sid = r.json()["session_id"]
        request = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent: list[dict[str, Any]] = []
        delivered = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if not sent:
                return {"type": "http.request", "body": json.dumps(request).encode()}
            await delivered.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if not message.get("more_body", True):
                delivered.set()

        await asyncio.wait_for(app(_chat_scope(sid), receive, send), 30)
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert sent[1]["more_body"] is False
        events = [
            line.removeprefix("data: ")
            for line in sent[1]["body"].decode().split("\n\n")
            if line.startswith("data: ")
        ]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        content = "".join(
            c["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if c["choices"]
        )
        r = await client.post(
            "/admin/sessions", json={"task_id": "t"}, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        plain = await client.post(
            f"/sessions/{r.json()['session_id']}/v1/chat/completions",
            json={**request, "stream": False, "stream_options": None},
        )
        assert content == plain.json()["choices"][0]["message"]["content"] != ""
        assert chunks[-2]["choices"][0]["finish_reason"] is not None
        assert chunks[-1]["usage"]["completion_tokens"] == len(replica.completion)
