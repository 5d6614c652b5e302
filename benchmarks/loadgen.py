"""A closed-loop HTTP/1.1 load generator on raw asyncio sockets and httptools.

Each of `concurrency` keep-alive connections sends its next request as soon as the previous
answer has fully arrived (the last chunk of a chunked/SSE body included), so the request rate
is whatever the server sustains at that concurrency. httpx is not used here: at a few thousand
requests/s on one core its own per-request cost would be measured instead of the server's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httptools


@dataclass
class LoadResult:
    """Latencies (seconds) of the requests that ended inside the measured window."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    window_s: float = 0.0
    completed: int = 0  # every request that ended, warm-up included

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.window_s if self.window_s else 0.0


class _Client(asyncio.Protocol):
    """One keep-alive connection: send a request, wait for its complete answer, repeat."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError(f"connection lost: {exc}"))

    def on_message_complete(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(self._parser.get_status_code())

    async def request(self, raw: bytes) -> int:
        assert self._transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self._transport.write(raw)
        return await self._done


def http_request(host: str, port: int, method: str, path: str, body: bytes) -> bytes:
    """A complete HTTP/1.1 keep-alive request with a JSON body."""
    return (
        f"{method} {path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def run_load(
    host: str,
    port: int,
    request_for: Callable[[int], bytes],
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    max_requests: int | None = None,
) -> LoadResult:
    """Drive `concurrency` connections; connection i sends `request_for(i)` in a loop, for
    `warmup_s` unmeasured then `duration_s` measured, or until `max_requests` have ended."""
    loop = asyncio.get_running_loop()
    result = LoadResult()
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s

    sent = 0

    async def worker(i: int) -> None:
        nonlocal sent
        transport, client = await loop.create_connection(_Client, host, port)
        raw = request_for(i)
        try:
            while max_requests is None or sent < max_requests:
                sent += 1
                t0 = time.perf_counter()
                if t0 >= stop_at:
                    return
                status = await client.request(raw)
                t1 = time.perf_counter()
                result.completed += 1
                if t0 >= measure_from and t1 <= stop_at:
                    if status == 200:
                        result.latencies.append(t1 - t0)
                    else:
                        result.errors += 1
        finally:
            transport.close()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    result.window_s = min(duration_s, time.perf_counter() - measure_from)
    return result


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
