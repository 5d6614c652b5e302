"""A typed async client for the gateway's admin API (used by agent_runtime and coordinator).

Errors come back as `GatewayClientError` carrying the status and OpenAI-shaped message. Reads are
retried on transport errors; writes are not (a retried create would make two sessions).

`AiohttpTransport`, the connection pool under this client, is part of its surface too: other
HTTP clients of the gateway (agent_runtime's pool shared by the agents' OpenAI clients) use it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from lockgate.gateway.aiohttp_transport import AiohttpTransport
from lockgate.gateway.schema import (
    CallRecord,
    CollectiveWeights,
    CompleteGroups,
    CreatedSession,
    GatewayStatus,
    LoadReport,
    PauseMode,
    PauseReport,
    SessionInfo,
    SessionSamples,
    StageReport,
    WeightsLayout,
)

__all__ = ["AiohttpTransport", "GatewayClient", "GatewayClientError"]


class GatewayClientError(Exception):
    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"gateway answered HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message


class GatewayClient:
    def __init__(
        self,
        base_url: str,
        admin_token: str,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {admin_token}"},
            # aiohttp's pool by default: httpcore's scans every pooled connection per request,
            # which made admin calls a third of a busy coordinator's CPU with 160 agents.
            transport=transport if transport is not None else AiohttpTransport(),
            timeout=httpx.Timeout(timeout, connect=5.0),
            limits=httpx.Limits(max_connections=256),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        retries: int = 0,
        timeout_s: float | None = None,
    ) -> Any:
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s)
        for attempt in range(retries + 1):
            try:
                resp = await self._http.request(method, path, json=body, timeout=timeout)
                break
            except httpx.TransportError:
                if attempt == retries:
                    raise
                await asyncio.sleep(0.2 * 2**attempt)
        if resp.status_code >= 400:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:500]
            raise GatewayClientError(resp.status_code, message)
        return resp.json()

    async def health(self) -> dict[str, Any]:
        return await self._request("GET", "/health")

    # -- sessions -------------------------------------------------------------------------------

    async def create_session(
        self, task_id: str, group_id: str | None = None, metadata: dict[str, Any] | None = None
    ) -> CreatedSession:
        data = await self._request(
            "POST",
            "/admin/sessions",
            {"task_id": task_id, "group_id": group_id, "metadata": metadata or {}},
        )
        created = CreatedSession.model_validate(data)
        created.base_url = self.base_url + created.base_url
        return created

    async def finish_session(
        self,
        session_id: str,
        *,
        reward: float | None = None,
        failed: bool = False,
        error: str | None = None,
    ) -> SessionInfo:
        body = {"status": "failed" if failed else "finished", "reward": reward, "error": error}
        data = await self._request("POST", f"/admin/sessions/{session_id}/finish", body)
        return SessionInfo.model_validate(data)

    async def set_reward(self, session_id: str, reward: float) -> SessionInfo:
        data = await self._request(
            "POST", f"/admin/sessions/{session_id}/reward", {"reward": reward}
        )
        return SessionInfo.model_validate(data)

    async def session(self, session_id: str) -> SessionInfo:
        data = await self._request("GET", f"/admin/sessions/{session_id}", retries=2)
        return SessionInfo.model_validate(data)

    async def calls(self, session_id: str) -> list[CallRecord]:
        data = await self._request("GET", f"/admin/sessions/{session_id}/calls", retries=2)
        return [CallRecord.model_validate(c) for c in data["calls"]]

    async def samples(self, session_id: str) -> SessionSamples:
        data = await self._request("GET", f"/admin/sessions/{session_id}/samples", retries=2)
        return SessionSamples.model_validate(data)

    # -- weight sync ----------------------------------------------------------------------------

    async def status(self) -> GatewayStatus:
        return GatewayStatus.model_validate(await self._request("GET", "/admin/status", retries=2))

    async def pause(self, mode: PauseMode = "abort", timeout_s: float = 600.0) -> PauseReport:
        data = await self._request("POST", "/admin/pause", {"mode": mode, "timeout_s": timeout_s})
        return PauseReport.model_validate(data["pause"])

    async def load_weights(self, path: str, version: int) -> LoadReport:
        """Disk transport: every replica reloads the snapshot at `path`, then is verified."""
        data = await self._request("POST", "/admin/weights", {"path": path, "version": version})
        return LoadReport.model_validate(data)

    async def load_collective(self, source: CollectiveWeights, version: int) -> LoadReport:
        """Collective transport: every replica receives `version` from trainer rank 0 over the
        group `source` names (the trainer must be sending meanwhile), then is verified. Waits
        as long as the replicas may take (three times the group's timeout)."""
        body = {"version": version, "source": source.model_dump()}
        data = await self._request(
            "POST", "/admin/weights", body, timeout_s=3 * source.timeout_s + 30
        )
        return LoadReport.model_validate(data)

    async def load_adapter(self, path: str, version: int) -> LoadReport:
        """Adapter mode: every replica loads the LoRA adapter at `path` as this run's
        `version` (listed by its /v1/models afterwards); no engine is paused."""
        body = {"version": version, "transport": "adapter", "path": path}
        data = await self._request("POST", "/admin/weights", body)
        return LoadReport.model_validate(data)

    async def stage_weights(self, path: str, slice_s: float = 0.2) -> StageReport:
        """Disk transport: every replica prepares its next load of `path` while serving."""
        body = {"path": path, "slice_s": slice_s}
        data = await self._request("POST", "/admin/weights/stage", body)
        return StageReport.model_validate(data)

    async def weights_layout(self) -> WeightsLayout:
        """Which linear weights the replicas load fastest in their kernel layout (disk)."""
        return WeightsLayout.model_validate(
            await self._request("GET", "/admin/weights/layout", retries=2)
        )

    async def resume(self, version: int) -> GatewayStatus:
        data = await self._request("POST", "/admin/resume", {"version": version})
        return GatewayStatus.model_validate(data)

    # -- client-driven rollouts (the enrolment) -------------------------------------------------

    async def open_enrolment(
        self,
        key: str,
        group_size: int,
        groups_admitted: int,
        retry_after_s: float = 2.0,
        timeout_s: float | None = None,
    ) -> None:
        """Let clients with `key` create sessions in groups of `group_size` (counts restart);
        a group still incomplete `timeout_s` after its first session is closed."""
        body = {
            "key": key,
            "group_size": group_size,
            "groups_admitted": groups_admitted,
            "retry_after_s": retry_after_s,
            "timeout_s": timeout_s,
        }
        await self._request("PUT", "/admin/enrolment", body)

    async def admit_groups(self, groups_admitted: int) -> None:
        """New groups may start while fewer than `groups_admitted` have (never lowered)."""
        body = {"groups_admitted": groups_admitted}
        await self._request("POST", "/admin/enrolment/admitted", body, retries=2)

    async def complete_groups(self, after: int, wait_s: float) -> CompleteGroups:
        """The enrolled groups completed after number `after`, waiting up to `wait_s` for one."""
        path = f"/admin/enrolment/groups?after={after}&wait_s={wait_s}"
        return CompleteGroups.model_validate(await self._request("GET", path, retries=2))
