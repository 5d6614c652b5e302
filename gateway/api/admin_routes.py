"""The admin API (`/admin/...`, bearer admin token): sessions and their records, weight sync,
replicas. What each route takes and answers is in docs/gateway-api.md."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from starlette.responses import Response

from lockgate.gateway.api.gateway import Gateway, bearer
from lockgate.gateway.api.responses import json_response
from lockgate.gateway.calls.bodies import parse_json, validate
from lockgate.gateway.errors import bad_request, not_found, unauthorized
from lockgate.gateway.schema import (
    AddReplica,
    CreateSession,
    FinishSession,
    LoadWeights,
    PauseRequest,
    ResumeRequest,
    SetReward,
    StageWeights,
)


def is_admin_token(gateway: Gateway, token: str | None) -> bool:
    """Constant-time comparison: how long a wrong token takes says nothing about the right one."""
    expected = gateway.config.admin_token.encode()
    return token is not None and hmac.compare_digest(token.encode(), expected)


def require_admin(gateway: Gateway, request: Request) -> None:
    if not is_admin_token(gateway, bearer(request.headers.get("authorization"))):
        raise unauthorized("admin endpoints need 'Authorization: Bearer <admin token>'")


def session_routes(gateway: Gateway) -> APIRouter:
    """Sessions: create, read, finish, reward; their recorded calls and training samples."""
    router = APIRouter()

    @router.post("/admin/sessions")
    async def create_session(request: Request) -> Response:
        require_admin(gateway, request)
        body = validate(CreateSession, parse_json(await request.body()))
        return json_response(await gateway.create_session(body), 201)

    @router.get("/admin/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> Response:
        require_admin(gateway, request)
        gateway.require(session_id)
        return json_response(await gateway.store.get_session(session_id))

    @router.post("/admin/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> Response:
        require_admin(gateway, request)
        body = validate(FinishSession, parse_json(await request.body()))
        await gateway.finish_session(session_id, body)
        return json_response(await gateway.store.get_session(session_id))

    @router.post("/admin/sessions/{session_id}/reward")
    async def set_reward(session_id: str, request: Request) -> Response:
        require_admin(gateway, request)
        body = validate(SetReward, parse_json(await request.body()))
        gateway.require(session_id)
        await gateway.store.set_reward(session_id, body.reward)
        return json_response(await gateway.store.get_session(session_id))

    @router.get("/admin/sessions/{session_id}/calls")
    async def get_calls(session_id: str, request: Request) -> Response:
        require_admin(gateway, request)
        gateway.require(session_id)
        calls = await gateway.store.get_calls(session_id)
        return json_response({"calls": [c.model_dump(mode="json") for c in calls]})

    @router.get("/admin/sessions/{session_id}/samples")
    async def get_samples(session_id: str, request: Request) -> Response:
        require_admin(gateway, request)
        return json_response(await gateway.samples(session_id))

    return router


def sync_routes(gateway: Gateway) -> APIRouter:
    """Status and weight sync: pause, load (or stage) weights, the snapshot layout, resume."""
    router = APIRouter()

    @router.get("/admin/status")
    async def status(request: Request) -> Response:
        require_admin(gateway, request)
        return json_response(gateway.status())

    @router.post("/admin/pause")
    async def pause(request: Request) -> Response:
        require_admin(gateway, request)
        body = validate(PauseRequest, parse_json(await request.body() or b"{}"))
        report = await gateway.sync.pause(body.mode, body.timeout_s)
        return json_response(
            {**gateway.status().model_dump(mode="json"), "pause": report.model_dump()}
        )

    @router.post("/admin/weights")
    async def load_weights(request: Request) -> Response:
        require_admin(gateway, request)
        body = validate(LoadWeights, parse_json(await request.body()))
        return json_response(await gateway.sync.load(body.source, body.version))

    @router.get("/admin/weights/layout")
    async def weights_layout(request: Request) -> Response:
        require_admin(gateway, request)
        return json_response(await gateway.sync.layout())

    @router.post("/admin/weights/stage")
    async def stage_weights(request: Request) -> Response:
        require_admin(gateway, request)
        body = validate(StageWeights, parse_json(await request.body()))
        return json_response(await gateway.sync.stage(body.source, body.slice_s))

    @router.post("/admin/resume")
    async def resume(request: Request) -> Response:
        require_admin(gateway, request)
        body = validate(ResumeRequest, parse_json(await request.body()))
        await gateway.sync.resume(body.version)
        return json_response(gateway.status())

    return router


def pool_routes(gateway: Gateway) -> APIRouter:
    """Replicas joining and leaving the pool at run time."""
    router = APIRouter()

    @router.post("/admin/replicas")
    async def add_replica(request: Request) -> Response:
        require_admin(gateway, request)
        body = validate(AddReplica, parse_json(await request.body()))
        gateway.pool.add(body.url, gateway.gate.version if body.version is None else body.version)
        return json_response(gateway.status(), 201)

    @router.delete("/admin/replicas")
    async def remove_replica(request: Request, url: str | None = None) -> Response:
        # `url` is checked here, not by FastAPI: a caller without the token learns nothing,
        # not even which parameters the route takes (FastAPI validates before the handler).
        require_admin(gateway, request)
        if url is None:
            raise bad_request(
                "query parameter 'url' is required: the replica to remove", param="url"
            )
        if not gateway.pool.remove(url):
            raise not_found(f"no replica '{url}'")
        return json_response(gateway.status())

    return router
