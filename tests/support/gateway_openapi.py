"""An OpenAPI 3.1 document of the gateway's agent and admin routes, for fuzzing (issue 18).

The app's own `/openapi.json` cannot drive a fuzzer: the chat routes are answered ahead of
FastAPI (api/chat_routes.py) and every other route reads its body by hand (orjson, then the
pydantic model), so FastAPI knows none of the bodies. This document is derived from the same
pydantic request models the routes validate against, so it cannot drift from what they accept.

Path parameters `session_id` are placeholders (`SESSION_PLACEHOLDERS`) that the fuzz test maps
to real sessions for each case: a fresh open one, a finished one, or one that does not exist.
Authorization is not described here: each case is sent with valid, invalid and no credentials
by the test itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from lockgate.gateway.dialects.responses import ResponsesRequest
from lockgate.gateway.schema import (
    AddReplica,
    AdmitGroups,
    ChatCompletionRequest,
    CompletionRequest,
    CreateSession,
    FinishSession,
    LoadWeights,
    OpenEnrolment,
    PauseRequest,
    ResumeRequest,
    SetMetadata,
    SetReward,
    StageWeights,
)

# What a route's credentials are: the admin token, a session's key on plain /v1 (the key names
# the session), a session in the URL (its key optional, another session's refused), the run's
# enrolment key (client-driven rollouts; the admin token is taken there too), or none.
AuthKind = Literal["admin", "session_key", "session_path", "enrolment", "open"]

OPEN_SESSION = "open-session"
FINISHED_SESSION = "finished-session"
UNKNOWN_SESSION = "unknown-session"
SESSION_PLACEHOLDERS = [OPEN_SESSION, OPEN_SESSION, FINISHED_SESSION, UNKNOWN_SESSION]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    auth: AuthKind
    body: type[BaseModel] | None = None
    query: dict[str, dict[str, Any]] | None = None  # name -> JSON schema (all required)
    generates: bool = False  # a model call: records one call when it succeeds

    @property
    def label(self) -> str:
        return f"{self.method} {self.path}"


def _agent(path: str, body: type[BaseModel] | None, *, generates: bool = False) -> list[Route]:
    """The route by session path and by session key."""
    return [
        Route("POST", f"/sessions/{{session_id}}{path}", "session_path", body, generates=generates),
        Route(
            "POST",
            path if path.startswith("/v1") else f"/v1{path}",
            "session_key",
            body,
            generates=generates,
        ),
    ]


ROUTES: list[Route] = [
    *_agent("/v1/chat/completions", ChatCompletionRequest, generates=True),
    *_agent("/v1/completions", CompletionRequest, generates=True),
    *_agent("/v1/responses", ResponsesRequest, generates=True),
    *_agent("/reward", SetReward),
    *_agent("/metadata", SetMetadata),
    *_agent("/finish", FinishSession),
    Route("POST", "/v1/sessions", "enrolment", CreateSession),
    Route("GET", "/v1/enrolment", "enrolment"),
    Route("GET", "/v1/models", "open"),
    Route("GET", "/sessions/{session_id}/v1/models", "session_path"),
    Route("GET", "/health", "open"),
    Route("GET", "/metrics", "open"),
    Route("POST", "/admin/sessions", "admin", CreateSession),
    Route("GET", "/admin/sessions/{session_id}", "admin"),
    Route("POST", "/admin/sessions/{session_id}/finish", "admin", FinishSession),
    Route("POST", "/admin/sessions/{session_id}/reward", "admin", SetReward),
    Route("GET", "/admin/sessions/{session_id}/calls", "admin"),
    Route("GET", "/admin/sessions/{session_id}/samples", "admin"),
    Route("GET", "/admin/status", "admin"),
    Route("POST", "/admin/pause", "admin", PauseRequest),
    Route("POST", "/admin/weights", "admin", LoadWeights),
    Route("GET", "/admin/weights/layout", "admin"),
    Route("POST", "/admin/weights/stage", "admin", StageWeights),
    Route("POST", "/admin/resume", "admin", ResumeRequest),
    Route("POST", "/admin/replicas", "admin", AddReplica),
    Route("DELETE", "/admin/replicas", "admin", query={"url": {"type": "string"}}),
    Route("PUT", "/admin/enrolment", "admin", OpenEnrolment),
    Route("POST", "/admin/enrolment/admitted", "admin", AdmitGroups),
    # A long poll: the fuzz test pins wait_s small (ENROLMENT_WAIT_S).
    Route(
        "GET",
        "/admin/enrolment/groups",
        "admin",
        query={"after": {"type": "integer"}, "wait_s": {"type": "number"}},
    ),
]


def gateway_openapi() -> dict[str, Any]:
    models = sorted({r.body for r in ROUTES if r.body is not None}, key=lambda m: m.__name__)
    _, defs = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        operation: dict[str, Any] = {
            "operationId": route.label,
            "responses": {"default": {"description": "the answer, or an error in OpenAI's shape"}},
        }
        parameters = []
        if "{session_id}" in route.path:
            parameters.append(
                {
                    "name": "session_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "enum": sorted(set(SESSION_PLACEHOLDERS))},
                }
            )
        for name, schema in (route.query or {}).items():
            parameters.append({"name": name, "in": "query", "required": True, "schema": schema})
        if parameters:
            operation["parameters"] = parameters
        if route.body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{route.body.__name__}"}
                    }
                },
            }
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "lockgate gateway (agent and admin routes)", "version": "1"},
        "paths": paths,
        "components": {"schemas": defs["$defs"]},
    }
