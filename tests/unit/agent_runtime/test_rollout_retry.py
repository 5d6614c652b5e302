"""A rollout survives one dropped connection to the gateway's admin API (a keep-alive socket
the gateway closed while the agent sat in a tool), instead of failing the whole run."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from lockgate.agent_runtime import RolloutContext, Task, run_rollout
from lockgate.gateway.schema import CreatedSession, SessionInfo


class FlakyGateway:
    def __init__(self) -> None:
        self.attempts = {"create": 0, "finish": 0}

    async def create_session(
        self, task_id: str, group_id: str | None = None, metadata: dict[str, Any] | None = None
    ) -> CreatedSession:
        self.attempts["create"] += 1
        if self.attempts["create"] == 1:
            raise httpx.ReadError("connection closed")
        return CreatedSession(session_id="s", api_key="k", base_url="/x")

    async def finish_session(self, sid: str, **kwargs: Any) -> SessionInfo:
        self.attempts["finish"] += 1
        if self.attempts["finish"] == 1:
            raise httpx.RemoteProtocolError("server disconnected")
        return SessionInfo(
            session_id=sid, task_id="t", group_id=None, metadata={}, status="finished",
            reward=kwargs["reward"], error=None, created_at=0.0, finished_at=0.0, num_calls=0,
            rerender_splits=0,
        )  # fmt: skip


def test_a_transport_error_on_create_or_finish_is_retried_once() -> None:
    async def agent(task: Task, ctx: RolloutContext) -> float:
        return 0.5

    gateway = FlakyGateway()
    result = asyncio.run(run_rollout(gateway, agent, Task(id="t"), group_id="g"))  # type: ignore[arg-type]
    assert result.status == "finished" and result.reward == 0.5
    assert gateway.attempts == {"create": 2, "finish": 2}
