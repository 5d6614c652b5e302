"""Running agents: one rollout of an agent on a task against its own gateway session."""

from lockgate.agent_runtime.command import (
    CommandAgent,
    CommandExited,
    CommandFailed,
    CommandOutputInvalid,
    CommandTimedOut,
)
from lockgate.agent_runtime.environments import CommandEnvironment, load_tasks_jsonl
from lockgate.agent_runtime.rollout import run_group, run_rollout
from lockgate.agent_runtime.service import (
    ServiceAgent,
    ServiceAnswerInvalid,
    ServiceEnvironment,
    ServiceFailed,
    ServiceHttpError,
    ServiceOptions,
    ServiceTimedOut,
    ServiceUnreachable,
)
from lockgate.agent_runtime.service_wire import ServiceAnswer, ServiceRequest, ServiceTask
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
    "CommandAgent",
    "CommandEnvironment",
    "CommandExited",
    "CommandFailed",
    "CommandOutputInvalid",
    "CommandTimedOut",
    "Environment",
    "RewardFn",
    "RolloutContext",
    "RolloutResult",
    "ServiceAgent",
    "ServiceAnswer",
    "ServiceAnswerInvalid",
    "ServiceEnvironment",
    "ServiceFailed",
    "ServiceHttpError",
    "ServiceOptions",
    "ServiceRequest",
    "ServiceTask",
    "ServiceTimedOut",
    "ServiceUnreachable",
    "Task",
    "load_tasks_jsonl",
    "run_group",
    "run_rollout",
]
