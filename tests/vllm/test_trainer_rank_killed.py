"""A trainer rank killed with SIGKILL in the middle of a real `lockgate train`: the run stops
with one line naming the trainer (no traceback, nothing left running), and
`lockgate train --resume` continues from the last checkpoint to the configured step."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockgate.coordinator.launch.replicas import LocalReplicaSet, ReplicaLaunchConfig
from tests.support.marked_processes import processes_with_marker

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5


@pytest.fixture(scope="module")
def replica(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    replicas = LocalReplicaSet(
        ReplicaLaunchConfig(
            model_dir=tiny_model_dir, count=1, log_dir=tmp_path_factory.mktemp("replica-logs")
        )
    )
    with replicas:
        yield replicas.urls[0]


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _rank_pids(marker: str) -> list[int]:
    """The run's trainer rank processes (not torchrun, which starts them)."""
    pids = []
    for pid in processes_with_marker(marker):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"lockgate.trainer.rl.main" in argv and b"torch.distributed.run" not in argv:
                pids.append(pid)
    return pids


def test_a_killed_trainer_rank_stops_the_run_in_one_line_and_resume_finishes_it(
    tmp_path: Path, tiny_model_dir: Path, replica: str
) -> None:
    key, value = "LOCKGATE_TEST_RUN", uuid.uuid4().hex
    marker = f"{key}={value}"
    env = {**os.environ, key: value, "LOCKGATE_CACHE": str(tiny_model_dir.parent)}
    run_dir = tmp_path / "run"
    cli = [sys.executable, "-m", "lockgate.coordinator.cli", "train"]
    run = subprocess.Popen(
        [
            *cli, str(ROOT / "examples/toy/config.yaml"), "--run-dir", str(run_dir),
            "--set", f"loop.steps={STEPS}", "--set", "loop.groups_per_step=2",
            "--set", "loop.group_size=3", "--set", "loop.val_every=0",
            "--set", "environment.args.max_tokens=12", "--set", f"replicas.urls=[{replica}]",
            "--set", "trainer.checkpoint_every=2",
        ],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while _steps_logged(run_dir) < 3:  # past the checkpoint of step 2
            assert run.poll() is None, run.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.2)
        (rank,) = _rank_pids(marker)
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        _, err = run.communicate(timeout=120)
        stopped_s = time.monotonic() - killed
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    stderr = err.decode()
    last = stderr.strip().splitlines()[-1]
    print(f"\nrank killed: the run stopped {stopped_s:.1f}s later: {last}")
    assert run.returncode == 1, stderr[-3000:]
    assert last.startswith("lockgate: ") and "trainer" in last, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    deadline = time.monotonic() + 30
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == []
    assert _steps_logged(run_dir) < STEPS

    resumed = subprocess.run(
        [*cli, "--resume", str(run_dir)], capture_output=True, text=True, timeout=600, env=env
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming after step" in resumed.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert processes_with_marker(marker) == []
