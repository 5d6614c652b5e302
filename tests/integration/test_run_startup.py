"""`lockgate train` launches its gateway, validation gateway and trainer at once, and a part that
fails to start stops the others without waiting on them (coordinator/launch/local.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from lockgate.coordinator.config import load_config
from lockgate.coordinator.launch import local as launch
from lockgate.coordinator.launch.gateway import GatewayProcess, GatewayStartError
from lockgate.coordinator.launch.trainer import TrainerProcess
from lockgate.coordinator.run_dir import RunDir
from tests.support.marked_processes import processes_with_marker

ROOT = Path(__file__).resolve().parents[2]


def test_the_parts_start_together_and_a_failed_gateway_stops_the_rest(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = uuid.uuid4().hex
    monkeypatch.setenv("LOCKGATE_TEST_RUN", marker)  # every child inherits it
    run_dir = tmp_path / "run"
    config = load_config(
        ROOT / "examples/toy/config.yaml",
        [
            f"run_dir={run_dir}",
            f"model.path={tiny_model_dir}",
            # Nothing serves here: the gateway is stopped before it would call a replica.
            "replicas.urls=[http://127.0.0.1:9]",
            "trainer_first=false",
        ],
    )
    monkeypatch.setattr(launch, "check_run_parts", lambda config, resume: None)
    monkeypatch.setattr(launch, "check_replicas_read", lambda root, urls: None)
    seen: dict[str, object] = {}

    def fail_first_wait(self: GatewayProcess, timeout_s: float = 60.0) -> None:
        seen["waited on"] = self.name
        seen["trainer launched"] = RunDir(run_dir).trainer_config.is_file()
        seen["validation gateway launched"] = (run_dir / "val_gateway_config.json").is_file()
        seen["children"] = len(processes_with_marker(marker))
        raise GatewayStartError("the gateway did not serve (made to fail by the test)")

    monkeypatch.setattr(GatewayProcess, "wait_ready", fail_first_wait)
    graces: list[float] = []
    shutdown = TrainerProcess._shutdown

    def recorded_shutdown(self: TrainerProcess, grace_s: float) -> None:
        graces.append(grace_s)
        shutdown(self, grace_s)

    monkeypatch.setattr(TrainerProcess, "_shutdown", recorded_shutdown)
    with pytest.raises(GatewayStartError, match="made to fail by the test"):
        launch.train(config)
    # When the first part is waited on, the other two have been launched beside it.
    assert seen["waited on"] == "gateway"
    assert seen["trainer launched"] and seen["validation gateway launched"]
    assert isinstance(seen["children"], int) and seen["children"] >= 3
    assert processes_with_marker(marker) == []
    # The trainer was still loading: with nothing to finish it is not given the minute of grace
    # a running trainer gets to write its last checkpoint.
    assert graces == [0.0]
