"""CallGenerator edge cases on an in-memory upstream: what a cut or a dropped stream does to a
segment whose real finish has already arrived."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from lockgate.gateway.errors import GatewayError
from lockgate.gateway.replicas.generation import CallGenerator
from lockgate.gateway.replicas.pause import PauseGate, Segment
from lockgate.gateway.replicas.pool import ReplicaPool
from lockgate.gateway.replicas.replica_client import ReplicaChunk, ReplicaClient, parse_events

TOKENS = [5, 6, 7]


def _finish_line() -> bytes:
    choice = {
        "index": 0,
        "token_ids": TOKENS,
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in TOKENS]},
        "finish_reason": "length",
    }
    return b"data: " + json.dumps({"request_id": "x", "choices": [choice]}).encode() + b"\n\n"


def _upstream(after_finish: str) -> httpx.MockTransport:
    """Sends every token with the finish, then hangs or drops instead of ending the stream."""

    async def body() -> AsyncIterator[bytes]:
        yield _finish_line()
        if after_finish == "hang":
            await asyncio.sleep(30)
        raise httpx.ReadError("connection reset")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    return httpx.MockTransport(handler)


async def _generate(after_finish: str, cut: bool) -> tuple[CallGenerator, PauseGate]:
    gate = PauseGate()
    async with httpx.AsyncClient(transport=_upstream(after_finish)) as http:
        pool = ReplicaPool(["http://replica"], http)
        gen = CallGenerator(
            gate, pool, session_id="s", prompt_ids=[1, 2], sampling={"max_tokens": 8}
        )
        async for held in gen.run():
            if cut and held == len(TOKENS):
                # What the sync controller does to a segment in flight.
                for segment in gate.segments.values():
                    assert segment.task is not None
                    segment.task.cancel()
    return gen, gate


async def test_a_cut_after_the_real_finish_is_not_an_interruption() -> None:
    gen, gate = await asyncio.wait_for(_generate("hang", cut=True), 10)
    assert gen.sampled.token_ids == TOKENS
    assert gen.sampled.finish_reason == "length"
    assert gen.sampled.interruptions == 0
    assert gate.interruptions == 0 and not gate.segments


async def test_a_connection_dropped_after_the_real_finish_is_not_a_failover() -> None:
    gen, _ = await asyncio.wait_for(_generate("drop", cut=False), 10)
    assert gen.sampled.token_ids == TOKENS
    assert gen.sampled.finish_reason == "length"
    assert gen.sampled.failovers == 0
    assert gen.sampled.replicas == ["http://replica"]


class _CutFirstSegmentBeforeItStarts(PauseGate):
    """Cancels the first segment's task in the loop turn in which it is created, before its
    first step: what a sync's cut does to a call admitted just before the pause."""

    async def admit(self) -> tuple[Segment, int]:
        segment, version = await super().admit()
        if self.interruptions == 0 and not getattr(self, "cut_once", False):
            self.cut_once = True
            asyncio.get_running_loop().call_soon(lambda: segment.task and segment.task.cancel())
        return segment, version


async def test_a_segment_cut_before_its_request_starts_is_an_interruption_not_a_hang() -> None:
    gate = _CutFirstSegmentBeforeItStarts()
    async with httpx.AsyncClient(transport=_upstream("drop")) as http:
        pool = ReplicaPool(["http://replica"], http)
        gen = CallGenerator(
            gate, pool, session_id="s", prompt_ids=[1, 2], sampling={"max_tokens": 8}
        )

        async def consume() -> None:
            async for _ in gen.run():
                pass

        await asyncio.wait_for(consume(), 10)
    assert gen.sampled.interruptions == 1
    assert gen.sampled.token_ids == TOKENS and gen.sampled.finish_reason == "length"


async def test_a_burst_of_new_sessions_is_spread_over_the_replicas() -> None:
    async with httpx.AsyncClient(transport=_upstream("drop")) as http:
        pool = ReplicaPool(["http://a", "http://b"], http)
        picked = [pool.pick(f"s{i}", 0) for i in range(6)]
        assert [c.url for c in picked if c] == ["http://a", "http://b"] * 3
        # Sticky afterwards, and a finished session frees its place.
        assert pool.pick("s0", 0).url == "http://a"  # type: ignore[union-attr]
        pool.forget_session("s0")
        pool.forget_session("s2")
        assert pool.pick("new", 0).url == "http://a"  # type: ignore[union-attr]


