"""Talking to one vLLM replica: token-in/token-out generation and the RL admin endpoints.

Generation uses `POST /inference/v1/generate` (vLLM's scale-out API, `--enable-scale-out`),
so the gateway owns rendering and the replica never re-tokenizes. Admin endpoints need
`VLLM_SERVER_DEV_MODE=1` on the replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from lockgate.gateway.errors import GatewayError

# Generation may legitimately run for minutes; admin calls must not hang a sync.
_ADMIN_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
_GENERATE_TIMEOUT = httpx.Timeout(None, connect=5.0)


class ReplicaUnavailable(Exception):
    """The replica could not be reached (connection refused, reset, timed out)."""


@dataclass(frozen=True)
class GenerateResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    replica_version: str | None


class ReplicaClient:
    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url.rstrip("/")
        self._http = http

    async def generate(
        self, prompt_ids: list[int], sampling: dict[str, Any], request_id: str
    ) -> GenerateResult:
        body = {
            "token_ids": prompt_ids,
            "sampling_params": {**sampling, "logprobs": 0},
            "request_id": request_id,
        }
        try:
            resp = await self._http.post(
                f"{self.url}/inference/v1/generate", json=body, timeout=_GENERATE_TIMEOUT
            )
        except httpx.TransportError as exc:
            raise ReplicaUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500:
            raise ReplicaUnavailable(f"{self.url}: HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code != 200:
            raise GatewayError(
                502,
                f"replica rejected the request: HTTP {resp.status_code}: {resp.text[:300]}",
                type="upstream_error",
                code="replica_error",
            )
        choice = resp.json()["choices"][0]
        token_ids: list[int] = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(entry["logprob"]) for entry in content]
        if len(logprobs) != len(token_ids):
            raise GatewayError(
                502,
                f"replica returned {len(token_ids)} tokens but {len(logprobs)} logprobs",
                type="upstream_error",
                code="replica_error",
            )
        spans = choice.get("weight_versions") or []
        return GenerateResult(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=choice.get("finish_reason") or "stop",
            replica_version=spans[-1]["version"] if spans else None,
        )

    async def healthy(self) -> bool:
        try:
            resp = await self._http.get(f"{self.url}/health", timeout=httpx.Timeout(5.0))
        except httpx.TransportError:
            return False
        return resp.status_code == 200

    async def _admin(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        try:
            resp = await self._http.post(f"{self.url}{path}", json=payload, timeout=_ADMIN_TIMEOUT)
        except httpx.TransportError as exc:
            raise ReplicaUnavailable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise ReplicaUnavailable(
                f"{self.url}{path}: HTTP {resp.status_code}: {resp.text[:300]}"
            )
        return resp.json() if resp.content else None

    async def load_weights(self, weights_dir: str, version: int) -> None:
        """Reload weights in place, drop KV computed under the old ones, relabel the engine."""
        await self._admin(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
        )
        await self._admin("/reset_prefix_cache")
        await self._admin("/update_weight_version", {"new_version": str(version)})
