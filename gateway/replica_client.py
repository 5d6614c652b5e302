"""Talking to one vLLM replica: token-in/token-out generation and the RL admin endpoints.

Generation uses `POST /inference/v1/generate` (vLLM's scale-out API, `--enable-scale-out`),
so the gateway owns rendering and the replica never re-tokenizes. Admin endpoints need
`VLLM_SERVER_DEV_MODE=1` on the replica.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from lockgate.gateway.errors import GatewayError

# Generation may legitimately run for minutes; admin calls must not hang a sync.
_ADMIN_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
_GENERATE_TIMEOUT = httpx.Timeout(None, connect=5.0)
_JSON_HEADERS = {"content-type": "application/json"}


class ReplicaUnavailable(Exception):
    """The replica could not be reached (connection refused, reset, timed out)."""


@dataclass(frozen=True)
class ReplicaChunk:
    """One streamed piece of a generation: new tokens, and the finish on the last one."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    # vLLM's [{"version", "start", "end"}] over the request's output tokens (final chunk only)
    weight_versions: list[dict[str, Any]] | None = None
    # per token, (token id, logprob) candidates best first; only when top-k logprobs were asked
    top_logprobs: list[list[tuple[int, float]]] | None = None


def _replica_error(status: int, text: str) -> GatewayError:
    return GatewayError(
        502,
        f"replica rejected the request: HTTP {status}: {text[:300]}",
        type="upstream_error",
        code="replica_error",
    )


def parse_chunk(payload: dict[str, Any]) -> ReplicaChunk | None:
    """A `/inference/v1/generate` SSE payload as a chunk; None for a choice-less usage chunk."""
    if "error" in payload:
        raise GatewayError(
            502,
            f"replica failed the request: {payload['error']}",
            type="upstream_error",
            code="replica_error",
        )
    choices = payload.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
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
    top = None
    if any(entry.get("top_logprobs") for entry in content):
        # vLLM lists the sampled token first, then the candidates; OpenAI wants them by rank.
        top = [
            sorted(
                ((int(c["token_id"]), float(c["logprob"])) for c in entry.get("top_logprobs", [])),
                key=lambda c: -c[1],
            )
            for entry in content
        ]
    return ReplicaChunk(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=choice.get("finish_reason"),
        weight_versions=choice.get("weight_versions"),
        top_logprobs=top,
    )


async def _sse_data(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The `data:` payloads of an SSE body, as bytes (orjson parses bytes; decoding every line
    to text first, as `aiter_lines` does, is a measurable share of a call)."""
    buffer = b""
    async for piece in resp.aiter_bytes():
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if buffer.startswith(b"data:"):
        yield buffer[5:].strip()


class ReplicaClient:
    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url.rstrip("/")
        self._http = http
        self._generate_url = httpx.URL(f"{self.url}/inference/v1/generate")
        # Whether the replica loads disk snapshots directly (None: not asked yet; weights.py).
        self.snapshot_load: bool | None = None

    async def generate_stream(
        self, prompt_ids: list[int], sampling: dict[str, Any], request_id: str
    ) -> AsyncIterator[ReplicaChunk]:
        """Stream one generation. Always streamed, so that the tokens received before a replica
        dies are kept; closing the iterator early aborts the request in vLLM."""
        body = {
            "token_ids": prompt_ids,
            # logprobs=0: the sampled token's own logprob; k > 0 adds the top-k candidates.
            "sampling_params": {"logprobs": 0, **sampling},
            "request_id": request_id,
            "stream": True,
        }
        # Built by hand from a URL parsed once: `AsyncClient.stream` would re-parse and merge
        # the URL and encode the JSON with the stdlib on every call of the hot path.
        request = httpx.Request(
            "POST",
            self._generate_url,
            content=orjson.dumps(body),
            headers=_JSON_HEADERS,
            extensions={"timeout": _GENERATE_TIMEOUT.as_dict()},
        )
        finished = False
        try:
            async with contextlib.aclosing(await self._http.send(request, stream=True)) as resp:
                if resp.status_code >= 500:
                    text = (await resp.aread()).decode(errors="replace")
                    raise ReplicaUnavailable(f"{self.url}: HTTP {resp.status_code}: {text[:300]}")
                if resp.status_code != 200:
                    raise _replica_error(
                        resp.status_code, (await resp.aread()).decode(errors="replace")
                    )
                async for data in _sse_data(resp):
                    if data == b"[DONE]":
                        # Read on to the end of the body rather than stop here: a response
                        # closed before its last (empty) chunk cannot go back to the pool, and a
                        # new connection per call costs more than the rest of the call.
                        continue
                    chunk = parse_chunk(orjson.loads(data))
                    if chunk is None:
                        continue
                    finished = chunk.finish_reason is not None
                    yield chunk
        except httpx.TransportError as exc:
            raise ReplicaUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        if not finished:
            raise ReplicaUnavailable(f"{self.url}: the stream ended without a finish reason")

    async def healthy(self) -> bool:
        try:
            resp = await self._http.get(f"{self.url}/health", timeout=httpx.Timeout(5.0))
        except httpx.TransportError:
            return False
        return resp.status_code == 200

    async def call_admin(
        self,
        path: str,
        payload: dict[str, Any] | None = None,
        *,
        method: str = "POST",
        params: dict[str, str] | None = None,
    ) -> Any:
        # Every admin call is safe to repeat (pause, resume, reload the same snapshot, set a
        # label), and a kept-alive connection the replica closed after an error answer fails
        # on first use: one retry on a transport error.
        for attempt in (1, 2):
            try:
                resp = await self._http.request(
                    method, f"{self.url}{path}", json=payload, params=params, timeout=_ADMIN_TIMEOUT
                )
                break
            except httpx.TransportError as exc:
                if attempt == 2 or isinstance(exc, httpx.TimeoutException):
                    raise ReplicaUnavailable(
                        f"{self.url}{path}: {type(exc).__name__}: {exc}"
                    ) from exc
        if resp.status_code != 200:
            raise ReplicaUnavailable(
                f"{self.url}{path}: HTTP {resp.status_code}: {resp.text[:300]}"
            )
        return resp.json() if resp.content else None

    async def reset_prefix_cache(self) -> None:
        await self.call_admin("/reset_prefix_cache")

    async def set_version_label(self, version: int) -> None:
        await self.call_admin("/update_weight_version", {"new_version": str(version)})

    async def version_label(self) -> str | None:
        """The engine's weight version label (what `/weight_info` reports)."""
        info = await self.call_admin("/weight_info", method="GET")
        value = info.get("weight_version") if isinstance(info, dict) else None
        return None if value is None else str(value)

    async def pause(self, mode: str) -> None:
        """vLLM's own pause: `abort` ends running requests (partial tokens returned), `keep`
        freezes them until resume; either way the engine schedules nothing new."""
        await self.call_admin("/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self.call_admin("/resume")