def _event(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _token(token: int, finish: str | None = None, **extra: object) -> bytes:
    choice = {
        "token_ids": [token],
        "logprobs": {"content": [{"token_id": token, "logprob": -float(token)}]},
        "finish_reason": finish,
        **extra,
    }
    return _event({"choices": [choice]})


async def _chunks(body: bytes) -> tuple[list[ReplicaChunk], BaseException | None]:
    """What a replica client yields for an upstream body sent as one piece, and how it ends."""
    transport = httpx.MockTransport(lambda _: httpx.Response(200, content=body))
    out: list[ReplicaChunk] = []
    async with httpx.AsyncClient(transport=transport) as http:
        try:
            async for chunk in ReplicaClient("http://replica", http).generate_stream([1], {}, "r"):
                out.append(chunk)
        except Exception as exc:
            return out, exc
    return out, None


async def test_events_that_arrive_together_are_one_chunk() -> None:
    labels = [{"version": 3, "start": 0, "end": 3}]
    body = _token(5) + _token(6) + _token(7, "stop", weight_versions=labels) + b"data: [DONE]\n\n"
    chunks, error = await _chunks(body)
    assert error is None
    assert chunks == [
        ReplicaChunk(
            token_ids=[5, 6, 7],
            logprobs=[-5.0, -6.0, -7.0],
            finish_reason="stop",
            weight_versions=labels,
        )
    ]


async def test_an_error_event_keeps_the_tokens_that_came_before_it() -> None:
    chunks, error = await _chunks(_token(5) + _token(6) + _event({"error": "engine died"}))
    assert [c.token_ids for c in chunks] == [[5, 6]]
    assert isinstance(error, GatewayError) and "engine died" in error.message


def test_top_logprobs_come_by_rank_and_a_count_mismatch_is_an_error() -> None:
    entry = {
        "token_id": 5,
        "logprob": -0.7,
        "top_logprobs": [
            {"token_id": 5, "logprob": -0.7},
            {"token_id": 9, "logprob": -0.2},
        ],
    }
    plain = {"choices": [{"token_ids": [6], "logprobs": {"content": [{"logprob": -1.0}]}}]}
    with_top = {"choices": [{"token_ids": [5], "logprobs": {"content": [entry]}}]}
    chunk, error = parse_events([json.dumps(plain).encode(), json.dumps(with_top).encode()])
    assert error is None and chunk is not None
    assert chunk.token_ids == [6, 5] and chunk.logprobs == [-1.0, -0.7]
    assert chunk.top_logprobs == [[(9, -0.2), (5, -0.7)]]
    bad = {"choices": [{"token_ids": [1, 2], "logprobs": {"content": [{"logprob": -1.0}]}}]}
    chunk, error = parse_events([json.dumps(plain).encode(), json.dumps(bad).encode()])
    assert chunk is not None and chunk.token_ids == [6]
    assert error is not None and "2 tokens but 1 logprobs" in error.message


def _replicas_one_hanging(healthy_while_silent: bool) -> httpx.MockTransport:
    """`http://first` sends two tokens, then nothing (answering /health or not); `http://second`
    sends the rest of the call."""

    async def hanging() -> AsyncIterator[bytes]:
        yield _token(5) + _token(6)
        await asyncio.sleep(30)

    async def slow() -> AsyncIterator[bytes]:
        yield _token(5) + _token(6)
        await asyncio.sleep(0.5)  # a long prefill, a queue: silence, then tokens again
        yield _token(7, "stop") + b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        first = request.url.host == "first"
        if request.url.path == "/health":
            if first and not healthy_while_silent:
                raise httpx.ConnectTimeout("stopped")
            return httpx.Response(200)
        if first:
            return httpx.Response(200, content=slow() if healthy_while_silent else hanging())
        return httpx.Response(200, content=_token(7, "stop") + b"data: [DONE]\n\n")

    return httpx.MockTransport(handler)


async def _generate_with_stall_checks(
    healthy_while_silent: bool,
) -> tuple[CallGenerator, ReplicaPool]:
    async with httpx.AsyncClient(transport=_replicas_one_hanging(healthy_while_silent)) as http:
        pool = ReplicaPool(["http://first", "http://second"], http)
        gen = CallGenerator(
            PauseGate(),
            pool,
            session_id="s",
            prompt_ids=[1, 2],
            sampling={"max_tokens": 8},
            stall_s=0.1,
        )
        async for _ in gen.run():
            pass
    return gen, pool


async def test_a_hung_replica_is_left_and_the_call_goes_on_elsewhere_with_its_tokens() -> None:
    gen, pool = await asyncio.wait_for(_generate_with_stall_checks(False), 10)
    assert gen.sampled.token_ids == [5, 6, 7] and gen.sampled.finish_reason == "stop"
    assert gen.sampled.replicas == ["http://first", "http://second"]
    assert gen.sampled.failovers == 1
    assert [c.url for c in pool.healthy_clients()] == ["http://second"]


async def test_a_silent_replica_that_answers_its_health_check_is_waited_on() -> None:
    gen, pool = await asyncio.wait_for(_generate_with_stall_checks(True), 10)
    assert gen.sampled.token_ids == [5, 6, 7] and gen.sampled.finish_reason == "stop"
    assert gen.sampled.replicas == ["http://first"] and gen.sampled.failovers == 0
    assert len(pool.healthy_clients()) == 2


async def test_a_health_check_that_raises_fails_that_replica_and_the_checks_go_on() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "odd":
            raise ValueError("not a transport error")  # what no check should end the loop on
        return httpx.Response(200)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        pool = ReplicaPool(["http://odd", "http://fine"], http, health_interval_s=0.01)
        fine = next(c for c in pool.clients if c.url == "http://fine")
        pool.mark_unhealthy(fine)
        pool.start()
        try:
            for _ in range(500):
                if [c.url for c in pool.healthy_clients()] == ["http://fine"]:
                    break
                await asyncio.sleep(0.01)
            assert [c.url for c in pool.healthy_clients()] == ["http://fine"]
            assert pool._health_task is not None and not pool._health_task.done()
        finally:
            await pool.stop()
