"""The agent-facing routes other than chat completions (those are chat_routes.py's):
`/v1/completions`, an agent's own reward, its notes on its session (metadata) and its end
(finish), each by session path and by session key, the model list, `/health` and the Prometheus `/metrics`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from lockgate.gateway.api.gateway import Gateway
from lockgate.gateway.api.responses import json_response
from lockgate.gateway.calls.bodies import parse_json, validate
from lockgate.gateway.calls.completions import complete, read_request
from lockgate.gateway.errors import conflict, too_large
from lockgate.gateway.metrics import CONTENT_TYPE
from lockgate.gateway.schema import FinishSession, SetMetadata, SetReward
from lockgate.gateway.store.trajectories import SessionRow

AgentHandler = Callable[[SessionRow, Request], Awaitable[Response]]

# An agent's own notes on its session, not a second trajectory store.
_MAX_METADATA_BYTES = 64 * 1024


def agent_routes(gateway: Gateway) -> APIRouter:
    """Routes an agent calls with its session's URL or key."""
    router = APIRouter()

    def agent_route(by_path: str, by_key: str, handler: AgentHandler) -> None:
        """Serve `handler` for a session named in the URL and for one named by its API key."""

        async def route_by_path(session_id: str, request: Request) -> Response:
            auth = request.headers.get("authorization")
            return await handler(gateway.session_by_path(session_id, auth), request)

        async def route_by_key(request: Request) -> Response:
            auth = request.headers.get("authorization")
            return await handler(gateway.session_by_key(auth), request)

        router.post(f"/sessions/{{session_id}}{by_path}")(route_by_path)
        router.post(by_key)(route_by_key)

    async def completion(session: SessionRow, request: Request) -> Response:
        release = gateway.admission.admit(session.id)
        try:
            raw, req = read_request(await request.body(), gateway.config)
            return json_response(await complete(gateway.calls, session, raw, req))
        finally:
            release()

    async def agent_reward(session: SessionRow, request: Request) -> Response:
        # An agent in another process (any language) reports its own reward here.
        body = validate(SetReward, parse_json(await request.body()))
        await gateway.store.set_reward(session.id, body.reward)
        return json_response({"session_id": session.id, "reward": body.reward})

    async def agent_metadata(session: SessionRow, request: Request) -> Response:
        body = await request.body()
        if len(body) > _MAX_METADATA_BYTES:
            raise too_large(f"metadata over {_MAX_METADATA_BYTES} bytes")
        update = validate(SetMetadata, parse_json(body))
        await gateway.store.merge_metadata(session.id, update.metadata)
        return json_response({"session_id": session.id, "keys": sorted(update.metadata)})

    async def agent_finish(session: SessionRow, request: Request) -> Response:
        # A client-driven rollout ends itself (its group completes with its last member); once.
        body = validate(FinishSession, parse_json(await request.body() or b"{}"))
        if session.status != "open":
            raise conflict(f"session '{session.id}' is already {session.status}")
        await gateway.finish_session(session.id, body)
        return json_response({"session_id": session.id, "status": body.status})

    agent_route("/v1/completions", "/v1/completions", completion)
    agent_route("/reward", "/v1/reward", agent_reward)
    agent_route("/metadata", "/v1/metadata", agent_metadata)
    agent_route("/finish", "/v1/finish", agent_finish)

    def models_payload() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": gateway.config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "lockgate",
                }
            ],
        }

    @router.get("/v1/models")
    async def models() -> Response:
        return json_response(models_payload())

    @router.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str, request: Request) -> Response:
        gateway.session_by_path(session_id, request.headers.get("authorization"))
        return json_response(models_payload())

    return router


def service_routes(gateway: Gateway) -> APIRouter:
    """`/health` and `/metrics`: open to anyone, as a load balancer and Prometheus expect."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        return json_response(
            {"status": "ok", "state": gateway.gate.state, "version": gateway.gate.version}
        )

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE)

    return router
