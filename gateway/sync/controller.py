"""Weight sync, the gateway's side: (stage,) pause (abort | keep | drain), load + verify, resume.

- `abort` (default): the gateway cuts every segment in flight at once by closing its stream
  (vLLM aborts a request whose client went away); the calls keep every token received and
  wait at the gate. In parallel each replica pauses in vLLM itself (`/pause?mode=abort`),
  which also aborts anything that reached the engine meanwhile and leaves it quiescent for
  the load. Not waiting for vLLM's own abort chunks matters: on busy CPUs its pause takes
  hundreds of milliseconds, during which the calls would go on generating.
  Paused = no segment in flight and every replica paused.
- `keep`: vLLM freezes running requests; they continue after resume under the new weights,
  and the replica's own version spans say which tokens came from which weights.
- `drain`: no new segments; in-flight ones finish under the old weights (strictly on-policy).

Before the pause, `stage` can prepare the load on every replica while they serve (the disk
transport's direct load builds the new kernel handles between engine steps), so the load in
the pause only swaps them in; a replica that could not stage loads in full, as without it.

A load goes to every replica; one that fails (or does not report the new version label
afterwards) leaves the rotation rather than serve old weights. If none loads, the replicas
still hold, and the gateway still serves, the old version, and the error says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence

from lockgate.gateway.errors import GatewayError, bad_request, conflict
from lockgate.gateway.replicas.pause import PauseGate
from lockgate.gateway.replicas.pool import ReplicaPool
from lockgate.gateway.replicas.replica_client import ReplicaClient, ReplicaUnavailable
from lockgate.gateway.schema import (
    AdapterWeights,
    CollectiveWeights,
    DiskWeights,
    LoadReport,
    NcclWeights,
    PauseMode,
    PauseReport,
    StagedReplica,
    StageReport,
    WeightsLayout,
    WeightSource,
)
from lockgate.gateway.sync.control_plane import ControlPlane, PauseResults
from lockgate.gateway.sync.weights import NotStaged, WeightTransport, kernel_layout, transport_for

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No garbage collection starts while the gateway pauses (abort, keep: quick by design;
    drain waits for whole calls and collects as usual): a full one walks every session's
    state with the event loop stopped (measured in benchmarks/README.md, "Scale simulation"),
    and every replica keeps generating until the pause reaches it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _full_weights(source: WeightSource) -> DiskWeights | NcclWeights | CollectiveWeights:
    if isinstance(source, AdapterWeights):
        raise bad_request(
            "this gateway serves full weights: an 'adapter' source needs a gateway started in "
            "adapter mode (`adapter` in its config) on replicas with LoRA enabled",
            param="transport",
        )
    return source


class SyncController:
    def __init__(
        self,
        gate: PauseGate,
        pool: ReplicaPool,
        current: WeightSource | None = None,
        control: ControlPlane | None = None,
    ) -> None:
        self.gate = gate
        self.pool = pool
        # Where abort pauses are sent from (control_plane.py); None: this loop's own clients.
        self._control = control
        # Where the weights being served came from: what a replica is restored from when a
        # load fails everywhere (None: unknown, no restore).
        self._current: WeightSource | None = current
        self._paused_replicas: set[str] = set()  # replicas we paused in vLLM itself
        self._lock = asyncio.Lock()
        self._stage_lock = asyncio.Lock()

    async def pause(self, mode: PauseMode, timeout_s: float) -> PauseReport:
        async with self._lock:
            if self.gate.state != "serving":
                raise conflict(f"the gateway is {self.gate.state}; resume it before pausing again")
            # A drain waits out whole calls: minutes without a collection.
            with contextlib.nullcontext() if mode == "drain" else _no_collection():
                return await self._pause(mode, timeout_s)

    async def _pause(self, mode: PauseMode, timeout_s: float) -> PauseReport:
        started = time.perf_counter()
        cut_before, kept_before = self.gate.interruptions, self.gate.tokens_kept
        await self.gate.set_state("pausing")
        try:
            idle_s, replicas_s, engines_s = await self._quiesce(mode, timeout_s, started)
        except BaseException:
            await self._undo_pause()
            raise
        await self.gate.set_state("paused")
        return PauseReport(
            mode=mode,
            latency_s=time.perf_counter() - started,
            interrupted=self.gate.interruptions - cut_before,
            tokens_kept=self.gate.tokens_kept - kept_before,
            frozen=self.gate.in_flight if mode == "keep" else 0,
            version=self.gate.version,
            streams_closed_s=idle_s,
            replicas_paused_s=replicas_s,
            engines_paused_s=engines_s,
        )

    async def _quiesce(
        self, mode: PauseMode, timeout_s: float, started: float
    ) -> tuple[float, float, float | None]:
        """Bring the calls and the replicas to rest for `mode`: when every cut stream closed and
        when every replica paused (seconds since `started`, abort only), and the longest time an
        engine reported taking to pause."""
        idle_s = replicas_s = 0.0
        engines_s: float | None = None
        if mode == "abort":
            # Cut first: an engine asked to pause with its streams still running waits out
            # a longer step and aborts them itself, which made pauses slower (measured in
            # benchmarks/README.md, "Scale simulation").
            self._cut_segments()
            if any(seg.constrained for seg in self.gate.segments.values()):
                # Constrained segments finish before vLLM's own pause would abort them.
                await self._wait_idle_or_fail(timeout_s, mode)

            # Sent before this coroutine awaits anything (control_plane.py).
            clients, sent = self._send_pauses("abort")

            async def replicas_paused() -> float:
                nonlocal engines_s
                engines_s, answered_at = await self._pause_replicas("abort", clients, sent)
                return answered_at - started

            async def idle() -> float:
                await self._wait_idle_or_fail(timeout_s, mode)
                return time.perf_counter() - started

            # Side by side: the cut streams wind down while vLLM pauses its engines.
            paused = asyncio.ensure_future(replicas_paused())
            try:
                idle_s = await idle()
            finally:
                # Also when the wait fails: the undo must not resume a replica before its
                # pause has arrived, or that replica stays paused.
                replicas_s = await paused
        elif mode == "keep":
            engines_s, _ = await self._pause_replicas("keep", *self._send_pauses("keep"))
        else:
            await self._wait_idle_or_fail(timeout_s, mode)
        return idle_s, replicas_s, engines_s

    def _send_pauses(
        self, mode: str
    ) -> tuple[list[ReplicaClient], asyncio.Future[PauseResults] | None]:
        """The healthy replicas, and their pauses already on the way through the control plane
        (None: sent from this loop by `_pause_replicas`). Only `abort` goes through it, the
        pause that was measured slow on a busy loop; `keep` is sent from this loop as before."""
        clients = self.pool.healthy_clients()
        # A pause can take effect in vLLM even if its answer never comes back (the pause is
        # cancelled or fails meanwhile): an undo resumes every replica it was sent to, which is
        # harmless for one that never paused.
        self._paused_replicas.update(c.url for c in clients)
        if self._control is None or mode != "abort":
            return clients, None
        return clients, asyncio.wrap_future(self._control.submit([c.url for c in clients], mode))

    async def _pause_replicas(
        self,
        mode: str,
        clients: list[ReplicaClient],
        sent: asyncio.Future[PauseResults] | None,
    ) -> tuple[float | None, float]:
        """Pause `clients` in vLLM (or wait for `sent`): the longest time an engine reported
        taking, and when the last one answered (`time.perf_counter`)."""
        results: list[float | BaseException | None]
        if sent is not None:
            paused = await sent
            results, answered_at = paused.results, paused.answered_at
        else:
            results = await asyncio.gather(
                *(c.pause(mode) for c in clients), return_exceptions=True
            )
            answered_at = time.perf_counter()
        engines_s: float | None = None
        for client, result in zip(clients, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("replica %s did not pause (%s); out of rotation", client.url, result)
                self._paused_replicas.discard(client.url)
                self.pool.mark_unhealthy(client)
                self._cut_segments(client.url)
            elif result is not None:
                engines_s = max(result, engines_s or 0.0)
        return engines_s, answered_at

    def _cut_segments(self, replica: str | None = None) -> None:
        for segment in list(self.gate.segments.values()):
            if replica is not None and segment.replica != replica:
                continue
            if replica is None and segment.constrained:
                continue
            if segment.task is not None and not segment.task.done():
                segment.cut = True
                segment.task.cancel()

    async def _wait_idle_or_fail(self, timeout_s: float, mode: str) -> None:
        if not await self.gate.wait_idle(timeout_s):
            raise GatewayError(
                504,
                f"{self.gate.in_flight} calls still in flight after {timeout_s:.0f}s ({mode})",
                type="timeout",
                code="pause_timeout",
            )

    async def _undo_pause(self) -> None:
        await self._resume_replicas()
        await self.gate.set_state("serving")

    async def _resume_replicas(self) -> None:
        clients = [c for c in self.pool.clients if c.url in self._paused_replicas]
        results = await asyncio.gather(*(c.resume() for c in clients), return_exceptions=True)
        for client, result in zip(clients, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("replica %s did not resume (%s); out of rotation", client.url, result)
                self.pool.mark_unhealthy(client)
        self._paused_replicas.clear()

    async def stage(self, source: WeightSource, slice_s: float = 0.2) -> StageReport:
        """Prepare the next load of `source` on every healthy replica while they serve.

        Not under the sync lock: serving goes on, and a pause or load meanwhile is still
        correct (each replica runs one RPC at a time; a load of other weights drops the
        staging). Stagings run one at a time: two would drop each other's work.
        """
        source = _full_weights(source)
        async with self._stage_lock:
            started = time.perf_counter()
            transport = transport_for(source)
            clients = self.pool.healthy_clients()
            results = await asyncio.gather(
                *(transport.stage(c, slice_s) for c in clients), return_exceptions=True
            )
            staged: dict[str, StagedReplica] = {}
            not_staged: dict[str, str] = {}
            for client, result in zip(clients, results, strict=True):
                if isinstance(result, NotStaged):
                    not_staged[client.url] = str(result)
                elif isinstance(result, BaseException):
                    not_staged[client.url] = f"{type(result).__name__}: {result}"
                else:
                    staged[client.url] = result
            return StageReport(
                staged=staged, not_staged=not_staged, stage_s=time.perf_counter() - started
            )

    async def layout(self) -> WeightsLayout:
        """The snapshot layout every healthy replica loads fastest: the layers all of them name
        in their kernel layout, with the same checkpoint tensors (HF layout for the rest)."""
        clients = self.pool.healthy_clients()
        results = await asyncio.gather(*(kernel_layout(c) for c in clients), return_exceptions=True)
        common: dict[str, list[str]] | None = None
        hf_because: dict[str, str] = {}
        for client, result in zip(clients, results, strict=True):
            if isinstance(result, BaseException):
                hf_because[client.url] = f"{type(result).__name__}: {result}"
                common = {}
                continue
            if not result:
                hf_because[client.url] = "no direct snapshot load (or nothing packed)"
            if common is None:
                common = dict(result)
            elif common != result:
                if result:
                    hf_because[client.url] = "names other layers than the other replicas"
                common = {k: v for k, v in common.items() if result.get(k) == v}
        return WeightsLayout(transposed=common or {}, hf_because=hf_because)

    async def load(self, source: WeightSource, version: int) -> LoadReport:
        source = _full_weights(source)
        async with self._lock:
            if self.gate.state != "paused":
                raise conflict("pause the gateway before loading weights")
            started = time.perf_counter()
            # A collective group's members are the healthy replicas, and the load goes to them
            # alone: one that does not answer (dead since its last load) would never join, and
            # the group would never form. Other loads go to every reachable replica.
            clients = (
                self.pool.healthy_clients()
                if isinstance(source, CollectiveWeights)
                else self.pool.reachable_clients()
            )
            transport = transport_for(source, [c.url for c in clients], version)
            loaded, failed = await self._load_everywhere(
                lambda client: self._load_one(transport, client, version), version, clients
            )
            if not loaded:
                restored = await self._restore(failed)
                held = (
                    f"{len(restored)} replica(s) restored to it"
                    if restored
                    else "no replica could be restored to it"
                )
                raise GatewayError(
                    502,
                    f"no replica loaded version {version}; the gateway is still paused at "
                    f"version {self.gate.version}, {held}: {failed}",
                    type="upstream_error",
                    code="load_failed",
                )
            self._current = source
            return LoadReport(
                version=version,
                loaded=loaded,
                failed=failed,
                load_s=time.perf_counter() - started,
            )

    async def _load_everywhere(
        self,
        load: Callable[[ReplicaClient], Awaitable[None]],
        version: int,
        clients: Sequence[ReplicaClient] | None = None,
    ) -> tuple[list[str], dict[str, str]]:
        """`load` on every reachable replica (or on `clients`) at once: the replicas that took
        `version` (now serving it), and why each other failed (now stale: out of the
        rotation)."""
        clients = self.pool.reachable_clients() if clients is None else clients
        results = await asyncio.gather(*(load(c) for c in clients), return_exceptions=True)
        loaded: list[str] = []
        failed: dict[str, str] = {}
        for client, result in zip(clients, results, strict=True):
            if isinstance(result, BaseException):
                failed[client.url] = f"{type(result).__name__}: {result}"
                self.pool.mark_stale(client)
            else:
                self.pool.set_version(client, version)
                loaded.append(client.url)
        return loaded, failed

    async def _restore(self, failed: dict[str, str]) -> list[str]:
        """Reload the version still served onto replicas whose load failed.

        A failed load may have changed some weights before it failed, so such a replica holds
        no known version until it loads a whole snapshot again. Used only when no replica took
        the new version: without it the gateway could not resume the old one.
        """
        if self._current is None or isinstance(self._current, CollectiveWeights | AdapterWeights):
            return []  # a collective source has no sender outside a sync: nothing to take
        transport = transport_for(self._current)
        clients = [c for c in self.pool.reachable_clients() if c.url in failed]
        results = await asyncio.gather(
            *(self._load_one(transport, c, self.gate.version) for c in clients),
            return_exceptions=True,
        )
        restored = []
        for client, result in zip(clients, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("replica %s could not be restored: %s", client.url, result)
            else:
                self.pool.set_version(client, self.gate.version)
                restored.append(client.url)
        return restored

    async def _load_one(
        self, transport: WeightTransport, client: ReplicaClient, version: int
    ) -> None:
        await transport.load(client)
        await client.reset_prefix_cache()
        await client.set_version_label(version)
        label = await client.version_label()
        if label != str(version):
            raise ReplicaUnavailable(
                f"{client.url} reports version {label!r} after loading {version}"
            )

    async def resume(self, version: int) -> None:
        async with self._lock:
            if self.gate.state == "serving":
                if version != self.gate.version:
                    raise conflict(
                        f"the gateway is serving version {self.gate.version}, not paused"
                    )
                return
            if not self.pool.serving_clients(version):
                raise conflict(f"no healthy replica holds version {version}; load it first")
            await self.gate.set_state("resuming")
            await self._resume_replicas()
            await self.gate.set_state("serving", version)
