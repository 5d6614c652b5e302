"""The toy task with a reward that varies within every group from the first step: the share of
completion tokens with an even id. A random model draws such tokens half the time, so GRPO's
advantages are never all zero and every step moves the weights (the toy's number tokens are too
rare in a 201k-token vocabulary for a 3-step run to get any reward)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lockgate.agent_runtime import RewardFn, Task
from lockgate.examples.toy.env import NumbersEnvironment
from lockgate.gateway.schema import CallRecord


class EvenTokensEnvironment(NumbersEnvironment):
    @property
    def reward(self) -> RewardFn:
        def share_even(task: Task, calls: Sequence[CallRecord]) -> float:
            tokens = [t for call in calls for t in call.completion_ids]
            return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)

        return share_even


def make_environment(model_dir: Path, **args: object) -> EvenTokensEnvironment:
    return EvenTokensEnvironment(model_dir, **args)  # type: ignore[arg-type]
