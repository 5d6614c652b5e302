"""A gateway over a fake replica, in process: a replica that answers fixed tokens in the replica
protocol the gateway speaks, the gateway app around it, and the harness that holds both (shared
by the tests that need a gateway without vLLM)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.gateway.api.app import create_app
from lockgate.gateway.config import GatewayConfig

ADMIN = "admin-token-for-tests"
REPLICA = "http://fake-replica:8000"


def sse_chunks(ids: list[int], logprobs: list[float], finish: str, per_chunk: int = 2) -> bytes:
    """What vLLM's streamed /inference/v1/generate sends: token deltas, then the finish."""
    out = []
    for i in range(0, len(ids), per_chunk):
        last = i + per_chunk >= len(ids)
        choice = {
            "index": 0,
            "token_ids": ids[i : i + per_chunk],
            "logprobs": {
                "content": [
                    {"token_id": t, "logprob": lp}
                    for t, lp in zip(
                        ids[i : i + per_chunk], logprobs[i : i + per_chunk], strict=True
                    )
                ]
            },
            "finish_reason": finish if last else None,
        }
        out.append(b"data: " + json.dumps({"request_id": "x", "choices": [choice]}).encode())
    if not ids:
        choice = {"index": 0, "token_ids": [], "finish_reason": finish}
        out.append(b"data: " + json.dumps({"request_id": "x", "choices": [choice]}).encode())
    out.append(b"data: [DONE]")
    return b"\n\n".join(out) + b"\n\n"


@dataclass
class FakeReplica:
    """Speaks the replica endpoints the gateway uses; answers fixed tokens."""

    completion: list[int]
    down: bool = False
    requests: list[dict[str, Any]] = field(default_factory=list)
    label: str | None = None
    admin: list[str] = field(default_factory=list)

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/inference/v1/generate":
            body = json.loads(request.content)
            self.requests.append(body)
            n = min(len(self.completion), body["sampling_params"]["max_tokens"])
            ids = self.completion[:n]
            finish = "stop" if n == len(self.completion) else "length"
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content=sse_chunks(ids, [-0.25 * (i + 1) for i in range(n)], finish),
            )
        self.admin.append(request.url.path)
        if request.url.path == "/update_weight_version":
            self.label = json.loads(request.content)["new_version"]
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        return httpx.Response(200, json={})


@dataclass
class Harness:
    client: httpx.AsyncClient
    replica: FakeReplica
    app: Any

    async def session(self) -> dict[str, Any]:
        r = await self.client.post("/admin/sessions", json={"task_id": "t"}, headers=_admin())
        assert r.status_code == 201, r.text
        return r.json()

    async def calls(self, sid: str) -> list[dict[str, Any]]:
        r = await self.client.get(f"/admin/sessions/{sid}/calls", headers=_admin())
        return r.json()["calls"]


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
async def harness(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Harness]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    completion = tok.encode("hello there", add_special_tokens=False) + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    replica = FakeReplica(completion=completion)
    async with serve_gateway(
        tiny_model_dir, tmp_path, {REPLICA: replica}, max_pause_wait_s=2.0
    ) as (client, app):
        yield Harness(client, replica, app)


@contextlib.asynccontextmanager
async def serve_gateway(
    model_dir: Path, tmp_path: Path, replicas: dict[str, FakeReplica], **config: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """A started gateway app over fake replicas (by base URL), and a client for it."""

    def route(request: httpx.Request) -> httpx.Response:
        return replicas[f"http://{request.url.host}:{request.url.port}"].handler(request)

    upstream = httpx.AsyncClient(transport=httpx.MockTransport(route))
    app = create_app(
        GatewayConfig(
            model_dir=model_dir,
            replicas=list(replicas),
            db_path=tmp_path / "store.sqlite",
            admin_token=ADMIN,
            **{"max_model_len": 256, **config},
        ),
        http=upstream,
    )
    gateway = app.state.gateway
    await gateway.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw"
        ) as client:
            yield client, app
    finally:
        await gateway.close()
        await upstream.aclose()


def _assert_openai_error(resp: httpx.Response, status: int, needle: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"], err["message"]
