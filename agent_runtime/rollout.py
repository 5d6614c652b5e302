"""One rollout = one gateway session: create it, run the agent, score it, close it.

A failing, hanging or reward-less rollout fails its own session with the reason recorded; it
never raises into the caller, so one bad agent cannot stop a training run.

Where the reward comes from, first match wins: the reward function (when configured), the
agent's return value, the reward the agent posted to the gateway for its session.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from lockgate.agent_runtime.types import Agent, RewardFn, RolloutContext, RolloutResult, Task
from lockgate.gateway.client import GatewayClient

log = logging.getLogger(__name__)

T = TypeVar("T")


async def _retry_once(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """Run a gateway admin call, once more on a fresh connection if the transport failed.

    The gateway closes keep-alive connections that idle past its timeout; a rollout whose
    agent spent seconds in a tool can reuse one just as it closes (httpx.ReadError). The POSTs
    here are safe to repeat: finishing twice writes the same row, and a session created twice
    leaves one unused open session, never trained.
    """
    try:
        return await call()
    except httpx.TransportError as exc:
        log.warning("%s: %s; retrying once on a fresh connection", what, type(exc).__name__)
        return await call()


async def run_rollout(
    gateway: GatewayClient,
    agent: Agent,
    task: Task,
    *,
    group_id: str,
    reward_fn: RewardFn | None = None,
    timeout_s: float | None = None,
    metadata: dict[str, Any] | None = None,
) -> RolloutResult:
    created = await _retry_once(
        "create_session", lambda: gateway.create_session(task.id, group_id, metadata)
    )
    ctx = RolloutContext(
        session_id=created.session_id, base_url=created.base_url, api_key=created.api_key
    )
    started = time.monotonic()
    reward: float | None = None
    error: str | None = None
    try:
        reward = await asyncio.wait_for(agent(task, ctx), timeout_s)
        if reward_fn is not None:
            calls = await gateway.calls(created.session_id)
            value = reward_fn(task, calls)
            reward = float(await value if inspect.isawaitable(value) else value)
        elif reward is None:
            # The agent may have posted its reward to POST /sessions/<sid>/reward instead
            # (how an agent in another language or process reports one).
            reward = (await gateway.session(created.session_id)).reward
        if reward is None:
            error = (
                "no reward: the agent returned none, posted none to the gateway, and no "
                "reward function is configured"
            )
    except TimeoutError:
        error = f"rollout timed out after {timeout_s}s"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.debug("rollout %s failed:\n%s", created.session_id, traceback.format_exc())
    failed = error is not None
    info = await _retry_once(
        "finish_session",
        lambda: gateway.finish_session(
            created.session_id, reward=None if failed else reward, failed=failed, error=error
        ),
    )
    return RolloutResult(
        session_id=created.session_id,
        task_id=task.id,
        group_id=group_id,
        status="failed" if failed else "finished",
        reward=info.reward,
        error=error,
        duration_s=time.monotonic() - started,
        num_calls=info.num_calls,
    )


async def run_group(
    gateway: GatewayClient,
    agent: Agent,
    task: Task,
    n: int,
    *,
    group_id: str,
    reward_fn: RewardFn | None = None,
    timeout_s: float | None = None,
    metadata: dict[str, Any] | None = None,
) -> list[RolloutResult]:
    """Run n rollouts of the same task concurrently (one GRPO group)."""
    return list(
        await asyncio.gather(
            *(
                run_rollout(
                    gateway,
                    agent,
                    task,
                    group_id=group_id,
                    reward_fn=reward_fn,
                    timeout_s=timeout_s,
                    metadata=metadata,
                )
                for _ in range(n)
            )
        )
    )
