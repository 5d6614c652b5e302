"""Running agents: one rollout of an agent on a task against its own gateway session."""

from lockgate.agent_runtime.rollout import run_group, run_rollout
from lockgate.agent_runtime.types import (
    Agent,
    Environment,
    RewardFn,
    RolloutContext,
    RolloutResult,
    Task,
)

__all__ = [
    "Agent",
    "Environment",
    "RewardFn",
    "RolloutContext",
    "RolloutResult",
    "Task",
    "run_group",
    "run_rollout",
]
