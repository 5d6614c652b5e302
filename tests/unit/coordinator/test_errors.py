"""One error tree: every error of the coordinator's is a LockgateError carrying the exit code
the `lockgate` command ends with, and the command prints it once as `lockgate: <message>`."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
from pydantic import BaseModel

from lockgate.coordinator.cli import deploy
from lockgate.coordinator.cli import main as cli
from lockgate.coordinator.errors import (
    ConfigError,
    Interrupted,
    LockgateError,
    RunFailed,
    UsageError,
    config_loading,
)
from lockgate.coordinator.launch import local
from lockgate.coordinator.launch.deploy_checks import DeployError
from lockgate.coordinator.launch.gateway import GatewayDied, GatewayStartError
from lockgate.coordinator.launch.local import RunStopped
from lockgate.coordinator.launch.replicas import ReplicaStartError
from lockgate.coordinator.launch.trainer import TrainerError, TrainerProcess
from lockgate.coordinator.loop.training import SyncFailed
from lockgate.coordinator.metrics.report import ReportError


def test_the_tree_gives_bad_input_2_run_time_failures_1_and_a_stop_130() -> None:
    for bad_input in (ConfigError, UsageError, DeployError, ReportError):
        assert issubclass(bad_input, LockgateError) and bad_input.exit_code == 2
    failures = (ReplicaStartError, GatewayStartError, GatewayDied, TrainerError, SyncFailed)
    for failure in (*failures, RunStopped):
        assert issubclass(failure, RunFailed) and failure.exit_code == 1
    assert Interrupted.exit_code == 130


@pytest.mark.parametrize(
    ("error", "code"),
    [(UsageError("a b"), 2), (SyncFailed("weights"), 1), (Interrupted("stopped"), 130)],
)
def test_main_prints_an_error_of_ours_once_with_its_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: Exception, code: int
) -> None:
    def failing(args: argparse.Namespace) -> int:
        raise error

    monkeypatch.setattr(
        cli, "COMMANDS", [lambda sub: sub.add_parser("x").set_defaults(handler=failing)]
    )
    assert cli.main(["x"]) == code
    assert capsys.readouterr().err == f"lockgate: {error}\n"


class _Section(BaseModel):
    steps: int


def test_a_config_that_does_not_load_becomes_one_config_error_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^config error: steps: .*integer"):
        with config_loading(tmp_path / "run.yaml"):
            _Section.model_validate({"steps": "many"})
    with pytest.raises(ConfigError, match=r"^config file not found: .*nope.yaml$"):
        with config_loading(tmp_path / "nope.yaml"):
            (tmp_path / "nope.yaml").read_text()
    with pytest.raises(ConfigError, match=r"run.yaml: --set takes"):
        with config_loading(tmp_path / "run.yaml"):
            raise ValueError("--set takes section.field=value")


def test_a_service_whose_child_exits_fails_naming_it(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    child = deploy._Child("replica 0", proc, tmp_path / "replica0.log")
    with pytest.raises(RunFailed, match=r"^replica 0 exited with code 3; log .*replica0.log"):
        deploy._serve_until_stopped([child])


def test_an_error_of_ours_that_the_loops_task_group_wrapped_is_reported_as_itself() -> None:
    trainer = cast(TrainerProcess, None)  # only a trainer failure reads it
    sync = SyncFailed("weight sync to version 2 failed; replicas still serve version 1")
    assert local._loop_failure(ExceptionGroup("loop", [sync]), trainer, 1) is sync
    assert local._loop_failure(ExceptionGroup("loop", [ValueError("x")]), trainer, 1) is None
    assert local._loop_failure(sync, trainer, 1) is None  # unwrapped: it goes up as it is
