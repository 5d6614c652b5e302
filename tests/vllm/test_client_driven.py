"""Client-driven rollouts end to end: `lockgate train` in client mode (real replicas, gateway,
trainer rank and loop in child processes) dispatches nothing, and examples/client_fleet/fleet.py,
a separate process with the plain OpenAI SDK, drives it through its steps and weight syncs.

With η = 0 and two groups per step, two groups may start per weight version: the fleet keeps
three going, so its third is refused (429 + Retry-After) until each step's sync lands, and no
trained token is older than the step's weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.marked_processes import marked_environment, processes_with_marker

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_a_client_fleet_drives_a_client_driven_run_through_its_steps(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    marker, env = marked_environment(LOCKGATE_CACHE=str(tiny_model_dir.parent))
    run_dir = tmp_path / "run"
    run_log, fleet_log = (tmp_path / "run.log").open("w+"), (tmp_path / "fleet.log").open("w+")
    run = subprocess.Popen(
        [
            sys.executable, "-m", "lockgate.coordinator.cli", "train",
            str(ROOT / "examples/client_fleet/config.yaml"), "--run-dir", str(run_dir),
            "--set", "loop.steps=3", "--set", "loop.groups_per_step=2",
            "--set", "loop.group_size=4", "--set", "loop.max_staleness=0",
            "--set", "replicas.count=1", "--set", "gateway.startup_timeout_s=300",
        ],
        stdout=subprocess.PIPE, stderr=run_log, text=True, env=env,
    )  # fmt: skip
    fleet = subprocess.Popen(
        [
            sys.executable, str(ROOT / "examples/client_fleet/fleet.py"), str(run_dir),
            "--groups-at-once", "3", "--max-tokens", "16", "--wait-s", "600",
        ],
        stdout=subprocess.PIPE, stderr=fleet_log, text=True, env=env,
    )  # fmt: skip
    try:
        run_out, _ = run.communicate(timeout=900)
        if run.returncode != 0:
            fleet.kill()  # a failed run may never write the enrolment file the fleet waits for
        fleet_out, _ = fleet.communicate(timeout=120)
    finally:
        for process in (run, fleet):
            if process.poll() is None:
                process.kill()
                process.wait()
    run_log.seek(0), fleet_log.seek(0)
    run_err, fleet_err = run_log.read(), fleet_log.read()
    print(run_err[-3000:], fleet_err[-2000:])
    assert run.returncode == 0, run_err[-3000:]
    assert "mean reward: first steps" in run_out
    assert "enrol sessions at http://127.0.0.1:" in run_err
    enrolment = json.loads((run_dir / "enrolment.json").read_text())
    assert enrolment["group_size"] == 4 and enrolment["key"].startswith("lg-ek-")
    assert enrolment["key"] in run_err  # printed with the URL, for a fleet started by hand
    assert (run_dir / "enrolment.json").stat().st_mode & 0o777 == 0o600

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["version"] for r in records] == [1, 2, 3]  # η = 0: every step waits for its sync
    assert records[-1]["count/syncs"] == 3
    assert all(r["batch/groups"] == 2 and r["batch/loss_tokens"] > 0 for r in records)
    assert all(r["staleness/max"] == 0 for r in records)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)

    # The fleet ran every trained group, was refused past the bound, and stopped on its own
    # once the run's gateway was gone.
    assert fleet.returncode == 0, fleet_err[-2000:]
    tally = json.loads(fleet_out.strip().splitlines()[-1])
    assert tally["groups"] >= 6 and tally["sessions"] >= 24
    assert tally["refused_429"] >= 1 and all(s >= 1 for s in tally["retry_after_s"])
    assert "the run ended" in fleet_err
    assert processes_with_marker(marker) == []
