"""Replicas as Ray actors (`launcher: ray`): one per placement-group bundle, each running the
same vLLM server `LocalReplicaSet` runs, on its node's address; and their supervisor, which
replaces a replica whose actor dies while the run goes on with the others.

A replacement goes through the gateway's own pool routes: the dead replica's URL is removed
(`DELETE /admin/replicas`), the new replica is started in the same bundle (Ray re-places the
bundle of a lost node where it fits), loaded with the snapshot of the version the gateway
serves, and added at that version (`POST /admin/replicas`). A weight sync that lands meanwhile
leaves it one version behind: the gateway routes only to replicas at the served version, and
the next load includes it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lockgate.coordinator.launch.processes import free_port, spawn, terminate
from lockgate.coordinator.launch.replicas import (
    Replica,
    ReplicaLaunchConfig,
    ReplicaStartError,
    await_group_exit,
    replica_command,
    replica_environment,
    usable_cpus,
    wait_serving,
)
from lockgate.gateway.replicas.replica_client import ReplicaClient
from lockgate.gateway.schema import DiskWeights
from lockgate.gateway.sync.weights import transport_for

log = logging.getLogger(__name__)

_WATCH_S = 1.0
_CALL_S = 30.0  # an actor call that should be instant; longer means its node is gone
_RETRY_S = 10.0
# A killed Ray worker SIGKILLs its direct children first: that would be the replica's group
# guard, before it could take vLLM's engine core and workers down with it (they were left
# running). Without that, the guard's own death signal stops the whole group.
_KEEP_CHILDREN = {"RAY_kill_child_processes_on_worker_exit": "false"}


class ReplicaActor:
    """One vLLM server on the actor's node, a child of the actor: when Ray kills the actor (or
    its node goes), the server's group guard takes the server down with it."""

    def __init__(self, config_json: str, index: int, slot: int, log_path: str) -> None:
        self.config = ReplicaLaunchConfig.model_validate_json(config_json)
        self.index = index
        self.slot = slot  # which of the node's CPUs its OpenMP threads bind to (round robin)
        self.log_path = Path(log_path)
        self.replica: Replica | None = None

    def start(self) -> str:
        """Start the server on this node's address and a free port; its URL once it serves."""
        # Spawned from the actor's task thread, which lives as long as the actor: the death
        # signal that ties the server to the actor fires when the spawning thread exits.
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        cpus = usable_cpus()
        proc = spawn(
            replica_command(self.config, host, port),
            self.log_path,
            env=replica_environment(self.config, str(cpus[self.slot % len(cpus)])),
            guard=True,
        )
        url = f"http://{host}:{port}"
        self.replica = Replica(self.index, url, port, self.log_path, proc)
        wait_serving([self.replica], self.config.startup_timeout_s)
        return url

    def poll(self) -> int | None:
        """The server's exit code, None while it runs."""
        return None if self.replica is None else self.replica.proc.poll()

    def stop(self) -> None:
        if self.replica is not None:
            terminate(self.replica.proc)
            await_group_exit(self.replica.proc.pid)


@dataclass
class _Slot:
    index: int
    generation: int
    actor: ActorHandle
    url: str


