"""The gateway's parts, held together: the store, the renderer, the replica pool, the pause
gate and sync controller, the call pipeline and the metrics; and the sessions by id and key.

The routes (app.py and the route groups beside it) are thin wrappers around this object.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid

import httpx

from lockgate.gateway.aiohttp_transport import AiohttpTransport
from lockgate.gateway.api.chat import ChatAnswers
from lockgate.gateway.api.enrolment import Enrolment
from lockgate.gateway.api.event_loop_lag import LoopLagMonitor
from lockgate.gateway.api.session_admission import SessionAdmission
from lockgate.gateway.api.session_keys import (
    SESSION_KEY_PREFIX,
    key_digest,
    new_session_key,
    stored_digest,
)
from lockgate.gateway.calls.pipeline import CallPipeline
from lockgate.gateway.calls.rendering import ChatRenderer
from lockgate.gateway.config import GatewayConfig
from lockgate.gateway.errors import not_found, unauthorized
from lockgate.gateway.metrics import GatewayMetrics
from lockgate.gateway.records.merge import merge_calls
from lockgate.gateway.replicas.adapters import AdapterSet
from lockgate.gateway.replicas.http1 import Http1Upstream
from lockgate.gateway.replicas.pause import PauseGate
from lockgate.gateway.replicas.pool import ReplicaPool
from lockgate.gateway.schema import (
    CreatedSession,
    CreateSession,
    DiskWeights,
    FinishSession,
    GatewayStatus,
    ReplicaStatus,
    SessionSamples,
)
from lockgate.gateway.store.trajectories import SessionRow, TrajectoryStore
from lockgate.gateway.sync.adapter_sync import AdapterSyncController
from lockgate.gateway.sync.control_plane import ControlPlane
from lockgate.gateway.sync.controller import SyncController

log = logging.getLogger(__name__)


class Gateway:
    """Holds the gateway's parts; the routes are thin wrappers around it."""

    def __init__(self, config: GatewayConfig, http: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.store = TrajectoryStore(config.db_path)
        self.renderer = ChatRenderer(config.model_dir, config.renderer)
        self._own_http = http is None
        # The gateway's own stack sends generate requests with its minimal HTTP/1.1 client and
        # admin calls through httpx on aiohttp; an injected client serves both.
        self._upstream = Http1Upstream(max_connections=1024) if http is None else None
        self.http = http or httpx.AsyncClient(transport=AiohttpTransport(max_connections=1024))
        self.pool = ReplicaPool(
            config.replicas,
            self.http,
            upstream=self._upstream,
            version=config.initial_version,
            engine_labels=config.adapter is None,
        )
        self.gate = PauseGate(config.initial_version, config.max_pause_wait_s)
        self.adapters: AdapterSet | None = None
        self._control: ControlPlane | None = None
        self.sync: SyncController
        if config.adapter is not None:
            self.adapters = AdapterSet(config.adapter.name)
            if config.initial_weights is not None:
                self.adapters.remember(config.initial_version, config.initial_weights)
            self.sync = AdapterSyncController(self.gate, self.pool, self.adapters)
        else:
            initial = config.initial_weights or (
                str(config.model_dir) if config.initial_version == 0 else None
            )
            # With its own HTTP stack the gateway sends abort pauses from a thread of their
            # own; an injected client (tests' mock transports) is reachable only from this loop.
            self._control = ControlPlane() if http is None else None
            self.sync = SyncController(
                self.gate, self.pool, DiskWeights(path=initial) if initial else None, self._control
            )
        self._sessions: dict[str, SessionRow] = {}
        self._by_key: dict[str, str] = {}
        # Client-driven rollouts, once the coordinator opens them (enrolment.py).
        self.enrolment: Enrolment | None = None
        self.metrics = GatewayMetrics(self.status)
        self.loop_lag = LoopLagMonitor(self.metrics.loop_lag.observe)
        self.calls = CallPipeline(
            config, self.store, self.renderer, self.gate, self.pool, self.metrics, self.adapters
        )
        self.chat = ChatAnswers(self.calls, self.metrics)
        limits = config.limits
        self.admission = SessionAdmission(
            max_in_flight=limits.max_calls_in_flight_per_session,
            per_minute=limits.max_calls_per_minute_per_session,
            burst=limits.calls_burst_per_session,
        )

    async def start(self) -> None:
        for row in await self.store.load_session_rows():
            row.key_digest = stored_digest(row.key_digest)
            self._remember(row)
        if self.adapters is not None:
            await self._load_initial_adapter(self.adapters)
        else:
            await self._label_and_resume_engines()
        self.pool.start()
        self.loop_lag.start()

    async def _label_and_resume_engines(self) -> None:
        # Label the replicas' engines with the version served, so the per-token version spans
        # vLLM returns agree with the gateway's from the first call (best effort: a replica that
        # is down now is labelled when its first weight load succeeds).
        await asyncio.gather(
            *(c.set_version_label(self.gate.version) for c in self.pool.clients),
            return_exceptions=True,
        )
        # A replica a previous gateway paused in vLLM and never resumed (it died mid-sync)
        # would hold every call forever; this gateway starts serving, so they serve too.
        await asyncio.gather(*(c.resume() for c in self.pool.clients), return_exceptions=True)

    async def _load_initial_adapter(self, adapters: AdapterSet) -> None:
        """Adapter mode leaves the engines as they are (other runs may share them): only the
        adapter of the version served is loaded, on every replica (best effort: one that fails
        now loads it when a call first finds it missing)."""
        version = self.gate.version
        path = self.config.initial_weights
        if path is None:
            return
        results = await asyncio.gather(
            *(adapters.load(c, version, path) for c in self.pool.clients), return_exceptions=True
        )
        for client, result in zip(self.pool.clients, results, strict=True):
            if isinstance(result, BaseException):
                log.warning(
                    "%s: adapter of version %d not loaded yet: %s", client.url, version, result
                )

    async def close(self) -> None:
        if isinstance(self.sync, AdapterSyncController):
            await self.sync.unloads_done()
        await self.loop_lag.stop()
        await self.pool.stop()
        self.calls.close()
        if self._own_http:
            await self.http.aclose()
        if self._upstream is not None:
            await self._upstream.aclose()
        if self._control is not None:
            await self._control.aclose()
        await self.store.flush()
        self.store.close()

    def _remember(self, row: SessionRow) -> None:
        self._sessions[row.id] = row
        self._by_key[row.key_digest] = row.id

    # -- sessions -------------------------------------------------------------------------------

    async def create_session(self, body: CreateSession) -> CreatedSession:
        session_id = uuid.uuid4().hex
        api_key = new_session_key()
        digest = key_digest(api_key)
        await self.store.create_session(
            session_id, digest, body.task_id, body.group_id, body.metadata
        )
        self._remember(SessionRow(session_id, digest, "open"))
        self.calls.begin_session(session_id)
        return CreatedSession(
            session_id=session_id, api_key=api_key, base_url=f"/sessions/{session_id}/v1"
        )

    def session_by_path(self, session_id: str, authorization: str | None) -> SessionRow:
        row = self._sessions.get(session_id)
        if row is None:
            raise not_found(f"unknown session '{session_id}'")
        key = bearer(authorization)
        # The session id in the path is the capability; a lockgate key for another session is
        # still refused so that one session's credentials never act on another.
        if (
            key is not None
            and key.startswith(SESSION_KEY_PREFIX)
            and not hmac.compare_digest(key_digest(key), row.key_digest)
        ):
            raise unauthorized("this API key belongs to a different session")
        return row

    def session_by_key(self, authorization: str | None) -> SessionRow:
        key = bearer(authorization)
        if key is None:
            raise unauthorized("missing API key: send 'Authorization: Bearer <session key>'")
        session_id = self._by_key.get(key_digest(key))
        if session_id is None:
            raise unauthorized("invalid API key: not a key of any session")
        return self._sessions[session_id]

    async def finish_session(self, session_id: str, body: FinishSession) -> None:
        row = self.require(session_id)
        await self.store.finish_session(session_id, body.status, body.reward, body.error)
        row.status = body.status
        self.pool.forget_session(session_id)
        self.calls.end_session(session_id)
        self.admission.forget(session_id)
        if self.enrolment is not None:
            self.enrolment.ended(session_id)

    def require(self, session_id: str) -> SessionRow:
        row = self._sessions.get(session_id)
        if row is None:
            raise not_found(f"unknown session '{session_id}'")
        return row

    async def samples(self, session_id: str) -> SessionSamples:
        self.require(session_id)
        info = await self.store.get_session(session_id)
        assert info is not None
        calls = await self.store.get_calls(session_id)
        samples, splits = merge_calls(calls)
        return SessionSamples(session=info, samples=samples, splits=splits)

    # -- status ---------------------------------------------------------------------------------

    def status(self) -> GatewayStatus:
        return GatewayStatus(
            state=self.gate.state,
            version=self.gate.version,
            in_flight=self.gate.in_flight,
            waiting=self.gate.waiting,
            interruptions=self.gate.interruptions,
            tokens_kept=self.gate.tokens_kept,
            replicas=self._replicas_status(),
        )

    def _replicas_status(self) -> list[ReplicaStatus]:
        replicas = self.pool.status()
        if self.adapters is None:
            return replicas
        adapters = self.adapters
        return [r.model_copy(update={"adapter": adapters.model_for(r.version)}) for r in replicas]


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None
