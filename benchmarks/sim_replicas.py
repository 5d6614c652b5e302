"""Stand-in vLLM replicas with a latency model, many on one event loop, for the scale simulation.

They speak the same wire protocol as `fixture_upstream.py` (what the gateway calls on a vLLM
replica with lockgate's routes: streamed `POST /inference/v1/generate`, `POST /lockgate/pause`,
`/resume`, `/health`, `/weight_info`, `/update_weight_version`, `/reset_prefix_cache`), but
where the fixture answers a whole generation at once, these model a serving engine:

- **Continuous batching.** Each replica runs an engine loop: one step every
  `step_base_s + step_per_seq_s * running` seconds, and every running request gets one token
  per step, sent as its own SSE event (as vLLM streams with a stream interval of 1).
- **Prefill and prefix caching.** A request waits `prefill_s_per_token` for every prompt token
  not in the replica's prefix cache before it joins the batch. The cache is a chained hash
  per 16-token block with an LRU bound, as vLLM's automatic prefix caching keys its blocks:
  a session routed back to the replica that served its previous turn prefills only its new
  tokens; one routed elsewhere prefills its whole history.
- **Pause.** `POST /lockgate/pause?mode=abort` waits for the running engine step to end (the
  engine pauses between steps), ends every running request with `finish_reason: "abort"`,
  and answers `{"engine_s": ...}` like lockgate's route (vllm_ext/routes.py); `/resume`
  starts the requests that arrived meanwhile.
- **Completions.** Filler tokens, then a tool call and the chat format's end-of-turn token
  (`finish_reason: "stop"`) as the request's last `max_tokens`: the agent sets the length, and
  a call continued after an abort (prompt + partial tokens, the remaining budget) ends where
  the uncut call would have.

Every request is logged (`RequestRecord`), and every pause (`PauseRecord`), for the metrics.
The session a request belongs to is recognised by its first `key_tokens` prompt tokens: the
simulation's agents start their system prompt with their session id.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import httptools
import orjson

from benchmarks.fixture_upstream import _chunk, _json_response

_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
_DONE = _chunk(b"data: [DONE]") + b"0\r\n\r\n"
BLOCK = 16  # vLLM's default KV block size: prefix caching works in whole blocks


@dataclass(frozen=True)
class EngineModel:
    """The latency model of one replica (defaults: a 7-8B model on one H100, roughly)."""

    step_base_s: float = 0.020  # one decode step with an almost empty batch
    step_per_seq_s: float = 0.0003  # what each running sequence adds to a step
    prefill_s_per_token: float = 0.00005  # uncached prompt tokens: ~20k tokens/s of prefill
    cache_blocks: int = 20_000  # ~320k tokens of KV cache (16-token blocks)
    pause_overhead_s: float = 0.001  # the engine's own work to pause, after the step ends


@dataclass
class RequestRecord:
    replica: int
    key: int  # the session, from the prompt's first tokens
    started: float
    prompt_len: int
    cached: int  # prompt tokens found in the prefix cache
    tokens: int = 0  # tokens generated
    finish: str = ""  # stop | abort | gone (the client closed the stream)


@dataclass
class PauseRecord:
    replica: int
    arrived: float
    answered: float
    aborted: int


@dataclass(eq=False)
class _Request:
    conn: _Connection
    record: RequestRecord
    prompt: list[int]
    budget: int
    handle: asyncio.TimerHandle | None = None  # its prefill, while it runs

    def write(self, data: bytes) -> None:
        self.conn.write(data)


class Completion:
    """The tokens a stand-in generates: filler, then `tail` (a tool call and the end of turn).

    Which token comes next depends only on the tokens still to go, so a call resubmitted after
    an abort (prompt + partial tokens, the remaining budget) ends exactly as an uncut one."""

    def __init__(self, filler: list[int], tail: list[int]) -> None:
        self.filler = filler
        self.tail = tail
        # One event per token, built once: at tens of thousands of events/s the stand-ins'
        # own JSON encoding would otherwise compete with the gateway for the CPU.
        self._events = {t: self._event(t, None) for t in (*filler, *tail)}

    @staticmethod
    def _event(token: int, finish: str | None, versions: Any = None) -> bytes:
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": [token],
            "logprobs": {"content": [{"token_id": token, "logprob": -0.5}]},
            "finish_reason": finish,
        }
        if versions is not None:
            choice["weight_versions"] = versions
        return _chunk(b"data: " + orjson.dumps({"choices": [choice]}))

    def token(self, i: int, remaining: int) -> int:
        if remaining <= len(self.tail):
            return self.tail[-remaining]
        return self.filler[i % len(self.filler)]

    def event(self, token: int) -> bytes:
        return self._events[token]

    def last(self, token: int, label: str, n: int) -> bytes:
        return self._event(token, "stop", [{"version": label, "start": 0, "end": n}])


_ABORT = _chunk(
    b"data: "
    + orjson.dumps(
        {
            "choices": [
                {"index": 0, "token_ids": [], "logprobs": {"content": []}, "finish_reason": "abort"}
            ]
        }
    )
)


def block_hashes(ids: list[int]) -> list[int]:
    """Chained hashes of the full 16-token blocks of `ids`: block i's hash covers ids[: 16(i+1)]."""
    out: list[int] = []
    h = 0
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(ids[start : start + BLOCK])))
        out.append(h)
    return out


