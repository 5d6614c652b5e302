"""The gateway's serving state and the upstream requests (segments) in flight.

SERVING -> PAUSING -> PAUSED -> RESUMING -> SERVING. A segment may start only while SERVING;
a call that wants to start one otherwise waits here, inside the gateway, so neither vLLM's
queueing (0.32) nor its 503s (0.33) ever reach an agent. A wait longer than `max_wait_s` fails
the call with a 503. The sync controller (sync/controller.py) drives the transitions; this class only
holds the state and lets callers wait on it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from lockgate.gateway.errors import GatewayError

State = Literal["serving", "pausing", "paused", "resuming"]


@dataclass(eq=False)
class Segment:
    """One upstream generation request of a call."""

    request_id: str
    version: int
    replica: str | None = None
    task: asyncio.Task[None] | None = None
    offset: int = 0  # tokens the call already held when this segment started
    tokens: int = 0  # tokens this segment has produced
    cut: bool = False  # cancelled by the sync controller
    # Under a grammar: it cannot continue from its partial tokens (the grammar would restart),
    # so an `abort` sync lets it finish instead of cutting it.
    constrained: bool = False


class PausedTooLong(GatewayError):
    def __init__(self, waited_s: float) -> None:
        super().__init__(
            503,
            f"the gateway stayed paused for a weight sync longer than {waited_s:.0f}s",
            type="service_unavailable",
            code="paused",
        )


class PauseGate:
    def __init__(self, version: int = 0, max_wait_s: float = 1800.0) -> None:
        self.state: State = "serving"
        self.version = version
        self.waiting = 0
        self.segments: dict[str, Segment] = {}
        self.interruptions = 0  # segments cut by syncs, since start
        self.tokens_kept = 0  # tokens those segments had produced (all kept)
        self._max_wait_s = max_wait_s
        # An event, not a condition: a condition's waiters wake one per loop iteration (each
        # takes its lock in turn), so resuming N waiting calls took ~3N iterations of a loop
        # that was busy with everything else, and a pause right after queued behind them
        # (benchmarks/README.md, "Scale simulation"). An event
        # wakes them all at once; each checks the state again when it runs.
        self._serving = asyncio.Event()
        self._serving.set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self.segments)

    async def admit(self) -> tuple[Segment, int]:
        """Wait until serving, then register a segment; returns it with the serving version."""
        if self.state != "serving":
            self.waiting += 1
            started = time.monotonic()
            try:
                async with asyncio.timeout(self._max_wait_s):
                    # Serving may have ended again before this call ran: wait once more.
                    while self.state != "serving":
                        await self._serving.wait()
            except TimeoutError as exc:
                raise PausedTooLong(time.monotonic() - started) from exc
            finally:
                self.waiting -= 1
        segment = Segment(request_id=f"lg-{uuid.uuid4().hex}", version=self.version)
        self.segments[segment.request_id] = segment
        self._idle.clear()
        return segment, self.version

    def end(self, segment: Segment) -> None:
        self.segments.pop(segment.request_id, None)
        if not self.segments:
            self._idle.set()

    def count_interruption(self, tokens: int) -> None:
        self.interruptions += 1
        self.tokens_kept += tokens

    async def set_state(self, state: State, version: int | None = None) -> None:
        self.state = state
        if version is not None:
            self.version = version
        if state == "serving":
            self._serving.set()
        else:
            self._serving.clear()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no segment is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
