"""The dispatch gate that bounds how stale a trained sample can be (AReaL-style capacity).

With `max_staleness = η` and `B` groups per trainer step, a new group may start only while
`groups_started < (version + η + 1) * B`, where `version` is the newest weight version the
replicas serve. η = 0 is synchronous on-policy: the groups of step k+1 start only once the
weights of step k are live.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessController:
    groups_per_step: int
    max_staleness: int
    groups_started: int = 0

    def __post_init__(self) -> None:
        if self.groups_per_step < 1:
            raise ValueError("groups_per_step must be at least 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")

    def capacity(self, version: int) -> int:
        return (version + self.max_staleness + 1) * self.groups_per_step

    def can_start(self, version: int) -> bool:
        return self.groups_started < self.capacity(version)

    def started(self) -> None:
        self.groups_started += 1

    def cancelled(self) -> None:
        """A started group that produced nothing trainable frees its slot for a replacement."""
        self.groups_started -= 1
