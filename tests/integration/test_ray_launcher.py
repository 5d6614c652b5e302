"""`launcher: ray` on a local Ray cluster too small for the run: a clear error before anything
starts (the run itself: tests/vllm/test_ray_launcher.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.marked_processes import processes_with_marker

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "admin-token-for-ray-e2e"
RUN_NAME = "raytest"


def _marked_env(tiny_model_dir: Path) -> tuple[str, dict[str, str]]:
    marker = uuid.uuid4().hex
    env = {
        **os.environ,
        "LOCKGATE_TEST_RUN": marker,
        "LOCKGATE_CACHE": str(tiny_model_dir.parent),
        "LOCKGATE_ADMIN_TOKEN": TOKEN,
    }
    return f"LOCKGATE_TEST_RUN={marker}", env


def _train_args(run_dir: Path, *sets: str) -> list[str]:
    args = [
        sys.executable, "-m", "lockgate.coordinator.cli", "train", str(ROOT / "examples/toy/config.yaml"),
        "--run-dir", str(run_dir), "--set", f"name={RUN_NAME}", "--set", "launcher=ray",
        "--set", "replicas.count=2", "--set", "replicas.max_model_len=512",
        "--set", "loop.val_every=0", "--set", "trainer.checkpoint_every=0",
    ]  # fmt: skip
    for item in sets:
        args += ["--set", item]
    return args


def _no_process_left(marker: str, timeout_s: float = 15.0) -> list[int]:
    # Ray's processes (and vLLM's engine) exit a moment after the driver returns.
    deadline = time.monotonic() + timeout_s
    while (left := processes_with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.parametrize(
    ("num_cpus", "message"),
    [
        (1, "lockgate: replicas.count: the Ray cluster has 1 CPU free, but 2 replicas x "
         "ray.replica_cpus=1 need 2"),
        (2, "lockgate: trainer.world_size: the Ray cluster has 2 CPU free and the replicas "
         "take 2, but 1 trainer rank x ray.trainer_cpus=1 need 1"),
    ],
    ids=["replicas", "trainer"],
)  # fmt: skip
def test_a_cluster_too_small_is_a_clear_error_before_anything_starts(
    tmp_path: Path, tiny_model_dir: Path, num_cpus: int, message: str
) -> None:
    marker, env = _marked_env(tiny_model_dir)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = subprocess.run(
        _train_args(run_dir, f"ray.num_cpus={num_cpus}"),
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr
    assert not (run_dir / "logs" / "replica0.log").exists()  # no replica was started
    assert not (run_dir / "metrics.jsonl").exists()
    assert _no_process_left(marker) == []
    print(f"refused in {time.monotonic() - started:.1f}s")
