"""The gateway's HTTP app: the agent-facing OpenAI API and the admin API.

Request path of a chat call: identify the session -> validate -> apply the sampling policy ->
render (bridging the previous call's exact tokens where possible) -> wait for the pause gate ->
generate on a replica (failing over to another if one is unreachable) -> parse -> record
durably -> answer.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from lockgate.gateway.config import GatewayConfig
from lockgate.gateway.errors import (
    GatewayError,
    bad_request,
    conflict,
    not_found,
    unauthorized,
    unavailable,
)
from lockgate.gateway.pause import PauseGate
from lockgate.gateway.pool import ReplicaPool
from lockgate.gateway.rendering import ChatRenderer, PreviousTurn
from lockgate.gateway.replica_client import GenerateResult, ReplicaClient, ReplicaUnavailable
from lockgate.gateway.samples import merge_calls
from lockgate.gateway.schema import (
    CallRecord,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CreatedSession,
    CreateSession,
    FinishSession,
    GatewayStatus,
    LoadWeights,
    PauseRequest,
    ResumeRequest,
    SessionSamples,
    SetReward,
    TokenLogprob,
    Usage,
    VersionSpan,
)
from lockgate.gateway.store import SessionRow, TrajectoryStore

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

SESSION_KEY_PREFIX = "lg-sk-"


def _json(payload: Any, status_code: int = 200) -> Response:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json")
    return Response(orjson.dumps(payload), status_code=status_code, media_type="application/json")


@dataclass
class _Generated:
    result: GenerateResult
    replica: ReplicaClient
    version: int
    started_at: float


class Gateway:
    """Holds the gateway's parts; the FastAPI routes below are thin wrappers around it."""

    def __init__(self, config: GatewayConfig, http: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.store = TrajectoryStore(config.db_path)
        self.renderer = ChatRenderer(config.model_dir, config.renderer)
        self._own_http = http is None
        self.http = http or httpx.AsyncClient(limits=httpx.Limits(max_connections=1024))
        self.pool = ReplicaPool(config.replicas, self.http)
        self.gate = PauseGate(config.initial_version, config.max_pause_wait_s)
        self._sessions: dict[str, SessionRow] = {}
        self._by_key: dict[str, str] = {}
        self._next_index: dict[str, int] = {}

    async def start(self) -> None:
        for row in await self.store.load_session_rows():
            self._remember(row)
        self.pool.start()

    async def close(self) -> None:
        await self.pool.stop()
        if self._own_http:
            await self.http.aclose()
        self.store.close()

    def _remember(self, row: SessionRow) -> None:
        self._sessions[row.id] = row
        self._by_key[row.api_key] = row.id

    # -- sessions -------------------------------------------------------------------------------

    async def create_session(self, body: CreateSession) -> CreatedSession:
        session_id = uuid.uuid4().hex
        api_key = SESSION_KEY_PREFIX + secrets.token_urlsafe(24)
        await self.store.create_session(
            session_id, api_key, body.task_id, body.group_id, body.metadata
        )
        self._remember(SessionRow(session_id, api_key, "open"))
        self._next_index[session_id] = 0
        return CreatedSession(
            session_id=session_id, api_key=api_key, base_url=f"/sessions/{session_id}/v1"
        )

    def session_by_path(self, session_id: str, authorization: str | None) -> SessionRow:
        row = self._sessions.get(session_id)
        if row is None:
            raise not_found(f"unknown session '{session_id}'")
        key = _bearer(authorization)
        # The session id in the path is the capability; a lockgate key for another session is
        # still refused so that one session's credentials never act on another.
        if key is not None and key.startswith(SESSION_KEY_PREFIX) and key != row.api_key:
            raise unauthorized("this API key belongs to a different session")
        return row

    def session_by_key(self, authorization: str | None) -> SessionRow:
        key = _bearer(authorization)
        if key is None:
            raise unauthorized("missing API key: send 'Authorization: Bearer <session key>'")
        session_id = self._by_key.get(key)
        if session_id is None:
            raise unauthorized("invalid API key: not a key of any session")
        return self._sessions[session_id]

    async def finish_session(self, session_id: str, body: FinishSession) -> None:
        row = self._require(session_id)
        await self.store.finish_session(session_id, body.status, body.reward, body.error)
        row.status = body.status
        self.pool.forget_session(session_id)

    def _require(self, session_id: str) -> SessionRow:
        row = self._sessions.get(session_id)
        if row is None:
            raise not_found(f"unknown session '{session_id}'")
        return row

    async def samples(self, session_id: str) -> SessionSamples:
        self._require(session_id)
        info = await self.store.get_session(session_id)
        assert info is not None
        calls = await self.store.get_calls(session_id)
        samples, splits = merge_calls(calls)
        return SessionSamples(session=info, samples=samples, splits=splits)

    # -- chat completions -----------------------------------------------------------------------

    async def chat(self, session: SessionRow, body: bytes) -> ChatCompletionResponse:
        if session.status != "open":
            raise conflict(f"session '{session.id}' is {session.status}; it takes no more calls")
        raw = _parse_json(body)
        req = _validate(ChatCompletionRequest, raw)
        _refuse_unsupported(req)

        previous = await self.store.last_call(session.id)
        prompt = self.renderer.render_prompt(
            req.messages, req.tools, _previous_turn(previous) if previous else None
        )
        prompt_ids = prompt.prompt_ids
        room = self.config.max_model_len - len(prompt_ids)
        if room < 1:
            raise bad_request(
                f"the prompt is {len(prompt_ids)} tokens; this model's context is "
                f"{self.config.max_model_len} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        sampling = self._sampling(req, room)
        generated = await self._generate(session.id, prompt_ids, sampling)
        result = generated.result

        parsed = self.renderer.parse_completion(result.token_ids, prompt_ids, req.tools)
        finish = result.finish_reason
        if finish == "stop" and parsed.has_tool_calls:
            finish = "tool_calls"
        if finish not in ("stop", "length", "tool_calls"):
            raise GatewayError(
                502, f"replica ended the call with '{finish}'", type="upstream_error"
            )

        index = self._next_index.get(session.id)
        if index is None:
            index = previous.index + 1 if previous else 0
        self._next_index[session.id] = index + 1
        n = len(result.token_ids)
        record = CallRecord(
            session_id=session.id,
            index=index,
            request=raw,
            sampling=sampling,
            prompt_ids=prompt_ids,
            completion_ids=result.token_ids,
            logprobs=result.logprobs,
            versions=[VersionSpan(version=generated.version, start=0, end=n)] if n else [],
            finish_reason=result.finish_reason,
            replica=generated.replica.url,
            started_at=generated.started_at,
            ended_at=time.time(),
            interruptions=0,
            extends_previous=prompt.extends_previous,
        )
        await self.store.add_call(record)

        logprobs = None
        if req.logprobs:
            logprobs = ChoiceLogprobs(
                content=[
                    TokenLogprob(token=self.renderer.decode_token(t), logprob=lp)
                    for t, lp in zip(result.token_ids, result.logprobs, strict=True)
                ]
            )
        return ChatCompletionResponse(
            id=f"chatcmpl-{session.id[:8]}-{index}",
            model=self.config.model_name,
            choices=[ChatChoice(message=parsed.message, finish_reason=finish, logprobs=logprobs)],  # type: ignore[arg-type]
            usage=Usage(
                prompt_tokens=len(prompt_ids), completion_tokens=n, total_tokens=len(prompt_ids) + n
            ),
        )

    def _sampling(self, req: ChatCompletionRequest, room: int) -> dict[str, Any]:
        policy = self.config.sampling
        honor = policy.mode == "honor"
        temperature = (
            req.temperature if honor and req.temperature is not None else policy.temperature
        )
        top_p = req.top_p if honor and req.top_p is not None else policy.top_p
        sampling: dict[str, Any] = {
            "max_tokens": min(req.token_budget() or policy.max_tokens, room),
            "temperature": temperature,
            "top_p": top_p,
            "stop_token_ids": self.renderer.stop_token_ids,
            "skip_special_tokens": False,
        }
        if req.seed is not None:
            sampling["seed"] = req.seed
        return sampling

    async def _generate(
        self, session_id: str, prompt_ids: list[int], sampling: dict[str, Any]
    ) -> _Generated:
        tried: set[str] = set()
        async with self.gate.admit() as version:
            while True:
                replica = self.pool.pick(session_id, exclude=frozenset(tried))
                if replica is None:
                    raise unavailable(
                        "no healthy replica is available"
                        + (f" (tried {', '.join(sorted(tried))})" if tried else "")
                    )
                started = time.time()
                try:
                    async with self.pool.lease(replica):
                        result = await replica.generate(
                            prompt_ids, sampling, request_id=f"lg-{uuid.uuid4().hex}"
                        )
                except ReplicaUnavailable as exc:
                    log.warning(
                        "generation failed on %s, trying another replica: %s", replica.url, exc
                    )
                    self.pool.mark_unhealthy(replica)
                    tried.add(replica.url)
                    continue
                self.pool.record_success(replica)
                return _Generated(result, replica, version, started)

    # -- weight sync ----------------------------------------------------------------------------

    def status(self) -> GatewayStatus:
        return GatewayStatus(
            state=self.gate.state,
            version=self.gate.version,
            in_flight=self.gate.in_flight,
            waiting=self.gate.waiting,
            replicas=self.pool.status(),
        )

    async def load_weights(self, body: LoadWeights) -> dict[str, Any]:
        """Load a snapshot on every healthy replica; one that fails leaves the rotation."""
        if self.gate.state != "paused":
            raise conflict("pause the gateway before loading weights")
        loaded: list[str] = []
        failed: dict[str, str] = {}
        for client in self.pool.healthy_clients():
            try:
                await client.load_weights(body.path, body.version)
            except ReplicaUnavailable as exc:
                self.pool.mark_unhealthy(client)
                failed[client.url] = str(exc)
                continue
            self.pool.set_version(client, body.version)
            loaded.append(client.url)
        if not loaded:
            raise GatewayError(
                502,
                f"no replica loaded version {body.version}; still paused at version "
                f"{self.gate.version}: {failed}",
                type="upstream_error",
                code="load_failed",
            )
        return {"version": body.version, "loaded": loaded, "failed": failed}


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _parse_json(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object")
    return value


def _validate(model: type[M], raw: dict[str, Any]) -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        kind = first["type"]
        msg = (
            f"unsupported parameter '{where}'"
            if kind == "extra_forbidden"
            else f"{where}: {first['msg']}"
        )
        raise bad_request(msg, param=where or None) from exc


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    if req.n != 1:
        raise bad_request("n > 1 is not supported: start one session per rollout", param="n")
    if req.stream:
        raise bad_request("stream=true is not supported yet", param="stream")
    if req.stop is not None:
        raise bad_request("'stop' sequences are not supported yet", param="stop")
    if req.top_logprobs:
        raise bad_request("top_logprobs is not supported yet", param="top_logprobs")


def _previous_turn(call: CallRecord) -> PreviousTurn:
    req = ChatCompletionRequest.model_validate(call.request)
    return PreviousTurn(
        messages=[m.model_dump(exclude_none=True) for m in req.messages],
        tools=None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools],
        prompt_ids=call.prompt_ids,
        completion_ids=call.completion_ids,
    )


def create_app(config: GatewayConfig, http: httpx.AsyncClient | None = None) -> FastAPI:
    gateway = Gateway(config, http)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(title="lockgate gateway", lifespan=lifespan)
    app.state.gateway = gateway

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> Response:
        return _json(exc.body(), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return _json(bad_request(f"{where}: {first['msg']}", param=where or None).body(), 400)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> Response:
        log.exception("internal error")
        err = GatewayError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return _json(err.body(), 500)

    def require_admin(request: Request) -> None:
        if _bearer(request.headers.get("authorization")) != config.admin_token:
            raise unauthorized("admin endpoints need 'Authorization: Bearer <admin token>'")

    # -- agent API ------------------------------------------------------------------------------

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_by_path(session_id: str, request: Request) -> Response:
        session = gateway.session_by_path(session_id, request.headers.get("authorization"))
        return _json(await gateway.chat(session, await request.body()))

    @app.post("/v1/chat/completions")
    async def chat_by_key(request: Request) -> Response:
        session = gateway.session_by_key(request.headers.get("authorization"))
        return _json(await gateway.chat(session, await request.body()))

    def models_payload() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": config.model_name, "object": "model", "created": 0, "owned_by": "lockgate"}
            ],
        }

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(models_payload())

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str, request: Request) -> Response:
        gateway.session_by_path(session_id, request.headers.get("authorization"))
        return _json(models_payload())

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok", "state": gateway.gate.state, "version": gateway.gate.version})

    # -- admin API ------------------------------------------------------------------------------

    @app.post("/admin/sessions")
    async def create_session(request: Request) -> Response:
        require_admin(request)
        body = _validate(CreateSession, _parse_json(await request.body()))
        return _json(await gateway.create_session(body), 201)

    @app.get("/admin/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> Response:
        require_admin(request)
        gateway._require(session_id)
        return _json(await gateway.store.get_session(session_id))

    @app.post("/admin/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> Response:
        require_admin(request)
        body = _validate(FinishSession, _parse_json(await request.body()))
        await gateway.finish_session(session_id, body)
        return _json(await gateway.store.get_session(session_id))

    @app.post("/admin/sessions/{session_id}/reward")
    async def set_reward(session_id: str, request: Request) -> Response:
        require_admin(request)
        body = _validate(SetReward, _parse_json(await request.body()))
        gateway._require(session_id)
        await gateway.store.set_reward(session_id, body.reward)
        return _json(await gateway.store.get_session(session_id))

    @app.get("/admin/sessions/{session_id}/calls")
    async def get_calls(session_id: str, request: Request) -> Response:
        require_admin(request)
        gateway._require(session_id)
        calls = await gateway.store.get_calls(session_id)
        return _json({"calls": [c.model_dump(mode="json") for c in calls]})

    @app.get("/admin/sessions/{session_id}/samples")
    async def get_samples(session_id: str, request: Request) -> Response:
        require_admin(request)
        return _json(await gateway.samples(session_id))

    @app.get("/admin/status")
    async def status(request: Request) -> Response:
        require_admin(request)
        return _json(gateway.status())

    @app.post("/admin/pause")
    async def pause(request: Request) -> Response:
        require_admin(request)
        body = _validate(PauseRequest, _parse_json(await request.body() or b"{}"))
        await gateway.gate.pause(body.timeout_s)
        return _json(gateway.status())

    @app.post("/admin/weights")
    async def load_weights(request: Request) -> Response:
        require_admin(request)
        body = _validate(LoadWeights, _parse_json(await request.body()))
        return _json(await gateway.load_weights(body))

    @app.post("/admin/resume")
    async def resume(request: Request) -> Response:
        require_admin(request)
        body = _validate(ResumeRequest, _parse_json(await request.body()))
        await gateway.gate.resume(body.version)
        return _json(gateway.status())

    return app
