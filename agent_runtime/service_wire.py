"""The wire contract between the coordinator and an agent that runs as an HTTP service.

Per rollout the coordinator POSTs a `ServiceRequest` as JSON to the service's URL; the service
runs the agent against the session's OpenAI endpoint and answers a `ServiceAnswer`. Both are
documented for service authors in docs/bring-your-agent.md; a service in any language
implements them from there.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

# A reward is a finite JSON number: a string, a boolean or a NaN is a broken service, never a
# value to coerce (a silently coerced reward trains on the wrong signal).
Reward = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class ServiceTask(BaseModel):
    id: str = Field(description="The task's id (from the tasks JSONL).")
    data: dict[str, Any] = Field(description="Every other key of the task's JSONL line.")


class ServiceRequest(BaseModel):
    """What the coordinator sends: the task and one gateway session to solve it in."""

    task: ServiceTask
    session_id: str = Field(description="The gateway session of this rollout.")
    base_url: str = Field(
        description="OpenAI-compatible base URL scoped to the session (ends in /v1)."
    )
    api_key: str = Field(description="The session's key: the OpenAI client's api_key.")
    model: str = Field(description="The model name to send in chat requests.")
    reward_url: str = Field(
        description='Where the service may POST {"reward": x} itself (session key as Bearer).'
    )
    deadline_unix_s: float = Field(
        description="Absolute time (unix seconds) after which the rollout counts as failed."
    )
    seconds_left: float = Field(description="Seconds from sending this request to the deadline.")
    attempt: int = Field(
        ge=1, description="1 for the first try; higher when retried (nothing was recorded)."
    )


class ServiceAnswer(BaseModel):
    """What the service answers (HTTP 2xx, a JSON object). Other keys are allowed and ignored.

    Without a reward (absent or null, or HTTP 204 with no body) the reward is the one the
    service posted to `reward_url`; a rollout with neither fails for want of one.
    """

    model_config = ConfigDict(extra="allow")
    reward: Reward | None = None
