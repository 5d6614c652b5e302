"""Which replica serves a call (pure policy, no I/O).

Sticky per session so a session's growing prefix stays in one replica's prefix cache; but a
sticky replica that is unhealthy, or overloaded, loses the session to the least-loaded one.
Overloaded is busier than the least-loaded healthy replica by more than `max_imbalance` calls
*and* more than `max_ratio` times the other replicas' mean. The least-loaded of many replicas is
an extreme draw: agents think between calls, so each replica's in-flight count swings by a few
calls, and the quietest of dozens sits far below the rest. Against it alone a bound of a few
calls moved many sessions (measured in docs/performance.md), each move a full re-prefill of the
session's history elsewhere, to dodge a queue that a continuous batch barely feels. The mean
moves little; a replica really carrying twice its share still sheds sessions.

A session that needs a replica (a new one, or one leaving its sticky replica) goes to the
fewest open sessions plus calls in flight, not to the fewest calls in flight: which replica is
quietest this instant is mostly which one's agents happen to be thinking, and they come back.
Placed by that draw, thousands of sessions left the busiest replica well above the mean in
generated tokens (docs/performance.md); counting what each replica holds spreads them evenly,
while a replica whose calls pile up (a slow one) still counts them and gets fewer. A burst of
new sessions, none of them in flight yet, spreads too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Load(Protocol):
    """What routing reads of a replica; the pool passes its own records, built for nothing."""

    @property
    def url(self) -> str: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def sessions(self) -> int: ...


@dataclass(frozen=True)
class ReplicaLoad:
    url: str
    healthy: bool
    in_flight: int
    sessions: int = 0  # sessions routed to it and not yet finished


def choose_replica(
    replicas: Sequence[Load],
    sticky: str | None,
    *,
    max_imbalance: int = 4,
    max_ratio: float = 2.0,
    exclude: frozenset[str] = frozenset(),
) -> str | None:
    candidates = [r for r in replicas if r.healthy and r.url not in exclude]
    if not candidates:
        return None
    least = min(candidates, key=lambda r: (r.in_flight, r.url))
    if sticky is not None:
        for r in candidates:
            if r.url == sticky:
                if r.in_flight <= least.in_flight + max_imbalance:
                    return r.url
                others = sum(c.in_flight for c in candidates) - r.in_flight
                if r.in_flight <= max_ratio * others / (len(candidates) - 1):
                    return r.url
    return min(candidates, key=lambda r: (r.sessions + r.in_flight, r.in_flight, r.url)).url
