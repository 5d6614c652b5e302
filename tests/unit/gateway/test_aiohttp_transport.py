"""The gateway's upstream HTTP stacks against a real local server: generate requests on its
minimal HTTP/1.1 client (`direct`) and on httpx over aiohttp (admin calls, and generate requests
when an httpx client is injected). Streamed bodies, connection reuse, abandoned streams closing
their connection, and transport failures surfacing as `ReplicaUnavailable`."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
from aiohttp import test_utils, web

from lockgate.gateway.aiohttp_transport import AiohttpTransport
from lockgate.gateway.replicas.http1 import Http1Upstream
from lockgate.gateway.replicas.replica_client import ReplicaClient, ReplicaUnavailable


class _Upstream:
    def __init__(self) -> None:
        self.peers: set[int] = set()  # client ports seen: one per connection
        self.transports: set[asyncio.BaseTransport] = set()
        self.abandoned = asyncio.Event()
        self.delay_s = 0.0  # before answering
        self.status = 200

    async def generate(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        self.peers.add(request.transport.get_extra_info("peername")[1])
        self.transports.add(request.transport)
        body = await request.json()
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.abandoned.set()
            raise
        if self.status != 200:
            return web.Response(status=self.status, text="engine dead")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        n = body["sampling_params"]["max_tokens"]
        slow = body["sampling_params"].get("slow")
        try:
            for i in range(n):
                choice = {
                    "token_ids": [i],
                    "logprobs": {"content": [{"logprob": -1.0}]},
                    "finish_reason": "length" if i == n - 1 else None,
                }
                await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
                if slow:
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


@contextlib.asynccontextmanager
async def _replica(
    url: str, direct: bool
) -> AsyncIterator[tuple[ReplicaClient, httpx.AsyncClient]]:
    """A replica client sending generate requests on the minimal HTTP/1.1 client (as the
    gateway's own stack does), or through httpx on aiohttp."""
    upstream = Http1Upstream()
    async with httpx.AsyncClient(transport=AiohttpTransport()) as http:
        yield ReplicaClient(url, http, upstream if direct else None), http
    await upstream.aclose()


@pytest.mark.parametrize("direct", [True, False])
async def test_streams_are_read_whole_and_connections_reused(
    upstream: tuple[_Upstream, str], direct: bool
) -> None:
    state, url = upstream
    async with _replica(url, direct) as (replica, http):
        for _ in range(3):
            chunks = [c async for c in replica.generate_stream([1, 2], {"max_tokens": 4}, "r")]
            # Chunks that arrive in one read come as one.
            assert [t for c in chunks for t in c.token_ids] == [0, 1, 2, 3]
            assert [lp for c in chunks for lp in c.logprobs] == [-1.0] * 4
            assert chunks[-1].finish_reason == "length"
        assert len(state.peers) == 1
        r = await http.get(f"{url}/headers", headers={"x-probe": "1"})
        assert r.status_code == 200 and r.json()["x-probe"] == "1"


@pytest.mark.parametrize("direct", [True, False])
async def test_chunks_go_on_as_they_arrive(upstream: tuple[_Upstream, str], direct: bool) -> None:
    _, url = upstream
    async with _replica(url, direct) as (replica, _):
        stream = replica.generate_stream([1], {"max_tokens": 3, "slow": True}, "r")
        chunks = [c async for c in stream]
        assert [c.token_ids for c in chunks] == [[0], [1], [2]]


@pytest.mark.parametrize("direct", [True, False])
async def test_a_stream_closed_early_closes_its_connection(
    upstream: tuple[_Upstream, str], direct: bool
) -> None:
    state, url = upstream
    async with _replica(url, direct) as (replica, _):
        stream = replica.generate_stream([1], {"max_tokens": 100, "slow": True}, "r")
        async for _ in stream:
            break
        await stream.aclose()
        # vLLM aborts a streamed request when its connection goes: the server must see it.
        await asyncio.wait_for(state.abandoned.wait(), 5.0)


@pytest.mark.parametrize("direct", [True, False])
async def test_a_refused_connection_is_a_replica_failure(direct: bool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with _replica(f"http://127.0.0.1:{port}", direct) as (replica, _):
        with pytest.raises(ReplicaUnavailable):
            async for _ in replica.generate_stream([1], {"max_tokens": 1}, "r"):
                pass
        assert not await replica.healthy()


async def test_a_pooled_connection_the_replica_closed_is_replaced(
    upstream: tuple[_Upstream, str],
) -> None:
    """A replica's keep-alive timeout closes idle connections: the next request goes out on a
    new one instead of failing the call."""
    state, url = upstream
    async with _replica(url, True) as (replica, _):
        # Closed and noticed before the next request; closed as the next request goes out.
        for settle_s in (0.05, None, None):
            chunks = [c async for c in replica.generate_stream([1], {"max_tokens": 2}, "r")]
            assert [t for c in chunks for t in c.token_ids] == [0, 1]
            for transport in state.transports:
                transport.close()  # what the server does to an idle connection
            if settle_s is not None:
                await asyncio.sleep(settle_s)
        chunks = [c async for c in replica.generate_stream([1], {"max_tokens": 2}, "r")]
        assert [t for c in chunks for t in c.token_ids] == [0, 1]
        assert len(state.peers) == 4


async def test_a_request_cancelled_before_its_answer_closes_its_connection(
    upstream: tuple[_Upstream, str],
) -> None:
    state, url = upstream
    state.delay_s = 0.5
    async with _replica(url, True) as (replica, _):
        stream = replica.generate_stream([1], {"max_tokens": 5}, "r")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(stream), 0.1)
        await asyncio.wait_for(state.abandoned.wait(), 5.0)


async def test_a_server_error_is_a_replica_failure(upstream: tuple[_Upstream, str]) -> None:
    state, url = upstream
    state.status = 500
    async with _replica(url, True) as (replica, _):
        with pytest.raises(ReplicaUnavailable, match="HTTP 500"):
            async for _ in replica.generate_stream([1], {"max_tokens": 1}, "r"):
                pass
