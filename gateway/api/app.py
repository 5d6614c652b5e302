"""The gateway's HTTP app: the agent-facing OpenAI API and the admin API.

`create_app` puts together the parts (`Gateway`, gateway.py), the request body limit and the
chat routes, both answered ahead of FastAPI (body_limit.py, chat_routes.py), errors in OpenAI's
shape, and the route groups: agent routes and `/health` + `/metrics` (agent_routes.py), admin
routes for sessions, sync and replicas (admin_routes.py), and the trajectory viewer and run
dashboard under `/ui/` (admin-only; viewer/routes.py), which reads the store on its own threads.

Request path of a chat call: a body within the size limit -> identify the session -> validate
(the request's bounds first, calls/bounds.py) -> apply the sampling policy -> render (bridging
the previous call's exact tokens where possible; a large prompt off the event loop) -> wait for
the pause gate -> generate on a replica (failing over to another if one is unreachable) ->
parse -> record durably -> answer (calls/pipeline.py, then chat.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from lockgate.gateway.api.admin_routes import pool_routes, session_routes, sync_routes
from lockgate.gateway.api.agent_routes import agent_routes, service_routes
from lockgate.gateway.api.body_limit import BodyLimit
from lockgate.gateway.api.chat_routes import GatewayAPI
from lockgate.gateway.api.enrolment_routes import enrolment_routes
from lockgate.gateway.api.gateway import Gateway
from lockgate.gateway.api.messages_routes import AnthropicErrors, messages_routes
from lockgate.gateway.api.responses import error_response, internal_error
from lockgate.gateway.api.responses_routes import responses_routes
from lockgate.gateway.config import GatewayConfig
from lockgate.gateway.errors import GatewayError, bad_request
from lockgate.gateway.metrics import MetricsMiddleware
from lockgate.gateway.viewer.routes import Viewer, ViewerSource, viewer_routes


def create_app(config: GatewayConfig, http: httpx.AsyncClient | None = None) -> FastAPI:
    gateway = Gateway(config, http)
    viewer = Viewer(
        ViewerSource(
            db_path=config.db_path,
            admin_token=config.admin_token,
            metrics_path=config.metrics_path,
            model_dir=config.model_dir,
            status=gateway.status,
            advantages=config.advantages,
            title=f"lockgate gateway: {config.model_name}",
        )
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            viewer.close()
            await gateway.close()

    app = GatewayAPI(title="lockgate gateway", lifespan=lifespan)
    app.state.gateway = gateway
    app.add_middleware(MetricsMiddleware, metrics=gateway.metrics)
    # Chat calls are answered before FastAPI's own machinery (chat_routes.py).
    app.answer_chat_calls(gateway)
    # A body over the limit is refused before any route reads it (body_limit.py).
    app.put_in_front(lambda inner: BodyLimit(inner, config.limits, gateway.metrics.error))
    # Outside that: errors on the Messages API's paths in Anthropic's shape (messages_routes.py).
    app.put_in_front(AnthropicErrors)
    _answer_errors(app, gateway)
    for routes in (
        agent_routes,
        service_routes,
        session_routes,
        sync_routes,
        pool_routes,
        enrolment_routes,
    ):
        app.include_router(routes(gateway))
    app.include_router(responses_routes(gateway))  # OpenAI's Responses API, over the pipeline
    app.include_router(messages_routes(gateway))  # Anthropic's Messages API, over the pipeline
    app.include_router(viewer_routes(viewer))
    return app


def _answer_errors(app: FastAPI, gateway: Gateway) -> None:
    """Every error in OpenAI's shape, counted: the gateway's own, unknown paths and methods,
    FastAPI's validation failures (as 400s) and anything unplanned (a logged 500)."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> Response:
        gateway.metrics.error(exc)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # A path no route serves, or a method it does not take: Starlette's own 404 / 405 were
        # `{"detail": ...}`, which OpenAI's clients cannot read (found by fuzzing, issue 18).
        where = f"{request.method} {request.url.path}"
        message = f"Invalid URL ({where})" if exc.status_code == 404 else f"{exc.detail} ({where})"
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        err = GatewayError(exc.status_code, message, code=code)
        gateway.metrics.error(err)
        response = error_response(err)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        err = bad_request(f"{where}: {first['msg']}", param=where or None)
        gateway.metrics.error(err)
        return error_response(err)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> Response:
        err = internal_error(exc)
        gateway.metrics.error(err)
        return error_response(err)
