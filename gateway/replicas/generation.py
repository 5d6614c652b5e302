"""One model call's generation, across weight syncs and replica failures.

A call is generated in one or more *segments*. A segment is one streamed token-in/token-out
request to one replica, and it ends in one of three ways:

- a real finish (`stop` / `length`): the call is done;
- an interruption for a weight sync (the replica aborted it, or the sync controller cancelled
  it): every token received so far is kept, the call waits at the gate until the gateway
  serves again, then continues from prompt + those tokens with the remaining budget, under
  the new weights (or fails, when partial rollouts are off);
- a replica failure (refused, reset, 5xx): the tokens received so far are kept and the call
  continues on another replica at once.

The agent sees one response. Every token is kept exactly once, with its logprob and the weight
version that produced it. The caller consumes `run()`, which yields after every upstream chunk
so a streaming answer can forward deltas as they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from lockgate.gateway.errors import GatewayError, unavailable
from lockgate.gateway.replicas.adapters import AdapterSet
from lockgate.gateway.replicas.pause import PauseGate, Segment
from lockgate.gateway.replicas.pool import ReplicaPool
from lockgate.gateway.replicas.replica_client import ReplicaChunk, ReplicaClient, ReplicaUnavailable
from lockgate.gateway.schema import VersionSpan

log = logging.getLogger(__name__)

# A call interrupted more often than this is failing for a reason a retry will not fix.
MAX_SEGMENTS = 64


class CallInterrupted(GatewayError):
    """The call was cut by a weight sync and partial rollouts are off: it is not resumed."""

    def __init__(self) -> None:
        super().__init__(
            503,
            "the call was interrupted by a weight sync and partial rollouts are off",
            type="service_unavailable",
            code="interrupted",
        )


class StopWatch(Protocol):
    """Watches the tokens for a stop string (calls/stops.py's `StopScanner`)."""

    def scan(self, ids: Sequence[int], start: int) -> int | None:
        """The number of tokens to keep if a stop string completes in ids[start:], else None."""
        ...


@dataclass
class _SegmentEnd:
    kind: Literal["done", "cancelled", "replica_failed", "error"]
    error: BaseException | None = None


@dataclass
class _SegmentResult:
    """How one segment went: where its tokens start, how its stream ended, the replica's
    finish reason and its own per-token versions (when it labelled them all)."""

    start: int
    end: _SegmentEnd | None = None
    finish: str | None = None
    labelled: list[int] | None = None


@dataclass
class Sampled:
    """What a call has generated so far; complete once `finish_reason` is set."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # if asked
    finish_reason: str | None = None
    interruptions: int = 0
    failovers: int = 0
    replicas: list[str] = field(default_factory=list)

    def truncate(self, n: int) -> None:
        del self.token_ids[n:], self.logprobs[n:], self.token_versions[n:]
        del self.top_logprobs[n:]

    def spans(self) -> list[VersionSpan]:
        # Runs found on plain ints first: a model per span, not an assignment per token.
        runs: list[list[int]] = []  # [version, start, end]
        for i, v in enumerate(self.token_versions):
            if runs and runs[-1][0] == v:
                runs[-1][2] = i + 1
            else:
                runs.append([v, i, i + 1])
        return [VersionSpan(version=v, start=a, end=b) for v, a, b in runs]


def _labelled_versions(chunk: ReplicaChunk, n: int) -> list[int] | None:
    """Per-token versions from the replica's own spans, if they label all n tokens."""
    spans = chunk.weight_versions
    if not spans:
        return None
    out: list[int] = []
    for span in spans:
        try:
            version = int(span["version"])
        except (KeyError, TypeError, ValueError):
            return None
        out.extend([version] * (int(span["end"]) - int(span["start"])))
    return out if len(out) == n else None


def _hung(replica: ReplicaClient, stall_s: float) -> ReplicaUnavailable:
    return ReplicaUnavailable(
        f"{replica.url}: sent nothing for {stall_s:.0f}s and failed its health check"
    )


class CallGenerator:
    def __init__(
        self,
        gate: PauseGate,
        pool: ReplicaPool,
        *,
        session_id: str,
        prompt_ids: Sequence[int],
        sampling: dict[str, Any],
        partial_rollout: bool = True,
        stop: StopWatch | None = None,
        stall_s: float = 0.0,
        adapters: AdapterSet | None = None,
    ) -> None:
        self._gate = gate
        self._pool = pool
        self._session_id = session_id
        self._prompt_ids = prompt_ids
        self._sampling = sampling
        self._budget = int(sampling["max_tokens"])
        self._partial_rollout = partial_rollout
        self._constrained = "structured_outputs" in sampling
        self._stop = stop
        self._stall_s = stall_s
        # Adapter mode: each segment asks for its version's adapter, and its tokens carry that
        # version; the engine's label says nothing of adapters (replicas/adapters.py).
        self._adapters = adapters
        self.sampled = Sampled()
        self.finished = False

    async def run(self) -> AsyncIterator[int]:
        """Generate to a real finish; yields the number of tokens held after each burst of
        chunks (what arrived while the consumer was away). `finished` is set from the burst
        that carries the replica's real finish: no token comes after it."""
        s = self.sampled
        failed_replicas: set[str] = set()
        for _ in range(MAX_SEGMENTS):
            remaining = self._budget - len(s.token_ids)
            if remaining <= 0:
                s.finish_reason = "length"
                return
            segment, version = await self._gate.admit()
            try:
                replica = self._pick(version, failed_replicas)
                segment.replica = replica.url
                segment.constrained = self._constrained
                segment.offset = len(s.token_ids)
                result = _SegmentResult(start=len(s.token_ids))
                async with contextlib.aclosing(
                    self._segment(segment, replica, remaining)
                ) as arrivals:
                    async for arrived in arrivals:
                        held_before = len(s.token_ids)
                        if self._take(arrived, result, segment, replica.url, version):
                            # A stop string ended the call. Leaving the loop closes the
                            # stream: vLLM stops generating.
                            yield len(s.token_ids)
                            return
                        # What follows a real finish is only the stream's end: a consumer can
                        # hold this burst's update back and send it with the ending.
                        self.finished = result.finish in ("stop", "length")
                        if len(s.token_ids) > held_before:
                            yield len(s.token_ids)
            finally:
                self._gate.end(segment)
            if self._settle(result, replica, failed_replicas):
                return
        raise GatewayError(
            502,
            f"the call was cut {MAX_SEGMENTS} times without finishing",
            type="upstream_error",
            code="too_many_interruptions",
        )

    def _pick(self, version: int, failed_replicas: set[str]) -> ReplicaClient:
        replica = self._pool.pick(self._session_id, version, exclude=frozenset(failed_replicas))
        if replica is None:
            tried = f" (failed: {', '.join(sorted(failed_replicas))})"
            raise unavailable(
                "no healthy replica is available" + (tried if failed_replicas else "")
            )
        return replica

    def _take(
        self,
        arrived: list[ReplicaChunk | _SegmentEnd],
        result: _SegmentResult,
        segment: Segment,
        replica_url: str,
        version: int,
    ) -> bool:
        """Keep a burst's tokens; True when a stop string ended the call (cut there)."""
        s = self.sampled
        for item in arrived:
            if isinstance(item, _SegmentEnd):
                result.end = item
                continue
            if item.token_ids:
                if not s.replicas or s.replicas[-1] != replica_url:
                    s.replicas.append(replica_url)  # replicas that made tokens
                held = len(s.token_ids)
                s.token_ids.extend(item.token_ids)
                s.logprobs.extend(item.logprobs)
                s.token_versions.extend([version] * len(item.token_ids))
                if item.top_logprobs is not None:
                    s.top_logprobs.extend(item.top_logprobs)
                segment.tokens += len(item.token_ids)
                keep = self._stop.scan(s.token_ids, held) if self._stop else None
                if keep is not None:
                    s.truncate(keep)
                    s.finish_reason = "stop"
                    return True
            if item.finish_reason is not None:
                result.finish = item.finish_reason
                if self._adapters is None:
                    result.labelled = _labelled_versions(item, len(s.token_ids) - result.start)
        return False

    def _settle(
        self, result: _SegmentResult, replica: ReplicaClient, failed_replicas: set[str]
    ) -> bool:
        """After a segment: True when the call is done, False to go on with another
        segment; raises when the call fails."""
        s = self.sampled
        end, finish = result.end, result.finish
        assert end is not None
        if result.labelled is not None:
            # The replica's own labels win: in `keep` mode a frozen request continues
            # under the new weights within the same segment.
            s.token_versions[result.start :] = result.labelled

        if finish in ("stop", "length"):
            # The real finish arrived: a cut or a dropped connection while the stream was
            # closing takes nothing from the call.
            self._pool.record_success(replica)
            s.finish_reason = finish
            return True
        if end.kind == "error":
            assert end.error is not None
            raise end.error
        if self._constrained:
            # A grammar starts over on every new request: a constrained call cannot be
            # continued from its partial tokens, on this replica or another.
            raise GatewayError(
                503,
                "a constrained call (tool_choice required or named) was cut "
                f"({end.kind.replace('_', ' ')}) and cannot be continued; retry it",
                type="service_unavailable",
                code="interrupted",
            )
        if end.kind == "replica_failed":
            log.warning(
                "replica %s failed mid-call, continuing elsewhere: %s", replica.url, end.error
            )
            self._pool.mark_unhealthy(replica)
            failed_replicas.add(replica.url)
            s.failovers += 1
            return False
        failed_replicas.clear()
        self._pool.record_success(replica)
        if end.kind == "cancelled" or finish == "abort":
            s.interruptions += 1
            self._gate.count_interruption(len(s.token_ids) - result.start)
            if not self._partial_rollout:
                raise CallInterrupted()
            return False
        raise GatewayError(
            502,
            f"replica ended the call with '{finish}'",
            type="upstream_error",
            code="replica_error",
        )

    async def _segment(
        self, segment: Segment, replica: ReplicaClient, remaining: int
    ) -> AsyncIterator[list[ReplicaChunk | _SegmentEnd]]:
        """Stream one segment through a queue fed by its own task, in bursts: each step yields
        every chunk that arrived since the last, so a consumer that was busy (sending the
        previous update to its agent) takes what came meanwhile in one go.

        The task is what the sync controller cancels to cut a segment the replica did not abort
        in time; cancelling it closes the upstream stream, which aborts the request in vLLM.
        """
        queue: asyncio.Queue[ReplicaChunk | _SegmentEnd] = asyncio.Queue()
        sampling = {**self._sampling, "max_tokens": remaining}

        async def pump(prompt: list[int]) -> None:
            if self._adapters is None:
                stream = replica.generate_stream(prompt, sampling, request_id=segment.request_id)
            else:
                stream = self._adapters.stream(
                    replica, prompt, sampling, segment.request_id, segment.version
                )
            # The stream holds the prompt only until its request is encoded: thousands of ids
            # per call in flight, which no collection should have to walk (api/server.py).
            del prompt
            async with self._pool.lease(replica):
                async for chunk in stream:
                    queue.put_nowait(chunk)

        def ended(task: asyncio.Task[None]) -> None:
            # A done callback, not an except clause in pump(): a task cancelled before its
            # first step never runs its body, and the consumer must still hear the end.
            if task.cancelled():
                queue.put_nowait(_SegmentEnd("cancelled"))
            elif isinstance(exc := task.exception(), ReplicaUnavailable):
                queue.put_nowait(_SegmentEnd("replica_failed", exc))
            elif exc is not None:
                queue.put_nowait(_SegmentEnd("error", exc))
            else:
                queue.put_nowait(_SegmentEnd("done"))

        task = asyncio.create_task(
            pump([*self._prompt_ids, *self.sampled.token_ids]), name=f"segment-{segment.request_id}"
        )
        task.add_done_callback(ended)
        segment.task = task
        try:
            while True:
                first = await self._next_or_hung(queue, replica)
                if first is None:  # the replica hangs: the call goes on elsewhere
                    task.remove_done_callback(ended)
                    yield [_SegmentEnd("replica_failed", _hung(replica, self._stall_s))]
                    return
                arrived = [first]
                while not queue.empty():
                    arrived.append(queue.get_nowait())
                yield arrived
                if isinstance(arrived[-1], _SegmentEnd):  # always the last thing queued
                    return
        finally:
            if not task.done():
                task.cancel()
            await asyncio.wait([task])

    async def _next_or_hung(
        self, queue: asyncio.Queue[ReplicaChunk | _SegmentEnd], replica: ReplicaClient
    ) -> ReplicaChunk | _SegmentEnd | None:
        """The segment's next item, or None once its replica is found hanging: silent for
        `stall_s` while the gateway serves, then not answering its health check. A replica
        that answers is only slow (queued requests, a long prefill) and is waited on; one the
        gateway holds paused (a `keep` sync freezes its requests) is not checked at all."""
        while True:
            if self._stall_s <= 0:
                return await queue.get()
            try:
                return await asyncio.wait_for(queue.get(), self._stall_s)
            except TimeoutError:
                if self._gate.state == "serving" and not await replica.healthy():
                    return None
