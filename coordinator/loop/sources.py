"""Where a run's finished groups come from, and what a source of them uses of the loop.

Two sources share the loop's one step pipeline (groups -> staleness bound -> advantages ->
train -> sync): the loop's own dispatcher (dispatch.py), which picks tasks and runs the agents
itself, and clients that create their own sessions and finish them with rewards
(client_rollouts.py). A source starts or learns of groups under the staleness gate and hands
each finished group to the sink; everything after that is the loop's and the same for both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from lockgate.agent_runtime import RolloutResult
from lockgate.coordinator.loop.groups import Group
from lockgate.coordinator.loop.staleness import StalenessController


class GroupSink(Protocol):
    """What a source uses of the loop (TrainingLoop is one)."""

    controller: StalenessController
    # Notified whenever the gate may admit more groups: a new version is served, a slot is freed.
    version_changed: asyncio.Condition

    @property
    def version(self) -> int:
        """The weight version the replicas serve."""
        ...

    @property
    def next_serial(self) -> int:
        """The serial of the next new group (loop_state.py's cursor)."""
        ...

    def started(self, serial: int) -> None:
        """Group `serial` started: the cursor moves past it, and it is pending until trained."""

    async def collect(
        self, task_id: str, group_id: str, version: int, results: Sequence[RolloutResult]
    ) -> Group:
        """A group of the finished rollouts' samples; failed ones counted and left out."""
        ...

    async def offer(self, group: Group) -> None:
        """Queue a finished group for training, or drop it (counted, its slot freed)."""

    async def release(self, serial: int) -> None:
        """A started group that yields nothing trainable frees its slot for a replacement."""

    def count(self, key: str, n: int = 1) -> None:
        """Add to one of the run's counters (`count/...` in the step records)."""


class GroupSource(Protocol):
    async def run(self, sink: GroupSink) -> None:
        """Hand finished groups to `sink` until cancelled (the run is over); rollouts still
        in flight then are abandoned, never trained on."""
