"""Under `launcher: ray`, the GPU lists of the one-node plan are refused (Ray assigns each bundle's
GPUs; the bundles on a cluster: tests/integration/test_ray_gpu_bundles.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lockgate.coordinator.config import RunConfig


def test_gpu_lists_of_the_one_node_plan_are_refused_under_ray() -> None:
    with pytest.raises(ValidationError, match=r"launcher: ray assigns each bundle's GPUs; trainer"):
        RunConfig.model_validate({"launcher": "ray", "trainer": {"gpus": [0]}})
    with pytest.raises(ValidationError, match=r"replicas.colocate place parts"):
        RunConfig.model_validate({"launcher": "ray", "replicas": {"colocate": True}})
