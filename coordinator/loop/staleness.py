"""How stale a trained token may be: the dispatch gate, and the bound applied at consumption.

Two rules, both needed:

- The gate (AReaL-style capacity): with `max_staleness = η` and `B` groups per trainer step, a
  new group may start only while `groups_started < (version + η + 1) * B`, where `version` is
  the newest weight version the replicas serve. η = 0 is synchronous on-policy: the groups of
  step k+1 start only once the weights of step k are live.
- The gate bounds how far generation runs ahead, not how old a group is when it is trained:
  groups are consumed in completion order, so a slow group started at version v can still be
  waiting when faster groups of later versions have filled several batches (the main job with
  η = 1 trained tokens 2 versions old). The max-off-policy bound closes that: when step k
  consumes a group, every rollout holding a trained token older than `(k - 1) - bound` is
  dropped and counted (`rollouts_stale`), and the group goes on only if enough rollouts remain.

Staleness of a token trained at step k is `(k - 1) - version`: the trainer at step k starts
from the weights of version k - 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace

from lockgate.coordinator.loop.groups import Group


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


def oldest_allowed_version(step: int, max_off_policy: int) -> int:
    """The oldest weight version step `step` may train on under the bound."""
    return (step - 1) - max_off_policy


def drop_stale_rollouts(group: Group, step: int, max_off_policy: int | None) -> tuple[Group, int]:
    """The group without its rollouts older than the bound, and how many were dropped.

    A rollout goes as a whole: dropping only its old tokens would train on a continuation
    without the prefix that produced it. Rollouts with no trained token are kept (they carry
    no staleness).
    """
    if max_off_policy is None:
        return group, 0
    floor = oldest_allowed_version(step, max_off_policy)
    kept = [
        r
        for r in group.rollouts
        if all(
            v >= floor
            for s in r.samples.samples
            for v, m in zip(s.versions, s.loss_mask, strict=True)
            if m
        )
    ]
    return replace(group, rollouts=kept), len(group.rollouts) - len(kept)


def staleness_counts(step: int, versions: Iterable[int]) -> dict[str, int]:
    """Trained tokens per staleness ("0", "1", ...) for one step: the `staleness/hist` metric.

    Keys are strings because the record goes to JSON; `lockgate report` sums them over steps.
    """
    counts = Counter((step - 1) - v for v in versions)
    return {str(k): counts[k] for k in sorted(counts)}
