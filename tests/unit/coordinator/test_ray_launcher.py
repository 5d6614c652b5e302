"""`launcher: ray`'s pure parts: the run's parts fit a cluster in order, and the parts it refuses
(the runs: tests/integration/ and tests/vllm/test_ray_launcher.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.launch.deploy_checks import DeployError
from lockgate.coordinator.launch.ray.cluster import Demand, check_fits


def test_parts_fit_in_order_and_the_first_that_does_not_is_named() -> None:
    replicas = Demand("replicas.count", "replica", 2, 1.0, 1.0)
    ranks = Demand("trainer.world_size", "trainer rank", 2, 2.0, 1.0)
    check_fits([replicas, ranks], {"CPU": 6.0, "GPU": 4.0})
    with pytest.raises(DeployError, match=r"^replicas.count: .* 1 GPU free, .* need 2"):
        check_fits([replicas, ranks], {"CPU": 6.0, "GPU": 1.0})
    with pytest.raises(
        DeployError, match=r"^trainer.world_size: .* 5 CPU free and the replicas take 2, .* need 4"
    ):
        check_fits([replicas, ranks], {"CPU": 5.0, "GPU": 4.0})
    # No GPU asked, none needed.
    check_fits([Demand("replicas.count", "replica", 2, 0.5, 0.0)], {"CPU": 1.0})


def test_ray_launcher_refuses_parts_started_elsewhere() -> None:
    with pytest.raises(ValidationError, match="launcher: ray places the replicas"):
        RunConfig.model_validate({"launcher": "ray", "gateway": "http://127.0.0.1:8000"})
    assert RunConfig.model_validate({"launcher": "ray"}).ray.replica_cpus == 1.0
