"""The gateway's default upstream transport (httpx on aiohttp) against a real local server:
streamed bodies, connection reuse, abandoned streams closing their connection, and transport
failures surfacing as the httpx errors the replica client handles."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
from aiohttp import test_utils, web

from lockgate.gateway.aiohttp_transport import AiohttpTransport
from lockgate.gateway.replica_client import ReplicaClient, ReplicaUnavailable


class _Upstream:
    def __init__(self) -> None:
        self.peers: set[int] = set()  # client ports seen: one per connection
        self.abandoned = asyncio.Event()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.peers.add(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        body = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        n = body["sampling_params"]["max_tokens"]
        try:
            for i in range(n):
                choice = {
                    "token_ids": [i],
                    "logprobs": {"content": [{"logprob": -1.0}]},
                    "finish_reason": "length" if i == n - 1 else None,
                }
                await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
                if body.get("slow"):
                    await asyncio.sleep(0.05)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.abandoned.set()
            raise
        return resp

    async def echo_headers(self, request: web.Request) -> web.Response:
        return web.json_response({k.lower(): v for k, v in request.headers.items()})


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[_Upstream, str]]:
    state = _Upstream()
    app = web.Application()
    app.router.add_post("/inference/v1/generate", state.generate)
    app.router.add_get("/headers", state.echo_headers)
    server = test_utils.TestServer(app)
    await server.start_server()
    try:
        yield state, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_streams_are_read_whole_and_connections_reused(
    upstream: tuple[_Upstream, str],
) -> None:
    state, url = upstream
    async with httpx.AsyncClient(transport=AiohttpTransport()) as http:
        replica = ReplicaClient(url, http)
        for _ in range(3):
            chunks = [c async for c in replica.generate_stream([1, 2], {"max_tokens": 4}, "r")]
            assert [c.token_ids for c in chunks] == [[0], [1], [2], [3]]
            assert chunks[-1].finish_reason == "length"
        assert len(state.peers) == 1
        r = await http.get(f"{url}/headers", headers={"x-probe": "1"})
        assert r.status_code == 200 and r.json()["x-probe"] == "1"


async def test_a_stream_closed_early_closes_its_connection(
    upstream: tuple[_Upstream, str],
) -> None:
    state, url = upstream
    async with httpx.AsyncClient(transport=AiohttpTransport()) as http:
        body = {"token_ids": [1], "sampling_params": {"max_tokens": 100}, "slow": True}
        async with http.stream("POST", f"{url}/inference/v1/generate", json=body) as resp:
            async for _ in resp.aiter_bytes():
                break
        # vLLM aborts a streamed request when its connection goes: the server must see it.
        await asyncio.wait_for(state.abandoned.wait(), 5.0)


async def test_a_refused_connection_is_a_replica_failure() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with httpx.AsyncClient(transport=AiohttpTransport()) as http:
        replica = ReplicaClient(f"http://127.0.0.1:{port}", http)
        with pytest.raises(ReplicaUnavailable):
            async for _ in replica.generate_stream([1], {"max_tokens": 1}, "r"):
                pass
        assert not await replica.healthy()
