"""A run dir's layout: every path `RunDir` gives lies under the run dir, and the trainer's
files are where the trainer's own protocol reads and writes them."""

from __future__ import annotations

from pathlib import Path

from lockgate.coordinator.run_dir import GATEWAY, VAL_GATEWAY, RunDir
from lockgate.trainer import protocol


def _paths(run: RunDir) -> dict[str, Path]:
    found = {
        name: getattr(run, name)
        for name, value in vars(RunDir).items()
        if isinstance(value, property)
    }
    found |= {
        "store_named": run.store_named("x.sqlite"),
        "gateway_config_of": run.gateway_config_of(GATEWAY),
        "log_of": run.log_of("replica0"),
        "snapshot": run.snapshot(3),
    }
    return found


def test_every_path_lies_under_the_run_dir_and_none_is_named_twice(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    paths = _paths(run)
    assert len(paths) > 20
    for name, path in paths.items():
        assert isinstance(path, Path), name
        assert path.is_relative_to(run.path) and path != run.path, name
    properties = [p for n, p in paths.items() if isinstance(vars(RunDir).get(n), property)]
    assert len(set(properties)) == len(properties)


def test_the_names_match_what_the_run_and_the_trainer_write(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.metrics == tmp_path / "metrics.jsonl"
    assert run.store == tmp_path / "trajectories.sqlite"
    assert run.val_store == tmp_path / "val_trajectories.sqlite"
    assert run.gateway_config == tmp_path / "gateway_config.json"
    assert run.val_gateway_config == run.gateway_config_of(VAL_GATEWAY)
    assert run.config_of_store(run.val_store) == run.val_gateway_config
    assert run.config_of_store(run.store) == run.gateway_config
    assert run.gateway_log == run.logs / "gateway.log"
    # The trainer, run on `run.trainer`, finds its files where RunDir says they are.
    trainer = run.trainer
    assert run.trainer_config == protocol.config_path(trainer)
    assert protocol.batch_path(trainer, 4).parent == run.batches
    assert protocol.result_path(trainer, 4).parent == run.results
    assert protocol.error_path(trainer, 4).parent == run.results
    assert run.snapshot(4) == protocol.snapshot_dir(trainer, 4)
    assert run.snapshot(4).parent == run.snapshots
    assert run.checkpoints == protocol.checkpoints_dir(trainer)
