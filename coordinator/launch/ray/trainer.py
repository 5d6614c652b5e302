"""The trainer ranks as Ray actors (`launcher: ray`), in a placement group of their own.

Each rank actor starts `lockgate.trainer.rl.main` as a child with the variables torchrun would
set (RANK, WORLD_SIZE, MASTER_ADDR/PORT from rank 0's node); the rank program ties itself to
its parent, the actor (`die_with_launcher`). The coordinator drives the ranks through the same
file protocol as under torchrun, so the run dir must be one path that every node sees (shared
storage) when the ranks are placed on other nodes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lockgate.coordinator.launch.processes import free_port, spawn, terminate
from lockgate.coordinator.launch.trainer import TrainerProcess, thread_env
from lockgate.trainer.config import TrainerConfig

_CALL_S = 30.0
# `_check_alive` runs every few ms while a step trains; asking the actors that often would
# cost more than the step's own polling.
_POLL_EVERY_S = 1.0
_ACTOR_DIED = -9


class RankActor:
    """One trainer rank, a child process of this actor."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def where(self) -> tuple[str, int]:
        """This actor's node address and a port free on it (for rank 0's rendezvous)."""
        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def free_port(self) -> int:
        """A port free on this actor's node."""
        return free_port(ray.util.get_node_ip_address())

    def start(self, run_dir: str, env: dict[str, str], log_path: str) -> None:
        cmd = [sys.executable, "-m", "lockgate.trainer.rl.main", "--run-dir", run_dir]
        self.proc = spawn(cmd, Path(log_path), env={**os.environ, **env})

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        terminate(self.proc)


class RayTrainerRanks(TrainerProcess):
    """`TrainerProcess` with its ranks placed by Ray, one per bundle of `group` (packed)."""

    def __init__(
        self,
        config: TrainerConfig,
        run_dir: Path,
        log_path: Path,
        group: PlacementGroup,
        *,
        cpus: float,
        gpus: float,
        startup_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(config, run_dir, log_path, startup_timeout_s)
        self.group = group
        self.cpus = cpus
        self.gpus = gpus
        self._actors: list[ActorHandle] = []
        self._master_addr = ""
        self._last_poll = 0.0
        self._exited: int | None = None

    def rank_log(self, rank: int) -> Path:
        return self.log_path if rank == 0 else self.log_path.with_suffix(f".rank{rank}.log")

    def _launch(self) -> None:
        remote: Any = ray.remote(RankActor)
        self._actors = [
            remote.options(
                num_cpus=self.cpus,
                num_gpus=self.gpus,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(self.config.world_size)
        ]
        # Rank 0's node and a port free there; the rank-0 actor has been placed once it answers.
        master_addr, master_port = ray.get(
            self._actors[0].where.remote(), timeout=self.startup_timeout_s
        )
        self._master_addr = master_addr
        starts = []
        for rank, actor in enumerate(self._actors):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(self.config.world_size),
                # Ray gives each rank actor its own GPU(s) in CUDA_VISIBLE_DEVICES, so every
                # rank's device is the first it sees: local rank 0 of a local world of one.
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                **thread_env(self.config.num_threads),
            }
            starts.append(actor.start.remote(str(self.run_dir), env, str(self.rank_log(rank))))
        ray.get(starts, timeout=_CALL_S)

    def weights_group_endpoint(self, port: int) -> tuple[str, int]:
        """Where the collective weights group meets: rank 0's node, which hosts its store, at
        `port`, or at a port free there when 0. Known once the ranks are launched."""
        if not self._actors:
            raise RuntimeError("the trainer ranks are not launched yet")
        if port == 0:
            port = int(ray.get(self._actors[0].free_port.remote(), timeout=_CALL_S))
        return self._master_addr, port

    def _started(self) -> bool:
        return bool(self._actors)

    def _exit_code(self) -> int | None:
        if self._exited is not None:
            return self._exited
        now = time.monotonic()
        if now - self._last_poll < _POLL_EVERY_S:
            return None
        self._last_poll = now
        try:
            codes = ray.get([a.poll.remote() for a in self._actors], timeout=_CALL_S)
        except (RayError, GetTimeoutError):
            self._exited = _ACTOR_DIED  # a rank actor (or its node) is gone
            return self._exited
        self._exited = next((c for c in codes if c is not None), None)
        return self._exited

    def _shutdown(self, grace_s: float) -> None:
        actors, self._actors = self._actors, []
        try:
            ray.get([a.stop.remote(grace_s) for a in actors], timeout=grace_s + _CALL_S)
        except (RayError, GetTimeoutError):
            pass  # a dead actor's rank died with it
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except RayError:
                pass