class SimReplica:
    def __init__(
        self, index: int, model: EngineModel, completion: Completion, log: ReplicaLog
    ) -> None:
        self.index = index
        self.model = model
        self.completion = completion
        self.log = log
        self.label = "0"
        self.running: list[_Request] = []
        self.prefilling: set[_Request] = set()
        self.held: list[_Request] = []  # arrived while paused
        self.paused = False
        self._cache: OrderedDict[int, None] = OrderedDict()
        self._pause_waiters: list[tuple[_Connection, float]] = []
        self._in_step = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.server: asyncio.Server | None = None
        self.port = 0

    # -- the engine ------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._engine(), name=f"sim-engine-{self.index}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.server is not None:
            self.server.close()

    async def _engine(self) -> None:
        while True:
            if not self.running or self.paused:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._in_step = True
            await asyncio.sleep(
                self.model.step_base_s + self.model.step_per_seq_s * len(self.running)
            )
            self._in_step = False
            self._step()
            if self._pause_waiters:
                self._pause_now()

    def _step(self) -> None:
        c = self.completion
        still: list[_Request] = []
        for req in self.running:
            rec = req.record
            remaining = req.budget - rec.tokens
            token = c.token(rec.tokens, remaining)
            rec.tokens += 1
            req.prompt.append(token)
            if remaining == 1:
                req.write(c.last(token, self.label, rec.tokens) + _DONE)
                self._end(req, "stop")
            else:
                req.write(c.event(token))
                still.append(req)
        self.running = still

    def _end(self, req: _Request, finish: str) -> None:
        req.record.finish = finish
        req.conn.request = None
        self._insert(req.prompt)  # vLLM caches the full blocks of what was generated too

    # -- prefix cache ----------------------------------------------------------------------------

    def _lookup(self, hashes: list[int]) -> int:
        hit = 0
        for h in hashes:
            if h not in self._cache:
                break
            self._cache.move_to_end(h)
            hit += 1
        return hit * BLOCK

    def _insert(self, ids: list[int]) -> None:
        cache = self._cache
        for h in block_hashes(ids):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > self.model.cache_blocks:
            cache.popitem(last=False)

    # -- requests --------------------------------------------------------------------------------

    def generate(self, conn: _Connection, body: dict[str, Any]) -> None:
        prompt: list[int] = body["token_ids"]
        budget = int(body["sampling_params"]["max_tokens"])
        hashes = block_hashes(prompt)
        cached = self._lookup(hashes)
        key = hashes[self.log.key_blocks - 1] if len(hashes) >= self.log.key_blocks else 0
        record = RequestRecord(self.index, key, time.perf_counter(), len(prompt), cached)
        self.log.requests.append(record)
        req = _Request(conn, record, list(prompt), budget)
        conn.request = req
        conn.write(_SSE_HEAD)  # vLLM answers the headers at once, tokens follow
        if self.paused:
            self.held.append(req)
        else:
            self._prefill(req)

    def _prefill(self, req: _Request) -> None:
        self._insert(req.prompt)
        delay = self.model.prefill_s_per_token * (req.record.prompt_len - req.record.cached)
        self.prefilling.add(req)
        req.handle = asyncio.get_running_loop().call_later(delay, self._join, req)

    def _join(self, req: _Request) -> None:
        self.prefilling.discard(req)
        req.handle = None
        self.running.append(req)
        self._wake.set()

    def gone(self, req: _Request) -> None:
        """The client closed the stream: vLLM aborts the request."""
        if req.handle is not None:
            req.handle.cancel()
        self.prefilling.discard(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.held:
            self.held.remove(req)
        req.record.finish = "gone"

    def pause(self, conn: _Connection) -> None:
        self._pause_waiters.append((conn, time.perf_counter()))
        if not self._in_step:
            self._pause_now()

    def _pause_now(self) -> None:
        # The engine pauses between steps: everything running or prefilling is aborted with
        # its partial tokens, and nothing new is scheduled until /resume.
        self.paused = True
        aborted = 0
        for req in [*self.running, *self.prefilling]:
            if req.handle is not None:
                req.handle.cancel()
                req.handle = None
            req.write(_ABORT + _DONE)
            self._end(req, "abort")
            aborted += 1
        self.running, self.prefilling = [], set()
        waiters, self._pause_waiters = self._pause_waiters, []
        loop = asyncio.get_running_loop()
        for conn, arrived in waiters:
            loop.call_later(self.model.pause_overhead_s, self._answer_pause, conn, arrived, aborted)

    def _answer_pause(self, conn: _Connection, arrived: float, aborted: int) -> None:
        now = time.perf_counter()
        self.log.pauses.append(PauseRecord(self.index, arrived, now, aborted))
        conn.write(_json_response({"status": "paused", "mode": "abort", "engine_s": now - arrived}))

    def resume(self) -> None:
        self.paused = False
        held, self.held = self.held, []
        for req in held:
            self._prefill(req)
        self._wake.set()


@dataclass
class ReplicaLog:
    key_blocks: int  # the block whose chained hash names a session (covers its id)
    requests: list[RequestRecord] = field(default_factory=list)
    pauses: list[PauseRecord] = field(default_factory=list)


class _Connection(asyncio.Protocol):
    def __init__(self, replica: SimReplica) -> None:
        self._replica = replica
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []
        self.request: _Request | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self.request is not None:
            self._replica.gone(self.request)
            self.request = None

    def write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        replica = self._replica
        path = self._url.split(b"?", 1)[0]
        body = b"".join(self._body)
        self._url, self._body = b"", []
        if path == b"/inference/v1/generate":
            replica.generate(self, orjson.loads(body))
        elif path == b"/lockgate/pause":
            replica.pause(self)
        elif path == b"/resume":
            replica.resume()
            self.write(_json_response({}))
        elif path == b"/weight_info":
            self.write(_json_response({"weight_version": replica.label}))
        elif path == b"/update_weight_version":
            replica.label = str(orjson.loads(body)["new_version"])
            self.write(_json_response({}))
        else:  # /health, /reset_prefix_cache: nothing to model
            self.write(_json_response({}))


async def start_replicas(
    n: int, model: EngineModel, completion: Completion, log: ReplicaLog
) -> list[SimReplica]:
    """`n` stand-ins on this loop, each on a port of its own the kernel picks (`.port`): a port
    found free and bound later can be taken meanwhile by anything else on the machine."""
    loop = asyncio.get_running_loop()
    replicas = []
    for i in range(n):
        replica = SimReplica(i, model, completion, log)
        replica.server = await loop.create_server(
            lambda r=replica: _Connection(r), "127.0.0.1", 0, backlog=4096
        )
        replica.port = replica.server.sockets[0].getsockname()[1]
        replica.start()
        replicas.append(replica)
    return replicas
