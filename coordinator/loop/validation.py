"""Validation: one greedy rollout per held-out task, with bounded concurrency.

The rollouts go through a second gateway that serves the same replicas with temperature 0
(the training gateway's sampling policy is the run's, temperature 1). The loop starts a round
right after a weight sync and makes the next sync wait for it, so a round never straddles a
weight change and no sync ever cuts a validation call; training rollouts and steps go on
meanwhile (see loop.py). The validation gateway's own version labels are not kept current (it
never syncs): the version a round validated is in its sessions' metadata and in `val/version`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any

from lockgate.agent_runtime import Environment, RolloutResult, Task, run_rollout
from lockgate.gateway.client import GatewayClient
from lockgate.gateway.records.metrics_file import Val


def val_tasks_of(env: Environment) -> list[Task]:
    """The environment's held-out tasks; `ValueError` when it has none."""
    make = getattr(env, "val_tasks", None)
    tasks = list(make()) if callable(make) else []
    if not tasks:
        raise ValueError(
            "loop.val_every is set but the environment has no val_tasks(): define it (a held-out "
            "task list) or set loop.val_every=0"
        )
    return tasks


def validation_metrics(
    results: Sequence[RolloutResult], version: int, elapsed_s: float
) -> dict[str, float]:
    """The `val/*` metrics of one round (failed rollouts count in `val/failed`, not the mean)."""
    rewards = [r.reward for r in results if r.status == "finished" and r.reward is not None]
    mean = sum(rewards) / len(rewards) if rewards else math.nan
    var = sum((x - mean) ** 2 for x in rewards) / len(rewards) if rewards else math.nan
    return {
        Val.VERSION: float(version),
        Val.REWARD_MEAN: mean,
        Val.REWARD_STD: math.sqrt(var),
        Val.REWARD_MIN: min(rewards, default=math.nan),
        Val.REWARD_MAX: max(rewards, default=math.nan),
        Val.TASKS: float(len(results)),
        Val.FAILED: float(len(results) - len(rewards)),
        Val.TIME_S: elapsed_s,
    }


async def run_validation(
    gateway: GatewayClient,
    env: Environment,
    tasks: Sequence[Task],
    *,
    version: int,
    concurrency: int,
    timeout_s: float,
) -> dict[str, float]:
    """One greedy rollout per task, at most `concurrency` at a time; returns `val/*` metrics."""
    started = time.monotonic()
    queue = list(reversed(tasks))
    results: list[RolloutResult] = []

    async def worker() -> None:
        # A few workers pull tasks: never one coroutine per task created up front.
        while queue:
            task = queue.pop()
            meta: dict[str, Any] = {"validation": True, "weights_version": version}
            results.append(
                await run_rollout(
                    gateway,
                    env.agent,
                    task,
                    group_id=f"val-v{version}-{task.id}",
                    reward_fn=env.reward,
                    timeout_s=timeout_s,
                    metadata=meta,
                )
            )

    async with asyncio.TaskGroup() as tg:
        for _ in range(min(concurrency, len(tasks))):
            tg.create_task(worker())
    return validation_metrics(results, version, time.monotonic() - started)
