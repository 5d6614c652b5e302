"""The viewer's HTTP side: `/ui/` (the page, its static files) and `/ui/api/...` (its data),
admin-only, mounted on the gateway (api/app.py) or on a run's store alone (serve.py).

Auth: the gateway's admin token, as `Authorization: Bearer <token>` or as a cookie a browser
gets by opening `/ui/?token=<token>` once or through the login form; the cookie holds an HMAC
of the token (never the token), HttpOnly and SameSite=Strict, compared in constant time.
Without either, every route answers 401 (the page with a login form, the data routes JSON).

Reads never touch the gateway's hot path: they run on the viewer's own two threads, each with
its own read-only SQLite connection (WAL lets them read while the store's thread writes), and
the event loop only hands over the finished JSON bytes. Nothing is opened until the first view.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from lockgate.gateway.records.advantages import AdvantageSpec
from lockgate.gateway.viewer import query
from lockgate.gateway.viewer.run_metrics import MetricsFile
from lockgate.gateway.viewer.tokens import TokenTexts

T = TypeVar("T")

STATIC = Path(__file__).parent / "static"
COOKIE = "lockgate_viewer"
_COOKIE_CONTEXT = b"lockgate viewer cookie v1"
_STATIC_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript"}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass
class ViewerSource:
    """What a viewer shows and who may see it."""

    db_path: Path
    admin_token: str
    metrics_path: Path | None = None  # the run's metrics.jsonl, for the dashboard
    model_dir: Path | None = None  # its tokenizer.json gives the token texts
    status: Callable[[], BaseModel] | None = None  # the live gateway's status, if any
    advantages: AdvantageSpec | None = None  # how the run computes them; None: GRPO
    title: str = "lockgate"
    extra: dict[str, Any] = field(default_factory=dict)  # shown in the header (run dir, ...)


class Viewer:
    """The store read on the viewer's own threads and connections, and the run's metrics."""

    def __init__(self, source: ViewerSource, threads: int = 2) -> None:
        self.source = source
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="lockgate-viewer")
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self.texts = TokenTexts(source.model_dir)
        self.metrics = MetricsFile(source.metrics_path)
        self.cookie = hmac.new(
            source.admin_token.encode(), _COOKIE_CONTEXT, hashlib.sha256
        ).hexdigest()

    # -- reading ---------------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None and self._local.immutable and _has_wal(self.source.db_path):
            # A writer opened the store after this connection took it for finished.
            with self._conns_lock:
                self._conns.remove(conn)
            conn.close()
            conn = None
        if conn is None:
            live = _has_wal(self.source.db_path)
            conn = open_read_only(self.source.db_path, live=live)
            self._local.conn = conn
            self._local.immutable = not live
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn(connection)` on one of the viewer's threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(self._connect()))

    async def run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()

    # -- auth ------------------------------------------------------------------------------------

    def token_ok(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(
            token.encode(), self.source.admin_token.encode()
        )

    def authorized(self, request: Request) -> bool:
        if self.token_ok(_bearer(request.headers.get("authorization"))):
            return True
        cookie = request.cookies.get(COOKIE)
        return cookie is not None and hmac.compare_digest(cookie.encode(), self.cookie.encode())

    def with_cookie(self, response: Response) -> Response:
        response.set_cookie(COOKIE, self.cookie, httponly=True, samesite="strict", path="/ui")
        return response


def open_read_only(path: Path, live: bool | None = None) -> sqlite3.Connection:
    """A read-only connection to the store that never writes beside it.

    A store with a write-ahead log is being written (a gateway has it open) or was left by
    one that died: it is read with `mode=ro` through the WAL index its writer keeps. A store
    without one was closed cleanly (everything is in the file) and is opened `immutable`: no
    locks, and no -wal / -shm files made in the run dir (which `mode=ro` would leave behind);
    `Viewer` reopens it with `mode=ro` if a writer opens the store later.
    """
    uri = f"file:{quote(str(path.resolve()))}"
    live = _has_wal(path) if live is None else live
    conn = sqlite3.connect(
        f"{uri}?{'mode=ro' if live else 'immutable=1'}",
        uri=True,
        isolation_level=None,
        check_same_thread=False,
    )
    conn.execute("PRAGMA query_only=1")
    return conn


def _has_wal(path: Path) -> bool:
    return Path(f"{path}-wal").exists()


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _error(status: int, message: str, type_: str) -> Response:
    return Response(
        orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": None}}),
        status_code=status,
        media_type="application/json",
    )


def _unauthorized() -> Response:
    return _error(401, "the viewer needs the admin token (Bearer header or login)", "auth")


def _login_page(message: str = "") -> HTMLResponse:
    note = f'<p class="err">{escape(message)}</p>' if message else ""
    return HTMLResponse(
        "<!doctype html><html><head><meta charset=utf-8><title>lockgate viewer: sign in</title>"
        "<style>body{font:14px system-ui,sans-serif;background:#f6f7f9;display:flex;"
        "justify-content:center;padding-top:15vh}form{background:#fff;padding:24px 28px;"
        "border:1px solid #ddd;border-radius:8px}input{font:inherit;padding:6px;width:22em}"
        "button{font:inherit;padding:6px 14px;margin-left:6px}.err{color:#b00}</style></head>"
        '<body><form method="post" action="/ui/login"><h2>lockgate viewer</h2>'
        f"<p>Admin token of the gateway (or of <code>lockgate view</code>):</p>{note}"
        '<input type="password" name="token" autofocus autocomplete="current-password">'
        "<button>Open</button></form></body></html>",
        status_code=401,
    )


def _filters(request: Request) -> query.SessionFilter:
    raw: dict[str, Any] = {}
    for key in query.SessionFilter.model_fields:
        value = request.query_params.get(key, "").strip()
        if value == "":
            continue
        if key in ("interrupted", "splits"):
            if value.lower() not in _BOOLS:
                raise ValueError(f"{key} must be true or false, got {value!r}")
            raw[key] = _BOOLS[value.lower()]
        else:
            raw[key] = value
    return query.SessionFilter.model_validate(raw)


def _bad(exc: Exception) -> Response:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return _error(400, f"{where}: {first['msg']}", "invalid_request_error")
    return _error(400, str(exc), "invalid_request_error")


def viewer_routes(viewer: Viewer) -> APIRouter:
    router = APIRouter()
    _page_routes(router, viewer)
    _store_routes(router, viewer)
    _metrics_route(router, viewer)
    return router


def _page_routes(router: APIRouter, viewer: Viewer) -> None:
    """The page, signing in and out, and the page's static files."""

    @router.get("/ui", include_in_schema=False)
    async def ui_root(request: Request) -> Response:
        q = f"?{request.url.query}" if request.url.query else ""
        return RedirectResponse(f"/ui/{q}", status_code=307)

    @router.get("/ui/", include_in_schema=False)
    async def page(request: Request) -> Response:
        token = request.query_params.get("token")
        if token is not None:
            # A link with the token signs the browser in; the token leaves the address bar.
            if not viewer.token_ok(token):
                return _login_page("That token is not the admin token.")
            return viewer.with_cookie(RedirectResponse("/ui/", status_code=303))
        if not viewer.authorized(request):
            return _login_page()
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})

    @router.post("/ui/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        body = (await request.body())[:4096].decode(errors="replace")
        token = (parse_qs(body).get("token") or [None])[0]
        if not viewer.token_ok(token):
            return _login_page("That token is not the admin token.")
        return viewer.with_cookie(RedirectResponse("/ui/", status_code=303))

    @router.get("/ui/logout", include_in_schema=False)
    async def logout() -> Response:
        response = RedirectResponse("/ui/", status_code=303)
        response.delete_cookie(COOKIE, path="/ui")
        return response

    @router.get("/ui/static/{name}", include_in_schema=False)
    async def static(name: str, request: Request) -> Response:
        if not viewer.authorized(request):
            return _unauthorized()
        path = STATIC / name
        kind = _STATIC_TYPES.get(path.suffix)
        if kind is None or "/" in name or not path.is_file():
            return _error(404, f"no static file {name!r}", "not_found_error")
        return FileResponse(path, media_type=kind, headers={"cache-control": "no-cache"})


def _store_routes(router: APIRouter, viewer: Viewer) -> None:
    """The page's data from the store: the overview, the sessions list, one session and the
    live feed, each read on the viewer's threads."""

    @router.get("/ui/api/overview")
    async def overview(request: Request) -> Response:
        if not viewer.authorized(request):
            return _unauthorized()

        # The gateway's state is read here, on its event loop, never from the viewer's threads.
        status = viewer.source.status
        gateway = status().model_dump(mode="json") if status is not None else None

        def read(conn: sqlite3.Connection) -> bytes:
            data = query.overview(conn).model_dump(mode="json")
            data["title"] = viewer.source.title
            data["store"] = str(viewer.source.db_path)
            data["extra"] = viewer.source.extra
            data["gateway"] = gateway
            return orjson.dumps(data)

        return Response(await viewer.read(read), media_type="application/json")

    @router.get("/ui/api/sessions")
    async def sessions(request: Request) -> Response:
        if not viewer.authorized(request):
            return _unauthorized()
        try:
            filters = _filters(request)
            limit = int(request.query_params.get("limit") or query.DEFAULT_LIMIT)
            cursor = request.query_params.get("cursor") or None
            return Response(
                await viewer.read(
                    lambda c: query.list_sessions(c, filters, cursor, limit).model_dump_json()
                ),
                media_type="application/json",
            )
        except (ValueError, ValidationError) as exc:
            return _bad(exc)

    @router.get("/ui/api/sessions/{session_id}")
    async def session(session_id: str, request: Request) -> Response:
        if not viewer.authorized(request):
            return _unauthorized()

        def read(conn: sqlite3.Connection) -> bytes | None:
            detail = query.session_detail(conn, session_id, viewer.texts, viewer.source.advantages)
            return None if detail is None else detail.model_dump_json().encode()

        body = await viewer.read(read)
        if body is None:
            return _error(404, f"unknown session '{session_id}'", "not_found_error")
        return Response(body, media_type="application/json")

    @router.get("/ui/api/changes")
    async def changes(request: Request) -> Response:
        if not viewer.authorized(request):
            return _unauthorized()
        try:
            filters = _filters(request)
            raw = request.query_params.get("cursor")
            if not raw:
                raise ValueError("changes needs the cursor of /ui/api/overview or a last poll")
            cursor = query.Cursor.decode(raw)
            return Response(
                await viewer.read(
                    lambda c: query.changes_since(c, cursor, filters).model_dump_json()
                ),
                media_type="application/json",
            )
        except (ValueError, ValidationError) as exc:
            return _bad(exc)


def _metrics_route(router: APIRouter, viewer: Viewer) -> None:
    """The run's metrics for the dashboard, read on the viewer's threads."""

    @router.get("/ui/api/metrics")
    async def metrics(request: Request) -> Response:
        if not viewer.authorized(request):
            return _unauthorized()
        return Response(
            await viewer.run(lambda: viewer.metrics.read().model_dump_json()),
            media_type="application/json",
        )
