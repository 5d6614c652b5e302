"""Talking to one vLLM replica: token-in/token-out generation and the RL admin endpoints.

Generation uses `POST /inference/v1/generate` (vLLM's scale-out API, `--enable-scale-out`),
so the gateway owns rendering and the replica never re-tokenizes. Admin endpoints need
`VLLM_SERVER_DEV_MODE=1` on the replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from lockgate.gateway.errors import GatewayError, upstream_failed
from lockgate.gateway.replicas.upstream import HttpxUpstream, ReplicaUnavailable, Upstream
from lockgate.gateway.vllm_ext.routes import PAUSE_PATH

__all__ = [
    "ModelMissing",
    "ReplicaChunk",
    "ReplicaClient",
    "ReplicaUnavailable",
    "RouteMissing",
    "parse_events",
]

# Generation may legitimately run for minutes; admin calls must not hang a sync.
_ADMIN_TIMEOUT_S = 60.0
_ADMIN_TIMEOUT = httpx.Timeout(_ADMIN_TIMEOUT_S, connect=5.0)


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


class RouteMissing(ReplicaUnavailable):
    """The replica answered 404: it does not have this route."""


class ModelMissing(GatewayError):
    """The replica answered 404 "does not exist" for the generate request's `model`: it does
    not hold that LoRA adapter (restarted, or joined after the adapter was loaded)."""

    def __init__(self, url: str, model: str, text: str) -> None:
        super().__init__(
            502,
            f"replica {url} does not hold the adapter {model!r}: {text[:300]}",
            type="upstream_error",
            code="replica_error",
        )
        self.model = model


def _replica_error(status: int, text: str) -> GatewayError:
    return upstream_failed(f"replica rejected the request: HTTP {status}: {text[:300]}")


def parse_events(payloads: list[bytes]) -> tuple[ReplicaChunk | None, GatewayError | None]:
    """`/inference/v1/generate` SSE payloads that arrived together, as one chunk (None if they
    carry no choice: `[DONE]`, usage), and the error that ended them if one did: the tokens
    before an error are still returned, so the call keeps them.

    One pass per token and no object per event: at one event per token this runs for every
    token the gateway serves.
    """
    token_ids: list[int] = []
    logprobs: list[float] = []
    top: list[list[tuple[int, float]]] | None = None
    finish: str | None = None
    versions: list[dict[str, Any]] | None = None
    seen = False
    for data in payloads:
        if data == b"[DONE]":
            continue
        payload = orjson.loads(data)
        if "error" in payload:
            error = upstream_failed(f"replica failed the request: {payload['error']}")
            return _chunk(seen, token_ids, logprobs, finish, versions, top), error
        choices = payload.get("choices")
        if not choices:
            continue
        seen = True
        choice = choices[0]
        ids = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids):
            error = upstream_failed(
                f"replica returned {len(ids)} tokens but {len(content)} logprobs"
            )
            return _chunk(seen, token_ids, logprobs, finish, versions, top), error
        token_ids += ids
        has_top = False
        for entry in content:
            logprobs.append(float(entry["logprob"]))
            if entry.get("top_logprobs"):
                has_top = True
        if has_top:
            # vLLM lists the sampled token first, then the candidates; OpenAI wants them by rank.
            top = (top or []) + [
                sorted(
                    (
                        (int(c["token_id"]), float(c["logprob"]))
                        for c in entry.get("top_logprobs", [])
                    ),
                    key=lambda c: -c[1],
                )
                for entry in content
            ]
        if (reason := choice.get("finish_reason")) is not None:
            finish, versions = reason, choice.get("weight_versions")
    return _chunk(seen, token_ids, logprobs, finish, versions, top), None


def _chunk(
    seen: bool,
    token_ids: list[int],
    logprobs: list[float],
    finish: str | None,
    versions: list[dict[str, Any]] | None,
    top: list[list[tuple[int, float]]] | None,
) -> ReplicaChunk | None:
    if not seen:
        return None
    return ReplicaChunk(token_ids, logprobs, finish, versions, top)


async def _sse_batches(pieces: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """The `data:` payloads of an SSE body, as bytes, grouped by the read that completed them.

    Payloads that arrive together are handled together: a gateway that falls behind a replica
    then pays the per-chunk cost of the call (generator steps, stop scans, stream updates) once
    per read rather than once per token. orjson parses bytes, so no line is decoded to text.
    """
    buffer = b""
    async for piece in pieces:
        buffer += piece
        if b"\n" not in piece:
            continue
        *lines, buffer = buffer.split(b"\n")
        batch = [line[5:].strip() for line in lines if line.startswith(b"data:")]
        if batch:
            yield batch
    if buffer.startswith(b"data:"):
        yield [buffer[5:].strip()]


class ReplicaClient:
    def __init__(self, url: str, http: httpx.AsyncClient, upstream: Upstream | None = None) -> None:
        self.url = url.rstrip("/")
        self._http = http
        self._upstream = upstream or HttpxUpstream(http)
        self._generate_url = f"{self.url}/inference/v1/generate"
        # Whether the replica loads disk snapshots directly (None: not asked yet; sync/weights.py).
        self.snapshot_load: bool | None = None
        # The layers it loads faster from a snapshot in its kernel layout (None: not asked yet).
        self.kernel_layout: dict[str, list[str]] | None = None
        # Whether it has lockgate's pause route (vllm_ext/routes.py; None: not tried yet).
        self.pause_route: bool | None = None

    async def generate_stream(
        self,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        request_id: str,
        model: str | None = None,
    ) -> AsyncIterator[ReplicaChunk]:
        """Stream one generation. Always streamed, so that the tokens received before a replica
        dies are kept; closing the iterator early aborts the request in vLLM. Chunks that
        arrive in one read come as one. `model`: a LoRA adapter the replica holds (None: the
        base model); one it does not hold raises `ModelMissing` before any chunk."""
        request: dict[str, Any] = {
            "token_ids": prompt_ids,
            # logprobs=0: the sampled token's own logprob; k > 0 adds the top-k candidates.
            "sampling_params": {"logprobs": 0, **sampling},
            "request_id": request_id,
            "stream": True,
        }
        if model is not None:
            request["model"] = model
        body = orjson.dumps(request)
        del request
        del prompt_ids  # encoded: not held for the stream's minutes (generation.py's pump)
        finished = False
        async with self._upstream.post_stream(self._generate_url, body) as resp:
            if resp.status >= 500:
                text = (await resp.read()).decode(errors="replace")
                raise ReplicaUnavailable(f"{self.url}: HTTP {resp.status}: {text[:300]}")
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                if resp.status == 404 and model is not None and "does not exist" in text:
                    raise ModelMissing(self.url, model, text)
                raise _replica_error(resp.status, text)
            async for batch in _sse_batches(resp.pieces()):
                # A `[DONE]` is read past rather than ended on: a response closed before its
                # last (empty) chunk cannot go back to the pool, and a new connection per call
                # costs more than the rest of the call.
                chunk, error = parse_events(batch)
                if chunk is not None:
                    if chunk.finish_reason is not None:
                        finished = True
                    yield chunk
                if error is not None:
                    raise error
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
        timeout_s: float | None = None,
    ) -> Any:
        """`timeout_s`: for a call known to take longer than an admin call's usual bound."""
        timeout = _ADMIN_TIMEOUT if timeout_s is None else httpx.Timeout(timeout_s, connect=5.0)
        # Every admin call is safe to repeat (pause, resume, reload the same snapshot, set a
        # label), and a kept-alive connection the replica closed after an error answer fails
        # on first use: one retry on a transport error.
        for attempt in (1, 2):
            try:
                resp = await self._http.request(
                    method, f"{self.url}{path}", json=payload, params=params, timeout=timeout
                )
                break
            except httpx.TransportError as exc:
                if attempt == 2 or isinstance(exc, httpx.TimeoutException):
                    raise ReplicaUnavailable(
                        f"{self.url}{path}: {type(exc).__name__}: {exc}"
                    ) from exc
        if resp.status_code != 200:
            error = RouteMissing if resp.status_code == 404 else ReplicaUnavailable
            raise error(f"{self.url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text  # vLLM's LoRA routes answer in plain text ("Success: ...")

    async def reset_prefix_cache(self) -> None:
        await self.call_admin("/reset_prefix_cache")

    async def set_version_label(self, version: int) -> None:
        await self.call_admin("/update_weight_version", {"new_version": str(version)})

    async def version_label(self) -> str | None:
        """The engine's weight version label (what `/weight_info` reports)."""
        info = await self.call_admin("/weight_info", method="GET")
        value = info.get("weight_version") if isinstance(info, dict) else None
        return None if value is None else str(value)

    async def pause(self, mode: str) -> float | None:
        """vLLM's own pause: `abort` ends running requests (partial tokens returned), `keep`
        freezes them until resume; either way the engine schedules nothing new.

        The pause keeps vLLM's caches: resetting the prefix cache walks every KV block, time
        the pause would wait for; a sync resets it once the new weights are in (and a pause
        resumed on the same weights keeps a valid cache). On a replica with lockgate's route
        it is the same engine pause without vLLM's 20 ms sleep (vllm_ext/routes.py), and the
        seconds the engine took come back; None from vLLM's /pause."""
        if self.pause_route is not False:
            try:
                if mode == "abort":
                    answer = await self._post_lean(f"{PAUSE_PATH}?mode={mode}")
                else:
                    answer = await self.call_admin(PAUSE_PATH, params={"mode": mode})
            except RouteMissing:
                self.pause_route = False
            else:
                self.pause_route = True
                engine_s = answer.get("engine_s") if isinstance(answer, dict) else None
                return None if engine_s is None else float(engine_s)
        await self.call_admin("/pause", params={"mode": mode, "clear_cache": "false"})
        return None

    async def _post_lean(self, path: str) -> Any:
        """An empty POST through the generate path's HTTP client, as `call_admin` answers it.

        A sync pauses every replica at once, on the event loop that is also closing every cut
        stream, and the generate client costs a fraction of httpx on aiohttp's CPU per pause
        (benchmarks/pause_fanout.py; docs/performance.md, "Gateway"). Only for `abort`: it cuts
        (or waits out) every stream before pausing, so the client's connection slots come
        free, where `keep` leaves up to all of them held by frozen streams."""
        url = f"{self.url}{path}"
        try:
            async with asyncio.timeout(_ADMIN_TIMEOUT_S):
                async with self._upstream.post_stream(url, b"") as resp:
                    body = await resp.read()
        except TimeoutError as exc:
            raise ReplicaUnavailable(f"{url}: no answer in {_ADMIN_TIMEOUT_S:.0f}s") from exc
        if resp.status != 200:
            error = RouteMissing if resp.status == 404 else ReplicaUnavailable
            raise error(f"{url}: HTTP {resp.status}: {body[:300].decode(errors='replace')}")
        return orjson.loads(body) if body else None

    async def resume(self) -> None:
        await self.call_admin("/resume")