class RayReplicaSet:
    """`config.count` replicas on a Ray cluster, one per bundle of `group`."""

    def __init__(
        self,
        config: ReplicaLaunchConfig,
        group: PlacementGroup,
        *,
        cpus: float,
        gpus: float,
        run_name: str,
        env_vars: dict[str, str],
    ) -> None:
        self.config = config
        self.env_vars = env_vars
        self.group = group
        self.cpus = cpus
        self.gpus = gpus
        self.run_name = run_name
        self._slots: list[_Slot] = []
        # Replacements are numbered across the set: a retried one never reuses the name of
        # an actor Ray may not have released yet.
        self._generations = itertools.count(1)
        self._lock = threading.Lock()
        self._supervisor: _Supervisor | None = None

    @property
    def urls(self) -> list[str]:
        with self._lock:
            return [s.url for s in self._slots]

    def actor_name(self, index: int, generation: int) -> str:
        """The named actor of replica `index` (generation 0: the first ones started)."""
        return f"{self.run_name}-replica{index}-{generation}"

    def _new_actor(self, index: int, generation: int) -> ActorHandle:
        remote: Any = ray.remote(ReplicaActor)
        return remote.options(  # type: ignore[no-any-return]
            name=self.actor_name(index, generation),
            num_cpus=self.cpus,
            num_gpus=self.gpus,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=index
            ),
            runtime_env={"env_vars": {**self.env_vars, **_KEEP_CHILDREN}},
        ).remote(
            self.config.model_dump_json(),
            index,
            index,
            str(self.config.log_dir / f"replica{index}.log"),
        )

    def start(self) -> None:
        """Start every replica; returns once all serve (each replica's log in `log_dir`)."""
        actors = [self._new_actor(i, 0) for i in range(self.config.count)]
        started = [a.start.remote() for a in actors]
        # The actors' own wait is bounded by startup_timeout_s; the margin covers placement.
        timeout_s = self.config.startup_timeout_s + 60.0
        try:
            urls = ray.get(started, timeout=timeout_s)
        except GetTimeoutError:
            self._kill(actors)
            raise ReplicaStartError(
                f"the Ray replicas did not serve within {timeout_s:.0f}s (logs in "
                f"{self.config.log_dir})"
            ) from None
        except RayError as exc:
            self._kill(actors)
            raise ReplicaStartError(f"a Ray replica failed to start: {exc}") from None
        with self._lock:
            self._slots = [
                _Slot(i, 0, a, u) for i, (a, u) in enumerate(zip(actors, urls, strict=True))
            ]

    def supervise(
        self,
        gateway_urls: list[str],
        admin_token: str,
        snapshot_of: Callable[[int], Path] | None,
    ) -> None:
        """Watch the replicas from a thread of this process, replacing any that dies. The
        first gateway is the run's (its version is the one a replacement loads, from
        `snapshot_of(version)`; None: no snapshots, the collective transport's, and the
        replacement gets the weights at the next sync); the others (validation's) get the
        replacement too."""
        self._supervisor = _Supervisor(self, gateway_urls, admin_token, snapshot_of)
        self._supervisor.start()

    def stop_supervising(self) -> None:
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None

    def stop(self) -> None:
        """Stop the supervisor, then every replica (the actors' servers first, then the actors)."""
        self.stop_supervising()
        with self._lock:
            actors = [s.actor for s in self._slots]
            self._slots = []
        stopping = [a.stop.remote() for a in actors]
        try:
            ray.get(stopping, timeout=_CALL_S)
        except RayError:
            pass  # a dead actor's server died with it
        self._kill(actors)

    @staticmethod
    def _kill(actors: list[ActorHandle]) -> None:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except RayError:
                pass

    # -- replacement (the supervisor's thread) --------------------------------------------------

    def dead(self) -> list[tuple[_Slot, str]]:
        """The replicas whose actor or server has died, and why."""
        with self._lock:
            slots = list(self._slots)
        polls = [s.actor.poll.remote() for s in slots]
        gone: list[tuple[_Slot, str]] = []
        for slot, ref in zip(slots, polls, strict=True):
            try:
                code = ray.get(ref, timeout=_CALL_S)
            except RayActorError as exc:
                gone.append((slot, f"its actor died ({type(exc).__name__})"))
            except GetTimeoutError:
                gone.append((slot, f"its actor did not answer within {_CALL_S:g}s"))
            except RayError as exc:
                gone.append((slot, f"its actor failed ({type(exc).__name__}: {exc})"))
            else:
                if code is not None:
                    gone.append((slot, f"its vLLM server exited with code {code}"))
        return gone

    def restart(self, slot: _Slot) -> _Slot:
        """A new actor and server in `slot`'s bundle; the old actor is killed first, so the
        bundle's resources are free for it."""
        self._kill([slot.actor])
        generation = next(self._generations)
        actor = self._new_actor(slot.index, generation)
        try:
            url = ray.get(actor.start.remote(), timeout=self.config.startup_timeout_s + 60.0)
        except (RayError, GetTimeoutError):
            self._kill([actor])
            raise
        return _Slot(slot.index, generation, actor, url)

    def swap(self, old: _Slot, new: _Slot) -> None:
        with self._lock:
            self._slots[old.index] = new


