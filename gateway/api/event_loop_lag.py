"""How late the gateway's event loop runs: a heartbeat that times its own wake-ups.

Every call the gateway serves shares one event loop, so anything that stops the loop (a blocking
call, a long garbage collection, the process not getting a core on a busy machine) delays every
call and every weight sync at once, and shows up nowhere else. A task sleeps `interval_s` at a
time and records how much later than asked it woke up: into the loop-lag histogram of
`/metrics`, and as a warning in the log when one stall passes `warn_s`. One wake-up per
`interval_s` is all it costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class LoopLagMonitor:
    def __init__(
        self, observe: Callable[[float], None], interval_s: float = 0.1, warn_s: float = 0.25
    ) -> None:
        self._observe = observe
        self.interval_s = interval_s
        self.warn_s = warn_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="loop-lag-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, loop.time() - due)
            self._observe(lag)
            if lag > self.warn_s:
                log.warning(
                    "the event loop ran %.0f ms late: every call waited that long (a blocking "
                    "call, a long garbage collection, or no CPU for this process)",
                    lag * 1e3,
                )
