"""`launcher: ray`: the run's replicas and trainer ranks on a Ray cluster; the gateway and the
loop stay in this process (on the head node, or wherever the driver runs).

Everything is reserved before anything starts: the cluster must have the CPUs and GPUs of both
placement groups free (else a `DeployError` naming the part), and Ray must place them within
`ray.placement_timeout_s`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.launch.placement import (
    CPU_ONLY,
    Placement,
    placement_lines,
    placement_on_cluster,
)
from lockgate.coordinator.launch.ray.cluster import Demand, RayCluster
from lockgate.coordinator.launch.ray.replicas import RayReplicaSet
from lockgate.coordinator.launch.ray.trainer import RayTrainerRanks
from lockgate.coordinator.launch.replicas import ReplicaLaunchConfig
from lockgate.trainer.config import TrainerConfig


def _say(message: str) -> None:
    print(f"[lockgate] ray: {message}", file=sys.stderr, flush=True)


def demands_of(config: RunConfig, world_size: int, placement: Placement) -> tuple[Demand, Demand]:
    """The bundles of the replicas and of the trainer ranks: on cuda a replica's bundle holds
    its tensor_parallel_size GPUs and a rank's one GPU, unless `ray.replica_gpus` /
    `ray.trainer_gpus` say otherwise (fractions share a GPU between bundles)."""
    s = config.replicas
    r = config.ray
    replica_gpus = r.replica_gpus
    if replica_gpus is None:
        replica_gpus = float(s.tensor_parallel_size) if placement.replica_device == "cuda" else 0.0
    trainer_gpus = r.trainer_gpus
    if trainer_gpus is None:
        trainer_gpus = 1.0 if placement.trainer_device == "cuda" else 0.0
    return (
        Demand("replicas.count", "replica", s.count, r.replica_cpus, replica_gpus),
        Demand("trainer.world_size", "trainer rank", world_size, r.trainer_cpus, trainer_gpus),
    )


class RayParts:
    """The run's placement groups, replicas and trainer ranks on Ray; `close()` lets go of all."""

    def __init__(self, config: RunConfig, trainer: TrainerConfig) -> None:
        self.config = config
        self.trainer_config = trainer
        self.cluster = RayCluster(config.ray)
        self.replicas: RayReplicaSet | None = None
        self.ranks: RayTrainerRanks | None = None  # the trainer's, once `trainer` made them
        # Known once connected (`reserve`): auto devices follow the cluster's GPUs.
        self.placement = CPU_ONLY
        self.replicas_demand, self.trainer_demand = demands_of(
            config, trainer.world_size, self.placement
        )

    def reserve(self) -> None:
        """Connect, check that the run fits, and place both groups (a `DeployError` if not)."""
        self.cluster.connect(self.config.ray.env_vars)
        where = (
            "a local cluster started for the run" if self.cluster.started_here else "the cluster"
        )
        _say(
            f"connected to {where} at {self.cluster.address()} (namespace "
            f"{self.config.ray.namespace})"
        )
        self.placement = placement_on_cluster(self.config, self.cluster.gpus())
        self.replicas_demand, self.trainer_demand = demands_of(
            self.config, self.trainer_config.world_size, self.placement
        )
        for line in placement_lines(self.placement):
            _say(line)
        demands = [self.replicas_demand, self.trainer_demand]
        self.cluster.check(demands)
        # Replicas spread over the nodes (one lost node takes as few as possible); the ranks
        # packed (their collectives stay on as few nodes as possible).
        self._replica_group = self.cluster.place(self.replicas_demand, "SPREAD")
        self._trainer_group = self.cluster.place(self.trainer_demand, "PACK")

    def start_replicas(self, launch: ReplicaLaunchConfig) -> list[str]:
        self.replicas = RayReplicaSet(
            launch,
            self._replica_group,
            cpus=self.replicas_demand.cpus,
            gpus=self.replicas_demand.gpus,
            run_name=self.config.name,
            env_vars=self.config.ray.env_vars,
        )
        self.replicas.start()
        urls = self.replicas.urls
        _say(f"{len(urls)} replica(s) serving: {', '.join(urls)}")
        return urls

    def trainer(self, run_dir: Path, log_path: Path) -> RayTrainerRanks:
        self.ranks = RayTrainerRanks(
            self.trainer_config,
            run_dir,
            log_path,
            self._trainer_group,
            cpus=self.trainer_demand.cpus,
            gpus=self.trainer_demand.gpus,
        )
        return self.ranks

    def supervise(
        self,
        gateway_urls: list[str],
        admin_token: str,
        snapshot_of: Callable[[int], Path] | None,
    ) -> None:
        """Replace dead replicas from now on, registering them with every gateway given."""
        if self.replicas is not None and self.config.ray.replace_replicas:
            self.replicas.supervise(gateway_urls, admin_token, snapshot_of)

    def stop_supervising(self) -> None:
        if self.replicas is not None:
            self.replicas.stop_supervising()

    def close(self) -> None:
        """Stop the replicas, remove the placement groups, disconnect (stopping a local cluster
        started here); the trainer ranks are stopped by their own `stop()` before."""
        try:
            if self.replicas is not None:
                self.replicas.stop()
        finally:
            self.cluster.close()
