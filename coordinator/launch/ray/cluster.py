"""The Ray cluster a `launcher: ray` run uses: connecting (or starting a local one), checking
that the run fits before anything starts, placement groups, and letting go of all of it.

Everything the run puts on the cluster belongs to its driver (this process): no actor is
detached, so if the driver dies Ray ends the job and its actors, and with them (by their death
signal) every replica and trainer rank they started.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from lockgate.coordinator.config import RaySection
from lockgate.coordinator.launch.deploy_checks import DeployError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Demand:
    """What one part of the run asks of the cluster: `count` bundles of `cpus` and `gpus`."""

    option: str  # the config option an error names (replicas.count, trainer.world_size)
    what: str  # "replica", "trainer rank"
    count: int
    cpus: float
    gpus: float

    def bundle(self) -> dict[str, float]:
        # Ray refuses a bundle with a zero-valued resource.
        return {k: v for k, v in (("CPU", self.cpus), ("GPU", self.gpus)) if v > 0}


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def check_fits(demands: list[Demand], free: dict[str, float]) -> None:
    """That the parts, taken in order, fit in the cluster's free CPUs and GPUs; else a
    `DeployError` naming the first part that does not."""
    taken: dict[str, list[tuple[str, float]]] = {"CPU": [], "GPU": []}
    for demand in demands:
        for resource, each in (("CPU", demand.cpus), ("GPU", demand.gpus)):
            need = demand.count * each
            if need == 0:
                continue
            total = free.get(resource, 0.0)
            have = total - sum(n for _, n in taken[resource])
            if need > have + 1e-9:
                before = "".join(f" and the {what}s take {n:g}" for what, n in taken[resource])
                field = "replica" if demand.what == "replica" else "trainer"
                raise DeployError(
                    f"{demand.option}: the Ray cluster has {total:g} {resource} free{before}, "
                    f"but {_plural(demand.count, demand.what)} x ray.{field}_"
                    f"{resource.lower()}s={each:g} need {need:g} (add nodes, or ask for less)"
                )
            taken[resource].append((demand.what, need))


class RayCluster:
    """The run's hold on a Ray cluster; `close()` gives back what it placed (and stops a local
    cluster it started)."""

    def __init__(self, section: RaySection) -> None:
        self.section = section
        self._groups: list[PlacementGroup] = []
        self.started_here = False

    def connect(self, env_vars: dict[str, str]) -> None:
        s = self.section
        address = s.address or os.environ.get("RAY_ADDRESS")
        runtime_env = {"env_vars": env_vars} if env_vars else None
        if address is None:
            # "local": a new cluster of this run's own, never one that happens to run here.
            ray.init(
                address="local",
                num_cpus=s.num_cpus,
                num_gpus=s.num_gpus,
                namespace=s.namespace,
                include_dashboard=False,
                logging_level=logging.WARNING,
                runtime_env=runtime_env,
            )
            self.started_here = True
        else:
            for option in ("num_cpus", "num_gpus"):
                if getattr(s, option) is not None:  # only through $RAY_ADDRESS: the config
                    raise DeployError(  # refuses both
                        f"ray.{option}: sizes a local cluster started for the run, but "
                        f"$RAY_ADDRESS names a running one ({address})"
                    )
            try:
                ray.init(
                    address=address,
                    namespace=s.namespace,
                    logging_level=logging.WARNING,
                    runtime_env=runtime_env,
                )
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise DeployError(
                    f"ray.address: cannot connect to the Ray cluster at {address}: {exc}"
                ) from None

    def address(self) -> str:
        """The cluster's GCS address (what `ray.init(address=...)` takes)."""
        return str(ray.get_runtime_context().gcs_address)

    def gpus(self) -> float:
        """The GPUs the cluster's nodes declare."""
        return float(ray.cluster_resources().get("GPU", 0.0))

    def check(self, demands: list[Demand]) -> None:
        check_fits(demands, {k: float(v) for k, v in ray.available_resources().items()})

    def place(self, demand: Demand, strategy: str) -> PlacementGroup:
        """A placement group of one bundle per unit of `demand`, placed (or a DeployError)."""
        group = placement_group([demand.bundle()] * demand.count, strategy=strategy)
        self._groups.append(group)
        timeout_s = self.section.placement_timeout_s
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except GetTimeoutError:
            raise DeployError(
                f"{demand.option}: Ray did not place {_plural(demand.count, demand.what)} "
                f"({demand.bundle()} each) within ray.placement_timeout_s={timeout_s:g}s; each "
                f"bundle must fit on one node (cluster: {ray.cluster_resources()}, free: "
                f"{ray.available_resources()})"
            ) from None
        return group

    def close(self) -> None:
        """Remove the placement groups and disconnect (stopping a cluster started here)."""
        if not ray.is_initialized():
            return
        for group in self._groups:
            try:
                remove_placement_group(group)
            except Exception as exc:  # the cluster may be gone already; nothing left to free
                log.warning("could not remove a placement group: %s", exc)
        self._groups.clear()
        ray.shutdown()
