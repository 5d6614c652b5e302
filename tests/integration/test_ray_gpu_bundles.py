"""`launcher: ray` on CUDA asks Ray for GPU bundles: checked on a local Ray cluster that
declares GPUs it does not have (`ray.num_gpus`: Ray trusts the declaration), reserving the
placement groups without starting anything in them (no vLLM on CUDA here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.launch.deploy_checks import DeployError
from lockgate.coordinator.launch.ray.launch import RayParts
from lockgate.trainer.config import TrainerConfig


def _parts(tmp_path: Path, world_size: int, **sections: Any) -> RayParts:
    config = RunConfig.model_validate({"launcher": "ray", **sections})
    trainer = TrainerConfig(model_dir=tmp_path, world_size=world_size)
    return RayParts(config, trainer)


def _bundles(strategy: str) -> list[dict[str, float]]:
    table = ray.util.placement_group_table()
    (group,) = [g for g in table.values() if g["strategy"] == strategy and g["state"] == "CREATED"]
    return [group["bundles"][i] for i in sorted(group["bundles"])]


def test_cuda_replicas_and_ranks_reserve_gpu_bundles(tmp_path: Path) -> None:
    parts = _parts(
        tmp_path,
        2,
        replicas={"count": 1, "device": "cuda", "tensor_parallel_size": 2},
        ray={"num_cpus": 4, "num_gpus": 4},
    )
    try:
        parts.reserve()
        # auto: the trainer follows the cluster's GPUs.
        assert (parts.placement.replica_device, parts.placement.trainer_device) == ("cuda", "cuda")
        assert _bundles("SPREAD") == [{"CPU": 1.0, "GPU": 2.0}]  # one replica, its TP size
        assert _bundles("PACK") == [{"CPU": 1.0, "GPU": 1.0}] * 2  # one GPU per rank
        assert ray.available_resources().get("GPU", 0.0) == 0.0
    finally:
        parts.close()
    assert not ray.is_initialized()


def test_gpus_too_few_for_the_bundles_is_a_deploy_error(tmp_path: Path) -> None:
    parts = _parts(
        tmp_path,
        1,
        replicas={"count": 2, "device": "cuda"},
        ray={"num_cpus": 4, "num_gpus": 2},
    )
    try:
        with pytest.raises(DeployError) as caught:
            parts.reserve()
        assert str(caught.value).startswith(
            "trainer.world_size: the Ray cluster has 2 GPU free and the replicas take 2, but 1 "
            "trainer rank x ray.trainer_gpus=1 need 1"
        )
    finally:
        parts.close()


def test_a_cpu_cluster_reserves_cpu_bundles_as_before(tmp_path: Path) -> None:
    parts = _parts(tmp_path, 1, replicas={"count": 2}, ray={"num_cpus": 3, "num_gpus": 0})
    try:
        parts.reserve()
        assert (parts.placement.replica_device, parts.placement.trainer_device) == ("cpu", "cpu")
        assert _bundles("SPREAD") == [{"CPU": 1.0}] * 2
        assert _bundles("PACK") == [{"CPU": 1.0}]
    finally:
        parts.close()
