"""Per-session admission: how many generation calls one session may have in flight, and how
fast it may start new ones.

One runaway agent (a loop that fires calls without awaiting them, a retry storm) must not take
the replicas' capacity from every other session of the run. A call over either bound gets a
429 in OpenAI's shape (`rate_limit_exceeded`), before anything is rendered or recorded, so the
agent's SDK backs off and retries as it does against OpenAI itself.

Pure bookkeeping with an injected clock; the routes hold a slot from admission until the call's
answer (a stream's last chunk) has gone out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lockgate.gateway.errors import GatewayError


def rate_limited(message: str) -> GatewayError:
    return GatewayError(429, message, type="requests", code="rate_limit_exceeded")


@dataclass
class _Bucket:
    tokens: float
    stamp: float


@dataclass
class SessionAdmission:
    """`max_in_flight` calls per session at once (0: no bound); `per_minute` new calls per
    session per minute, as a token bucket that allows bursts of `burst` (0: no rate bound)."""

    max_in_flight: int = 0
    per_minute: float = 0.0
    burst: int = 1
    clock: Callable[[], float] = time.monotonic
    _in_flight: dict[str, int] = field(default_factory=dict)
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def admit(self, session_id: str) -> Callable[[], None]:
        """Take a slot for one call of `session_id`, or raise the 429; returns its release (safe
        to call more than once)."""
        held = self._in_flight.get(session_id, 0)
        if self.max_in_flight and held >= self.max_in_flight:
            raise rate_limited(
                f"session has {held} calls in flight, the most this gateway allows "
                f"(limits.max_calls_in_flight_per_session); wait for one to finish"
            )
        if self.per_minute:
            self._take_token(session_id)
        self._in_flight[session_id] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self._in_flight.get(session_id, 1) - 1
            if left > 0:
                self._in_flight[session_id] = left
            else:
                self._in_flight.pop(session_id, None)

        return release

    def in_flight(self, session_id: str) -> int:
        return self._in_flight.get(session_id, 0)

    def forget(self, session_id: str) -> None:
        """Drop a finished session's rate bucket (its in-flight count drains by itself)."""
        self._buckets.pop(session_id, None)

    def _take_token(self, session_id: str) -> None:
        now = self.clock()
        bucket = self._buckets.get(session_id)
        if bucket is None:
            bucket = self._buckets[session_id] = _Bucket(float(self.burst), now)
        rate = self.per_minute / 60.0
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.stamp) * rate)
        bucket.stamp = now
        if bucket.tokens < 1.0:
            wait = (1.0 - bucket.tokens) / rate
            raise rate_limited(
                f"session is over {self.per_minute:g} calls per minute "
                f"(limits.max_calls_per_minute_per_session); retry in {wait:.1f} s"
            )
        bucket.tokens -= 1.0
