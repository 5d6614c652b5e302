"""`lockgate train --resume`: SIGKILL a real run's coordinator mid-way (its gateway and trainer
ranks must go by themselves), resume it, and check it ends at the configured step with every
task trained once and contiguous metrics, and that the replica served the checkpoint's weights
from the resume on. Both weights transports: disk (the resumed step's snapshot) and collective
(the replica's worker still holds the killed run's group; the resumed trainer forms a new one).

One replica is started here and given to both runs by URL, so the test pays for one vLLM
start, not two; the coordinator, gateway and trainer ranks are killed and started again.
"""

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
from lockgate.coordinator.loop.state import LoopState
from lockgate.coordinator.run_dir import RunDir
from lockgate.trainer.checkpoint import latest_checkpoint
from tests.support.marked_processes import processes_with_marker

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


@pytest.fixture(scope="module")
def replica(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    replicas = LocalReplicaSet(
        ReplicaLaunchConfig(
            model_dir=tiny_model_dir, count=1, log_dir=tmp_path_factory.mktemp("replica-logs")
        )
    )
    try:
        replicas.start()
        yield replicas.urls[0]
    finally:
        replicas.stop()


def _kill_coordinator(proc: subprocess.Popen[bytes], marker: str) -> float:
    """SIGKILL the coordinator alone (no cleanup of its own can run) and wait for every other
    process of the run (gateway, trainer ranks) to go by itself; the seconds that took."""
    others = [p for p in processes_with_marker(marker) if p != proc.pid]
    assert len(others) >= 3, others  # the gateway, torchrun and a rank at least
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed = time.monotonic()
    while processes_with_marker(marker) and time.monotonic() - killed < 30:
        time.sleep(0.2)
    left = processes_with_marker(marker)
    for pid in left:  # so a failure leaves nothing running either
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes outlived the coordinator: {left}"
    return time.monotonic() - killed


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("transport", ["disk", "collective"])
def test_a_killed_run_resumes_to_the_configured_step_without_repeating_or_skipping_tasks(
    tmp_path: Path, tiny_model_dir: Path, replica: str, transport: str
) -> None:
    key, value = "LOCKGATE_TEST_RUN", uuid.uuid4().hex
    marker = f"{key}={value}"
    env = {**os.environ, key: value, "LOCKGATE_CACHE": str(tiny_model_dir.parent)}
    run_dir = tmp_path / "run"
    cli = [sys.executable, "-m", "lockgate.coordinator.cli", "train"]
    first = subprocess.Popen(
        [
            *cli, str(ROOT / "examples/toy/config.yaml"), "--run-dir", str(run_dir),
            "--set", f"loop.steps={STEPS}", "--set", "loop.groups_per_step=2",
            "--set", "loop.group_size=3", "--set", "loop.val_every=0",
            "--set", "environment.args.max_tokens=12", "--set", f"replicas.urls=[{replica}]",
            "--set", "trainer.checkpoint_every=2", "--set", f"sync.transport={transport}",
        ],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        # Past the checkpoint of step 2, with step 3's records written: they must be redone.
        while _steps_logged(run_dir) < 3:
            assert first.poll() is None, first.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the first run made no progress"
            time.sleep(0.2)
    finally:
        gone_s = _kill_coordinator(first, marker)
    assert _steps_logged(run_dir) < STEPS, "the run finished before it could be killed"
    print(f"\ncoordinator SIGKILLed: the rest of the run gone {gone_s:.1f}s later")

    second = subprocess.run(
        [*cli, "--resume", str(run_dir)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming after step" in second.stderr
    assert processes_with_marker(marker) == []

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # contiguous, no repeats
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    assert records[-1]["version"] == STEPS
    # The first step after the resume trains on rollouts of the restored weights alone (no
    # other version was served since): the trainer, holding those same weights, must score
    # them as the replica did. Stale weights in the replica (the killed run's newer version,
    # one step of training away) put this KL near 0.01, as any step's one-version lag does.
    resumed = int(second.stderr.split("resuming after step ")[1].split(":")[0])
    first_resumed = records[resumed]
    print(f"mismatch KL by step: {[r['train/mismatch_kl'] for r in records]}, resumed at {resumed}")
    assert first_resumed["staleness/max"] == 0, first_resumed
    assert first_resumed["train/mismatch_kl"] < 1e-5, first_resumed
    assert any(r["train/mismatch_kl"] > 1e-4 for r in records if r["staleness/max"] > 0)
    if transport == "collective":
        assert "weights: collective, gloo group at" in second.stderr
        assert not list(RunDir(run_dir).snapshots.glob("step_*/*.safetensors"))
    # The last step, committed just before STOP, is checkpointed on the way out.
    latest = latest_checkpoint(run_dir / "trainer" / "checkpoints")
    assert latest is not None and latest[0] == STEPS
    states = [LoopState.model_validate_json(x) for x in RunDir(run_dir).loop_state.open()]
    assert [s.step for s in states] == list(range(1, STEPS + 1))
    trained = [serial for s in states for serial in s.trained]
    dropped = [serial for s in states for serial in s.dropped]
    assert len(trained) == 2 * STEPS and len(set(trained)) == len(trained)  # no task twice
    # Every task dispatched before the end was trained, dropped (counted) or is still pending.
    assert sorted([*trained, *dropped, *states[-1].pending]) == list(range(states[-1].next_serial))
