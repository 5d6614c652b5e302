"""The chat routes answered ahead of FastAPI (gateway/chat_routes.py): a streamed answer stops,
and its upstream generation with it, when the client disconnects."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from tests.test_gateway_edges import ADMIN, REPLICA, FakeReplica, serve_gateway

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

        scope = {
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
