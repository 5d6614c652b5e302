"""Replicas of the tiny model as the tests start them."""

from __future__ import annotations

from pathlib import Path

from lockgate.coordinator.launch.replicas import LocalReplicaSet, ReplicaLaunchConfig


def tiny_replica_set(
    model_dir: Path, count: int, log_dir: Path, max_lora_rank: int | None = None
) -> LocalReplicaSet:
    """Replicas of the tiny model as the tests use them (not started); with `max_lora_rank`
    they serve LoRA adapters up to that rank, loaded at run time."""
    return LocalReplicaSet(
        ReplicaLaunchConfig(
            model_dir=model_dir,
            count=count,
            max_model_len=2048,
            log_dir=log_dir,
            max_lora_rank=max_lora_rank,
        )
    )
