"""Client-driven rollouts over HTTP (the bookkeeping is enrolment.py).

Clients, with the run's enrolment key (or the admin token): `POST /v1/sessions` creates a
session in a group, `GET /v1/enrolment` says the group size, the model and the open groups.
The enrolment key reaches nothing else: every admin route compares against the admin token
only, and the session-key routes look up session keys only.

The coordinator, with the admin token: `PUT /admin/enrolment` opens it (again, after the
coordinator restarted: with the same key and group size it reopens the one open, keeping the
groups no coordinator was handed yet; enrolment.py), `POST
/admin/enrolment/admitted` raises the number of groups that may have started, `GET
/admin/enrolment/groups?after=SEQ&wait_s=S` answers the groups completed since SEQ, waiting up
to S seconds for one; groups past their time limit are closed then (enrolment.py).
"""

from __future__ import annotations

import math

from fastapi import APIRouter, Request
from starlette.responses import Response

from lockgate.gateway.api.admin_routes import is_admin_token, require_admin
from lockgate.gateway.api.enrolment import Enrolment, RetryLater
from lockgate.gateway.api.gateway import Gateway, bearer
from lockgate.gateway.api.responses import error_response, json_response
from lockgate.gateway.api.session_keys import ENROLMENT_KEY_PREFIX
from lockgate.gateway.calls.bodies import parse_json, validate
from lockgate.gateway.errors import bad_request, not_found, unauthorized
from lockgate.gateway.schema import (
    AdmitGroups,
    CompleteGroups,
    CreateSession,
    EnrolledSession,
    EnrolmentInfo,
    FinishSession,
    OpenEnrolment,
)

# The longest a collecting coordinator may hold one request open.
_MAX_WAIT_S = 60.0
# What a client with a key is told to wait when the run has not opened its enrolment yet.
_NOT_OPEN_RETRY_S = 2.0


def _enrolment_of(gateway: Gateway, request: Request) -> Enrolment:
    """The open enrolment, for a request with its key or the admin token."""
    key = bearer(request.headers.get("authorization"))
    enrolment = gateway.enrolment
    if enrolment is not None and enrolment.is_key(key):
        return enrolment
    admin = is_admin_token(gateway, key)
    if enrolment is None and not admin and key and key.startswith(ENROLMENT_KEY_PREFIX):
        # A client that read the run's key before the loop opened the enrolment is early.
        raise RetryLater(
            503, "the run has not opened its enrolment yet", "not_open", _NOT_OPEN_RETRY_S
        )
    if not admin:
        raise unauthorized("send 'Authorization: Bearer <the run's enrolment key>'")
    if enrolment is None:
        raise not_found("no enrolment is open: this run does not take client-driven rollouts")
    return enrolment


def _retry_later(gateway: Gateway, exc: RetryLater) -> Response:
    """The refusal with its Retry-After, counted like every error the gateway answers."""
    gateway.metrics.error(exc)
    response = error_response(exc)
    response.headers["Retry-After"] = f"{max(1, round(exc.retry_after_s))}"
    return response


def enrolment_routes(gateway: Gateway) -> APIRouter:
    router = APIRouter()
    _client_routes(router, gateway)
    _admin_routes(router, gateway)
    return router


def _client_routes(router: APIRouter, gateway: Gateway) -> None:
    """The enrolment key's routes."""

    @router.post("/v1/sessions")
    async def enrol_session(request: Request) -> Response:
        try:
            enrolment = _enrolment_of(gateway, request)
            body = validate(CreateSession, parse_json(await request.body()))
            admission = enrolment.admit(body.task_id, body.group_id, gateway.gate.version)
        except RetryLater as exc:
            return _retry_later(gateway, exc)
        try:
            created = await gateway.create_session(
                body.model_copy(update={"group_id": admission.group_id})
            )
        except BaseException:
            enrolment.give_back(admission)
            raise
        enrolment.created(admission, created.session_id)
        answer = EnrolledSession(
            **created.model_dump(),
            task_id=body.task_id,
            group_id=admission.group_id,
            members=admission.members,
            needed=admission.needed,
        )
        return json_response(answer, 201)

    @router.get("/v1/enrolment")
    async def enrolment_info(request: Request) -> Response:
        try:
            enrolment = _enrolment_of(gateway, request)
        except RetryLater as exc:
            return _retry_later(gateway, exc)
        info = EnrolmentInfo(
            model=gateway.config.model_name,
            version=gateway.gate.version,
            group_size=enrolment.group_size,
            groups_admitted=enrolment.groups_admitted,
            groups_started=enrolment.groups_started,
            open_groups=enrolment.open_groups(),
        )
        return json_response(info)


def _admin_routes(router: APIRouter, gateway: Gateway) -> None:
    """The coordinator's routes."""

    @router.put("/admin/enrolment")
    async def open_enrolment(request: Request) -> Response:
        require_admin(gateway, request)
        body = validate(OpenEnrolment, parse_json(await request.body()))
        current = gateway.enrolment
        if (
            current is not None
            and current.is_key(body.key)
            and current.group_size == body.group_size
        ):
            current.reopen(body)
        else:
            gateway.enrolment = Enrolment(body)
        return json_response({"group_size": gateway.enrolment.group_size})

    @router.post("/admin/enrolment/admitted")
    async def admit_groups(request: Request) -> Response:
        enrolment = _admin_enrolment(gateway, request)
        body = validate(AdmitGroups, parse_json(await request.body()))
        # Never lowered: a group admitted may already be running.
        enrolment.groups_admitted = max(enrolment.groups_admitted, body.groups_admitted)
        return json_response(
            {
                "groups_admitted": enrolment.groups_admitted,
                "groups_started": enrolment.groups_started,
            }
        )

    @router.get("/admin/enrolment/groups")
    async def complete_groups(request: Request, after: str = "0", wait_s: str = "0") -> Response:
        # Checked here, not by FastAPI: a caller without the token learns nothing of the route.
        enrolment = _admin_enrolment(gateway, request)
        try:
            seq, wait = int(after), float(wait_s)
        except ValueError:
            wait = math.nan
        if not math.isfinite(wait):
            raise bad_request("'after' is an integer and 'wait_s' a number of seconds")
        for session_id in enrolment.expired():
            failed = FinishSession(
                status="failed",
                error=f"timeout: its group was incomplete after {enrolment.timeout_s:g} s",
            )
            await gateway.finish_session(session_id, failed)
        groups = await enrolment.wait_complete_after(seq, min(max(wait, 0.0), _MAX_WAIT_S))
        return json_response(CompleteGroups(groups=groups, groups_started=enrolment.groups_started))


def _admin_enrolment(gateway: Gateway, request: Request) -> Enrolment:
    require_admin(gateway, request)
    if gateway.enrolment is None:
        raise not_found("no enrolment is open: PUT /admin/enrolment opens one")
    return gateway.enrolment
