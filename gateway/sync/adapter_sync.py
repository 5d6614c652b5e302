"""Weight sync in adapter mode (`GatewayConfig.adapter`): a new LoRA adapter per version, on
replicas that other runs may share, so no replica's engine is ever paused or relabelled.

- pause `abort` (default): the gateway closes its gate and cuts its own segments in flight
  (closing a stream aborts that request alone in vLLM); the calls keep every token and
  continue after the resume under the new adapter, each token recorded with the version of
  the adapter that produced it. Constrained segments finish first, as in a full sync.
- pause `drain`: no new segments; in-flight ones finish under the old adapter.
- pause `keep` is refused: it freezes requests inside the engine, which would freeze every
  other run's calls too, and a request in vLLM keeps the adapter it started with anyway.
- load: `/v1/load_lora_adapter` on every replica under `<name>@v<version>`, verified by
  `GET /v1/models`. A replica that fails leaves the rotation until a later load succeeds on
  it; if none loads, the old adapter is still on every replica and still served.
- resume: new segments and the cut calls' continuations ask for the new name; then the
  adapters of older versions are unloaded from every replica, those no segment of this
  gateway still uses (after an abort or drain pause none does).
"""

from __future__ import annotations

import asyncio
import logging
import time

from lockgate.gateway.errors import GatewayError, bad_request, conflict
from lockgate.gateway.replicas.adapters import AdapterSet
from lockgate.gateway.replicas.pause import PauseGate
from lockgate.gateway.replicas.pool import ReplicaPool
from lockgate.gateway.schema import (
    AdapterWeights,
    LoadReport,
    PauseMode,
    PauseReport,
    StageReport,
    WeightsLayout,
    WeightSource,
)
from lockgate.gateway.sync.controller import SyncController

log = logging.getLogger(__name__)


class AdapterSyncController(SyncController):
    def __init__(self, gate: PauseGate, pool: ReplicaPool, adapters: AdapterSet) -> None:
        # No control plane and no source to restore: nothing here pauses or rewrites an engine.
        super().__init__(gate, pool)
        self.adapters = adapters
        self._unloads: set[asyncio.Task[None]] = set()

    async def pause(self, mode: PauseMode, timeout_s: float) -> PauseReport:
        if mode == "keep":
            raise bad_request(
                "pause mode 'keep' freezes requests inside vLLM's engine, which in adapter mode "
                "would freeze every run sharing the replicas (and a frozen request keeps its "
                "old adapter): use 'abort' (tokens kept, continued under the new adapter) or "
                "'drain'",
                param="mode",
            )
        return await super().pause(mode, timeout_s)

    async def _quiesce(
        self, mode: PauseMode, timeout_s: float, started: float
    ) -> tuple[float, float, float | None]:
        """This gateway's calls only: no replica is paused (other runs go on generating)."""
        if mode == "abort":
            self._cut_segments()  # this gateway's own; constrained ones finish first
        await self._wait_idle_or_fail(timeout_s, mode)
        return time.perf_counter() - started, 0.0, None

    async def load(self, source: WeightSource, version: int) -> LoadReport:
        if not isinstance(source, AdapterWeights):
            raise bad_request(
                f"this gateway serves LoRA adapters (adapter mode): a '{source.transport}' "
                "source would replace the base model every run on these replicas shares; "
                'send {"version": N, "transport": "adapter", "path": DIR}',
                param="transport",
            )
        async with self._lock:
            if self.gate.state != "paused":
                raise conflict("pause the gateway before loading weights")
            if version <= self.gate.version:
                raise conflict(
                    f"adapter versions only grow (serving {self.gate.version}, asked "
                    f"{version}): a name is never given other weights, or vLLM would reuse "
                    "prefixes cached under it"
                )
            started = time.perf_counter()
            path = source.path
            serving = self.pool.serving_clients(self.gate.version)
            loaded, failed = await self._load_everywhere(
                lambda client: self.adapters.load(client, version, path), version
            )
            if not loaded:
                for client in serving:
                    # A failed adapter load leaves the base model and the old adapter as
                    # they were: a replica that served the old version still does.
                    self.pool.set_version(client, self.gate.version)
                raise GatewayError(
                    502,
                    f"no replica loaded version {version}; the gateway is still paused at "
                    f"version {self.gate.version}, which every replica serving it still holds: "
                    f"{failed}",
                    type="upstream_error",
                    code="load_failed",
                )
            self.adapters.remember(version, source.path)
            return LoadReport(
                version=version, loaded=loaded, failed=failed, load_s=time.perf_counter() - started
            )

    async def resume(self, version: int) -> None:
        await super().resume(version)
        self._unload_retired()

    def _unload_retired(self) -> None:
        in_use = {segment.version for segment in self.gate.segments.values()}
        retired = [
            v for v in self.adapters.versions() if v != self.gate.version and v not in in_use
        ]
        if retired:
            task = asyncio.create_task(self._unload(retired), name="adapter-unload")
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def _unload(self, versions: list[int]) -> None:
        clients = self.pool.clients
        for version in versions:
            results = await asyncio.gather(
                *(self.adapters.unload(c, version) for c in clients), return_exceptions=True
            )
            for client, result in zip(clients, results, strict=True):
                if isinstance(result, BaseException):
                    log.warning(
                        "%s did not unload %s: %s",
                        client.url,
                        self.adapters.model_for(version),
                        result,
                    )
            self.adapters.forget(version)

    async def unloads_done(self) -> None:
        """Wait for the unloads started by resumes so far (their failures are logged)."""
        while self._unloads:
            await asyncio.gather(*self._unloads, return_exceptions=True)

    async def stage(self, source: WeightSource, slice_s: float = 0.2) -> StageReport:
        raise bad_request(
            "adapter mode stages nothing: an adapter loads within the pause in milliseconds",
            param="source",
        )

    async def layout(self) -> WeightsLayout:
        raise bad_request(
            "adapter mode has no snapshot layout: the trainer publishes adapters in peft's "
            "layout, which every replica loads as it is"
        )
