"""The gateway's serving state: new calls wait while a weight sync holds the gate.

SERVING -> PAUSING (no new dispatches; in-flight calls drain) -> PAUSED -> SERVING on resume.
Calls that arrive while paused wait inside the gateway, so neither vLLM's queueing (0.32) nor
its 503s (0.33) ever reach the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Literal

from lockgate.gateway.errors import GatewayError

State = Literal["serving", "pausing", "paused"]


class PauseGate:
    def __init__(self, version: int = 0, max_wait_s: float = 1800.0) -> None:
        self.state: State = "serving"
        self.version = version
        self.in_flight = 0
        self.waiting = 0
        self._max_wait_s = max_wait_s
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[int]:
        """Hold a dispatch slot; yields the weight version the call is dispatched under."""
        async with self._cond:
            if self.state != "serving":
                self.waiting += 1
                try:
                    await asyncio.wait_for(
                        self._cond.wait_for(lambda: self.state == "serving"), self._max_wait_s
                    )
                except TimeoutError as exc:
                    raise GatewayError(
                        503,
                        f"the gateway stayed paused for a weight sync longer than {self._max_wait_s:.0f}s",
                        type="service_unavailable",
                        code="paused",
                    ) from exc
                finally:
                    self.waiting -= 1
            self.in_flight += 1
            version = self.version
        try:
            yield version
        finally:
            async with self._cond:
                self.in_flight -= 1
                self._cond.notify_all()

    async def pause(self, timeout_s: float) -> None:
        """Stop admitting calls and wait until the in-flight ones have finished."""
        async with self._cond:
            if self.state == "serving":
                self.state = "pausing"
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.in_flight == 0), timeout_s)
            except TimeoutError as exc:
                raise GatewayError(
                    504,
                    f"{self.in_flight} calls still in flight after {timeout_s:.0f}s of draining",
                    type="timeout",
                    code="drain_timeout",
                ) from exc
            self.state = "paused"

    async def resume(self, version: int) -> None:
        async with self._cond:
            self.version = version
            self.state = "serving"
            self._cond.notify_all()
