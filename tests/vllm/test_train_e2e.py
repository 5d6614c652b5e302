"""`lockgate train` end to end: real replicas, gateway, trainer ranks and loop in child processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.dashboards import tensorboard_scalars, wandb_history
from tests.support.marked_processes import processes_with_marker

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_training_run_completes_syncs_and_leaves_no_process(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    marker = f"LOCKGATE_TEST_RUN={uuid.uuid4().hex}"
    env = {
        **os.environ,
        marker.split("=")[0]: marker.split("=")[1],
        "LOCKGATE_CACHE": str(tiny_model_dir.parent),
    }
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable, "-m", "lockgate.coordinator.cli", "train", str(ROOT / "examples/toy/config.yaml"),
            "--run-dir", str(run_dir),
            "--set", "loop.steps=3", "--set", "loop.groups_per_step=2", "--set", "loop.group_size=4",
            "--set", "replicas.count=1",
            "--set", "metrics.tensorboard=true", "--set", "metrics.wandb.mode=offline",
        ],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    print(result.stderr[-3000:])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mean reward: first steps" in result.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    # A weight sync after every step. With η = 1 each runs beside the next step (at most one
    # behind when a step's record is written); the last one lands before the run ends.
    assert all(r["step"] - 1 <= r["version"] <= r["step"] for r in records)
    assert records[-1]["version"] == 3 and records[-1]["count/syncs"] == 3
    assert all(r["batch/groups"] == 2 and r["batch/loss_tokens"] > 0 for r in records)
    assert all(r["staleness/max"] <= 1 for r in records)  # max_staleness = 1
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    # The toy config validates at the start: greedy rollouts of the held-out tasks, reported
    # once, on the first record written after the round ends. With η = 1 step 1's record may be
    # written while it still runs; the first sync waits for it, and step 2's record follows
    # that sync (its version is at least 1), so the round is on record 1 or 2.
    (val,) = [r for r in records if "val/version" in r]
    assert val["step"] in (1, 2) and val["val/version"] == 0 and val["val/tasks"] == 16
    assert 0.0 <= val["val/reward_mean"] <= 1.0 and val["val/failed"] == 0
    assert processes_with_marker(marker) == []
    # The dashboards got every record: TensorBoard event files and an offline W&B run.
    rewards = {r["step"]: r["reward/mean"] for r in records}
    assert tensorboard_scalars(run_dir / "tensorboard")["reward/mean"] == pytest.approx(rewards)
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    logged = {row["trainer/step"]: row["reward/mean"] for row in wandb_history(wandb_run)}
    assert logged == pytest.approx(rewards)


def test_the_main_job_ends_with_its_summary_and_no_leak_report(tmp_path: Path) -> None:
    """From a cold model cache, as on a fresh clone: `lockgate train` builds the tiny model in
    its own process, which loads triton (through transformers), whose bindings reported ~500
    leaks at exit while the loop's frozen objects outlived the interpreter."""
    env = {**os.environ, "LOCKGATE_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [
            sys.executable, "-m", "lockgate.coordinator.cli", "train", str(ROOT / "examples/toy/config.yaml"),
            "--run-dir", str(tmp_path / "run"),
            "--set", "loop.steps=2", "--set", "loop.val_every=0", "--set", "replicas.count=1",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, env=env,
    )  # fmt: skip
    output = result.stdout
    assert result.returncode == 0, output[-3000:]
    probe_env = {**env, "LOCKGATE_CACHE": str(tmp_path / "probe-cache")}
    assert "triton" in _modules_loaded_by_a_build(probe_env), "the build no longer loads triton"
    assert "leaked" not in output, output[-3000:]
    assert output.rstrip().splitlines()[-1].startswith("mean reward: first steps"), output[-1000:]


def _modules_loaded_by_a_build(env: dict[str, str]) -> set[str]:
    """The top-level modules loaded by building the tiny model into an empty cache, as
    `lockgate train` does on a fresh clone."""
    probe = (
        "import sys; from lockgate.trainer.tiny_models.builder import ensure_tiny_model; "
        "ensure_tiny_model(); print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
    )
    return set(done.stdout.split())
