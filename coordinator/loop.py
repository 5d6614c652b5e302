"""The training loop: dispatch groups under the staleness bound, train, sync weights.

Three supervised coroutines share one TaskGroup, so any failure stops the run with its
traceback instead of being lost in a done-callback:

- the dispatcher starts a group whenever the staleness controller allows it;
- each group runs n rollouts through agent_runtime, fetches their samples and queues the group;
- the trainer side takes B groups per step, trains, and after every `sync_every` steps pauses
  the gateway, loads the new weights on every replica and resumes at the new version.

Synchronous (η = 0), one-step-off (η = 1) and fully-async (η > 1) runs share this one step
pipeline; only the gate differs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lockgate.agent_runtime import Environment, RolloutResult, Task, run_group
from lockgate.coordinator.config import LoopSection, SyncSection
from lockgate.coordinator.groups import Group, Rollout, drop_reason, group_to_train_samples
from lockgate.coordinator.metrics import MetricsLog
from lockgate.coordinator.staleness import StalenessController
from lockgate.coordinator.trainer_process import TrainerProcess
from lockgate.gateway.client import GatewayClient, GatewayClientError
from lockgate.trainer.batch import StepResult, TrainBatch

log = logging.getLogger(__name__)


class SyncFailed(RuntimeError):
    """No replica took the new weights; the run stops, still serving the old version."""


@dataclass
class RunSummary:
    steps: int
    rewards: list[float]  # mean reward of each step's batch
    version: int
    elapsed_s: float
    counters: dict[str, int] = field(default_factory=dict)

    def first_last(self, k: int = 3) -> tuple[float, float]:
        k = max(1, min(k, len(self.rewards) // 2 or 1))
        first = self.rewards[:k]
        last = self.rewards[-k:]
        return sum(first) / len(first), sum(last) / len(last)


class TrainingLoop:
    def __init__(
        self,
        config: LoopSection,
        env: Environment,
        gateway: GatewayClient,
        trainer: TrainerProcess,
        metrics: MetricsLog,
        *,
        sync: SyncSection | None = None,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.sync = sync or SyncSection()
        self.env = env
        self.gateway = gateway
        self.trainer = trainer
        self.metrics = metrics
        self.version = 0
        self.controller = StalenessController(config.groups_per_step, config.max_staleness)
        self._tasks = _task_cycle(env.train_tasks())
        self._ready: asyncio.Queue[Group] = asyncio.Queue()
        self._version_changed = asyncio.Condition()
        self._counters: Counter[str] = Counter()
        self._gen_tokens = 0
        # Throughput is measured between step records, over everything collected meanwhile
        # (groups collected while the previous step trained count too).
        self._rate_mark = (time.monotonic(), 0)
        self._seed = seed

    async def run(self) -> RunSummary:
        started = time.monotonic()
        rewards: list[float] = []
        async with asyncio.TaskGroup() as tg:
            dispatcher = tg.create_task(self._dispatch(tg), name="dispatcher")
            try:
                for step in range(1, self.config.steps + 1):
                    rewards.append(await self._step(step))
            finally:
                dispatcher.cancel()
        return RunSummary(
            steps=len(rewards),
            rewards=rewards,
            version=self.version,
            elapsed_s=time.monotonic() - started,
            counters=dict(self._counters),
        )

    # -- generation side ------------------------------------------------------------------------

    async def _dispatch(self, tg: asyncio.TaskGroup) -> None:
        groups: set[asyncio.Task[None]] = set()
        try:
            for serial in itertools.count():
                async with self._version_changed:
                    await self._version_changed.wait_for(
                        lambda: self.controller.can_start(self.version)
                    )
                    self.controller.started()
                    dispatch_version = self.version
                task = next(self._tasks)
                t = tg.create_task(
                    self._run_group(task, f"g{serial}-{task.id}", dispatch_version),
                    name=f"group-{serial}",
                )
                groups.add(t)
                t.add_done_callback(groups.discard)
        except asyncio.CancelledError:
            # The run is over: rollouts still in flight are abandoned, not trained on.
            for t in list(groups):
                t.cancel()
            raise

    async def _run_group(self, task: Task, group_id: str, dispatch_version: int) -> None:
        results = await run_group(
            self.gateway,
            self.env.agent,
            task,
            self.config.group_size,
            group_id=group_id,
            reward_fn=self.env.reward,
            timeout_s=self.config.rollout_timeout_s,
            metadata={"dispatch_version": dispatch_version},
        )
        group = await self._collect(task, group_id, dispatch_version, results)
        reason = drop_reason(
            group,
            min_group_size=self.config.min_group_size,
            drop_zero_variance=self.config.drop_zero_variance,
        )
        if reason is not None:
            self._counters[f"groups_dropped/{reason}"] += 1
            async with self._version_changed:
                self.controller.cancelled()  # frees the slot so a replacement group starts
                self._version_changed.notify_all()
            return
        await self._ready.put(group)

    async def _collect(
        self, task: Task, group_id: str, dispatch_version: int, results: Sequence[RolloutResult]
    ) -> Group:
        group = Group(task.id, group_id, dispatch_version, rollouts=[])
        for result in results:
            if result.status != "finished" or result.reward is None:
                reason = (result.error or "unknown").split(":")[0]
                group.failures[reason] = group.failures.get(reason, 0) + 1
                self._counters["rollouts_failed"] += 1
                continue
            samples = await self.gateway.samples(result.session_id)
            self._counters["rerender_splits"] += samples.splits
            self._gen_tokens += sum(sum(s.loss_mask) for s in samples.samples)
            group.rollouts.append(Rollout(result.reward, samples))
        return group

    # -- trainer side ---------------------------------------------------------------------------

    async def _step(self, step: int) -> float:
        wait_started = time.monotonic()
        groups = [await self._ready.get() for _ in range(self.config.groups_per_step)]
        wait_s = time.monotonic() - wait_started

        samples = [
            s
            for g in groups
            for s in group_to_train_samples(g, estimator=self.config.advantage_estimator)
        ]
        # The trainer at step k starts from weights version k-1: staleness counts versions behind.
        staleness = [(step - 1) - v for g in groups for v in g.token_versions()]
        result: StepResult = await self.trainer.train_step(TrainBatch(step=step, samples=samples))
        train_s = result.metrics.get("step_time_s", 0.0)

        sync: dict[str, float] = {"time/sync_s": 0.0}
        if step % self.config.sync_every == 0:
            sync = await self._sync(result.weights_dir, step)

        rewards = [r for g in groups for r in g.rewards]
        reward_mean = sum(rewards) / len(rewards)
        now = time.monotonic()
        mark_time, mark_tokens = self._rate_mark
        self._rate_mark = (now, self._gen_tokens)
        record: dict[str, Any] = {
            "step": step,
            "version": self.version,
            "reward/mean": reward_mean,
            "reward/min": min(rewards),
            "reward/max": max(rewards),
            "batch/groups": len(groups),
            "batch/samples": len(samples),
            "batch/loss_tokens": sum(sum(s.loss_mask) for s in samples),
            "staleness/mean": sum(staleness) / max(len(staleness), 1),
            "staleness/max": max(staleness, default=0),
            "staleness/min_version": min((step - 1) - s for s in staleness) if staleness else 0,
            "perf/gen_tokens_per_s": (self._gen_tokens - mark_tokens) / max(now - mark_time, 1e-9),
            "time/step_s": now - mark_time,
            "time/wait_for_groups_s": wait_s,
            "time/train_s": train_s,
            **sync,
            **{f"train/{k}": v for k, v in result.metrics.items()},
            **{f"count/{k}": v for k, v in self._counters.items()},
        }
        self.metrics.write(record)
        return reward_mean

    async def _sync(self, weights_dir: str, version: int) -> dict[str, float]:
        """Pause (abort | keep | drain) -> load on every replica and verify -> resume.

        A replica that fails to load leaves the rotation (the gateway's doing); if none loads,
        the gateway resumes at the version the replicas still hold and the run stops, saying
        which version is being served, rather than train on while serving stale weights.
        """
        started = time.monotonic()
        pause = await self.gateway.pause(self.sync.mode, self.sync.pause_timeout_s)
        try:
            load = await self.gateway.load_weights(weights_dir, version)
        except GatewayClientError as exc:
            await self.gateway.resume(self.version)
            raise SyncFailed(
                f"weight sync to version {version} failed; replicas still serve version "
                f"{self.version}: {exc.message}"
            ) from exc
        except BaseException:
            await self.gateway.resume(self.version)
            raise
        if load.failed:
            self._counters["replicas_dropped"] += len(load.failed)
            log.warning(
                "replicas out of rotation after failing to load %d: %s", version, load.failed
            )
        await self.gateway.resume(version)
        async with self._version_changed:
            self.version = version
            self._version_changed.notify_all()
        self._counters["interrupted_segments"] += pause.interrupted
        self._counters["interrupted_tokens_kept"] += pause.tokens_kept
        return {
            "time/sync_s": time.monotonic() - started,
            "sync/pause_latency_s": pause.latency_s,
            "sync/load_s": load.load_s,
            "sync/interrupted": float(pause.interrupted),
            "sync/tokens_kept": float(pause.tokens_kept),
        }


def _task_cycle(tasks: Sequence[Task]):  # type: ignore[no-untyped-def]
    if not tasks:
        raise ValueError("the environment has no training tasks")
    return itertools.cycle(tasks)