class _Supervisor:
    """A thread that replaces dead replicas, one at a time, until stopped."""

    def __init__(
        self,
        replicas: RayReplicaSet,
        gateway_urls: list[str],
        admin_token: str,
        snapshot_of: Callable[[int], Path] | None,
    ) -> None:
        self.replicas = replicas
        self.snapshot_of = snapshot_of
        headers = {"Authorization": f"Bearer {admin_token}"}
        timeout = httpx.Timeout(30.0, connect=5.0)
        self._gateways = [
            httpx.Client(base_url=url, headers=headers, timeout=timeout) for url in gateway_urls
        ]
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="ray-replica-supervisor", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        # A replacement under way is left to finish its current wait; the thread is a daemon,
        # and whatever it started is killed with the placement group's actors.
        self._thread.join(timeout=_CALL_S + 5.0)
        for gateway in self._gateways:
            gateway.close()

    def _run(self) -> None:
        while not self._stop.wait(_WATCH_S):
            try:
                for slot, why in self.replicas.dead():
                    if self._stop.is_set():
                        return
                    self._replace(slot, why)
            except Exception:
                if self._stop.is_set():
                    return
                # A failed replacement is retried on a later pass; the run goes on meanwhile
                # on the other replicas.
                log.exception("replacing a Ray replica failed; retrying in %gs", _RETRY_S)
                self._stop.wait(_RETRY_S)

    def _replace(self, slot: _Slot, why: str) -> None:
        started = time.monotonic()
        print(
            f"[lockgate] ray: replica {slot.index} ({slot.url}) died: {why}; replacing it",
            file=sys.stderr,
            flush=True,
        )
        # Out of the pools first: calls stop going to it, and its sessions move to the others.
        for gateway in self._gateways:
            resp = gateway.delete("/admin/replicas", params={"url": slot.url})
            if resp.status_code not in (200, 404):
                resp.raise_for_status()
        new = self.replicas.restart(slot)
        self.replicas.swap(slot, new)  # from here on, stop() stops the new one
        run_gateway, *others = self._gateways
        version = int(run_gateway.get("/admin/status").json()["version"])
        if self.snapshot_of is None:
            # The collective transport writes no snapshot: the replacement holds the base
            # model (version 0), out of the rotation until the next sync, whose weights group
            # is formed again with it (coordinator/loop/training.py `_weights_group`).
            version = 0
        elif version > 0:
            asyncio.run(_load(new.url, self.snapshot_of(version), version))
        # At the version it holds: if a sync has gone past it meanwhile, the gateway routes to
        # it only once the next load has reached it.
        run_gateway.post(
            "/admin/replicas", json={"url": new.url, "version": version}
        ).raise_for_status()
        for gateway in others:
            # Validation's gateway never syncs: its replicas count as at its own version.
            gateway.post("/admin/replicas", json={"url": new.url}).raise_for_status()
        print(
            f"[lockgate] ray: replica {slot.index} replaced by {new.url} at version {version} "
            f"in {time.monotonic() - started:.1f}s",
            file=sys.stderr,
            flush=True,
        )


async def _load(url: str, snapshot: Path, version: int) -> None:
    """Load the served version's snapshot into a replica not yet in the pool, as the gateway's
    own load does (gateway/sync/controller.py), and label it with the version."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0)) as http:
        client = ReplicaClient(url, http)
        await transport_for(DiskWeights(path=str(snapshot))).load(client)
        await client.reset_prefix_cache()
        await client.set_version_label(version)
