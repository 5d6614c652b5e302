"""A client-driven run killed mid-run and resumed (`lockgate train --resume`), for real: replicas,
gateway, trainer rank and loop as child processes, driven by examples/client_fleet/fleet.py.

The coordinator is killed (SIGKILL: no clean-up) once the trainer has checkpointed step 2; its
children die with it and the fleet stops when the gateway goes. The resumed run reads its
enrolment key back, so a fleet started again with the run's enrolment file enrols under the
same key, and the run trains to its last step with one record per step and no group's serial
trained twice."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest

from lockgate.coordinator.launch.processes import free_port
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.records.metrics_file import read_metrics
from lockgate.trainer import protocol
from lockgate.trainer.checkpoint import latest_checkpoint
from tests.support.marked_processes import marked_environment, processes_with_marker

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5


def _eventually(check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s:g} s")
        time.sleep(0.5)


def _fleet(run_dir: Path, log: IO[str], env: dict[str, str]) -> subprocess.Popen[str]:
    command = [
        sys.executable, str(ROOT / "examples/client_fleet/fleet.py"), str(run_dir),
        "--groups-at-once", "1", "--max-tokens", "16", "--wait-s", "600",
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)


def _checkpointed(run_dir: Path) -> int:
    found = latest_checkpoint(protocol.checkpoints_dir(RunDir(run_dir).trainer))
    return found[0] if found else 0


def test_a_killed_client_driven_run_resumes_with_its_key_and_trains_to_the_end(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    marker, env = marked_environment(LOCKGATE_CACHE=str(tiny_model_dir.parent))
    run_dir = tmp_path / "run"
    logs = {name: (tmp_path / f"{name}.log").open("w+") for name in ("run1", "run2", "f1", "f2")}
    train = [sys.executable, "-m", "lockgate.coordinator.cli", "train"]
    first = subprocess.Popen(
        [
            *train, str(ROOT / "examples/client_fleet/config.yaml"), "--run-dir", str(run_dir),
            "--set", f"loop.steps={STEPS}", "--set", "loop.groups_per_step=1",
            "--set", "loop.group_size=2", "--set", "loop.max_staleness=0",
            "--set", "replicas.count=1", "--set", "gateway.startup_timeout_s=300",
            "--set", "trainer.checkpoint_every=1", "--set", f"gateway.port={free_port()}",
        ],
        stdout=subprocess.PIPE, stderr=logs["run1"], text=True, env=env,
    )  # fmt: skip
    processes: list[subprocess.Popen[str]] = [first]
    try:
        processes.append(fleet := _fleet(run_dir, logs["f1"], env))
        _eventually(lambda: _checkpointed(run_dir) >= 2 or first.poll() is not None, 900, "ckpt")
        assert first.poll() is None, "the run ended before it could be killed"
        key = json.loads(RunDir(run_dir).enrolment.read_text())["key"]
        first.kill()  # SIGKILL: its children die with it (orphan_guard), the fleet then stops
        first.wait()
        fleet.communicate(timeout=120)
        _eventually(lambda: processes_with_marker(marker) == [], 120, "end of the killed run")

        second = subprocess.Popen(
            [*train, "--resume", str(run_dir)],
            stdout=subprocess.PIPE, stderr=logs["run2"], text=True, env=env,
        )  # fmt: skip
        processes.append(second)
        run2 = logs["run2"]
        # The fleet starts once the resumed run has written its enrolment file again (the
        # example fleet stops at the first connection refused, as when a run ends).
        _eventually(
            lambda: "enrol sessions at" in Path(run2.name).read_text() or second.poll() is not None,
            600,
            "enrolment of the resumed run",
        )
        processes.append(fleet := _fleet(run_dir, logs["f2"], env))
        out, _ = second.communicate(timeout=900)
        fleet_out, _ = fleet.communicate(timeout=120)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    text = {name: (log.seek(0), log.read())[1] for name, log in logs.items()}
    print(text["run2"][-3000:], text["f2"][-1500:])
    assert second.returncode == 0, text["run2"][-3000:]
    assert "resuming after step" in text["run2"] and "done: " in out

    # The same key, in the same owner-only file, and the fleet enrolled under it again.
    enrolment = RunDir(run_dir).enrolment
    assert json.loads(enrolment.read_text())["key"] == key
    assert enrolment.stat().st_mode & 0o777 == 0o600
    tally = json.loads(fleet_out.strip().splitlines()[-1])
    assert tally["groups"] >= 1 and tally["sessions"] >= 2

    # One record per step, and no group's serial trained in two steps.
    assert [r["step"] for r in read_metrics(RunDir(run_dir).metrics)] == list(range(1, STEPS + 1))
    states = read_metrics(RunDir(run_dir).loop_state)
    trained = [serial for state in states for serial in state["trained"]]
    assert len(trained) == STEPS and len(set(trained)) == STEPS
    assert processes_with_marker(marker) == []
