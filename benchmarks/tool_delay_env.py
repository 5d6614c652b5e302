"""Benchmark environment: a multi-turn agent whose tool calls take long-tailed time.

Each rollout makes `turns` short model calls; after each but the last it "runs a tool" that
sleeps a lognormal time (median `delay_median_s`, log-space sigma `delay_sigma`), then
sends the tool's output back as the next user turn. Most rollouts are quick and a few are
very slow, as with real agents (test suites, web fetches, sandboxes). The reward is cheap and
varies within a group (the share of even token ids); the benchmark times the loop, it does not
measure learning.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from pathlib import Path

from lockgate.agent_runtime import Agent, RewardFn, RolloutContext, Task
from lockgate.gateway.schema import CallRecord


class ToolDelayEnvironment:
    def __init__(
        self,
        model_dir: Path,
        *,
        num_tasks: int = 256,
        turns: int = 2,
        max_tokens: int = 8,
        delay_median_s: float = 1.0,
        delay_sigma: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.turns = turns
        self.max_tokens = max_tokens
        self._mu = math.log(delay_median_s)
        self._sigma = delay_sigma
        self._rng = random.Random(seed)
        self._tasks = [
            Task(id=f"tool-{i}", data={"prompt": f"Task {i}: use the tool."})
            for i in range(num_tasks)
        ]

    def train_tasks(self) -> Sequence[Task]:
        return self._tasks

    @property
    def agent(self) -> Agent:
        async def act(task: Task, ctx: RolloutContext) -> float | None:
            messages: list[dict[str, str]] = [{"role": "user", "content": task.data["prompt"]}]
            async with ctx.openai_client(max_retries=0) as client:
                for turn in range(self.turns):
                    reply = await client.chat.completions.create(
                        model=ctx.model,
                        messages=messages,
                        max_tokens=self.max_tokens,  # type: ignore[arg-type]
                    )
                    if turn == self.turns - 1:
                        break
                    delay = self._rng.lognormvariate(self._mu, self._sigma)
                    await asyncio.sleep(delay)  # the tool runs
                    messages += [
                        {"role": "assistant", "content": reply.choices[0].message.content or ""},
                        {"role": "user", "content": f"tool output after {delay:.2f}s"},
                    ]
            return None

        return act

    @property
    def reward(self) -> RewardFn:
        def even_share(task: Task, calls: Sequence[CallRecord]) -> float:
            tokens = [t for call in calls for t in call.completion_ids]
            return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)

        return even_share


def make_environment(model_dir: Path, **args: object) -> ToolDelayEnvironment:
    return ToolDelayEnvironment(model_dir, **args)  # type: ignore[arg-type]
