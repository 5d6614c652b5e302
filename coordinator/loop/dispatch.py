"""The loop's own source of groups: it picks the tasks and runs the agents.

A group starts whenever the staleness gate allows it (staleness.py); each group runs n rollouts
through agent_runtime and goes to the loop once all have ended (with `screen_size` k, k
rollouts first: a group none of whose k scores above 0 is dropped there, the other n - k never
generated). Tasks are dispatched in a fixed order, group serial s running task
`tasks[s % len(tasks)]`, so a resumed run dispatches its pending serials again, then goes on
from the cursor (loop_state.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Sequence

from lockgate.agent_runtime import Environment, RolloutResult, Task, run_group
from lockgate.coordinator.config import AlgorithmSection, LoopSection
from lockgate.coordinator.loop.sources import GroupSink
from lockgate.gateway.client import GatewayClient
from lockgate.gateway.records.metrics_file import Count


class DispatchSource:
    def __init__(
        self,
        env: Environment,
        gateway: GatewayClient,
        config: LoopSection,
        algorithm: AlgorithmSection,
        *,
        redispatch: Sequence[int] = (),
    ) -> None:
        self.env = env
        self.gateway = gateway
        self.config = config
        self.algorithm = algorithm
        self._tasks = list(env.train_tasks())
        if not self._tasks:
            raise ValueError("the environment has no training tasks")
        self._redispatch = sorted(redispatch)

    def _serials(self, sink: GroupSink) -> Iterator[int]:
        yield from self._redispatch
        yield from itertools.count(sink.next_serial)

    async def run(self, sink: GroupSink) -> None:
        async with asyncio.TaskGroup() as tg:
            for serial in self._serials(sink):
                async with sink.version_changed:
                    await sink.version_changed.wait_for(
                        lambda: sink.controller.can_start(sink.version)
                    )
                    sink.controller.started()
                    dispatch_version = sink.version
                    # The cursor moves only once the group is really started (loop_state.py).
                    sink.started(serial)
                task = self._tasks[serial % len(self._tasks)]
                tg.create_task(
                    self._run_group(sink, serial, task, dispatch_version), name=f"group-{serial}"
                )

    async def _run_group(
        self, sink: GroupSink, serial: int, task: Task, dispatch_version: int
    ) -> None:
        group_id = f"g{serial}-{task.id}"
        metadata = {"dispatch_version": dispatch_version, "serial": serial}

        async def rollouts(n: int) -> list[RolloutResult]:
            return await run_group(
                self.gateway,
                self.env.agent,
                task,
                n,
                group_id=group_id,
                reward_fn=self.env.reward,
                timeout_s=self.config.rollout_timeout_s,
                metadata=metadata,
            )

        screen, size = self.algorithm.screen_size, self.config.group_size
        group = await sink.collect(
            task.id, group_id, dispatch_version, await rollouts(screen or size)
        )
        group.serial = serial
        if screen:
            if not any(r > 0 for r in group.rewards):
                sink.count(Count.GROUPS_SCREENED_OUT)
                await sink.release(serial)
                return
            rest = await sink.collect(
                task.id, group_id, dispatch_version, await rollouts(size - screen)
            )
            group.rollouts += rest.rollouts
            for why, count in rest.failures.items():
                group.failures[why] = group.failures.get(why, 0) + count
        await sink.offer(group)
