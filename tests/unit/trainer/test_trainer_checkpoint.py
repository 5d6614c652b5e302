"""DCP checkpoints: folder bookkeeping, and one rank saving and loading in process (a killed
two-rank trainer resuming exactly: tests/integration/test_trainer_checkpoint.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lockgate.trainer import protocol
from lockgate.trainer.checkpoint import (
    clear_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from lockgate.trainer.parallel import Distributed


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    if complete:
        (path / "meta.json").write_text(json.dumps({"step": step}))
    return path


def test_only_complete_checkpoints_count_and_the_newest_is_by_step_number(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    for step in (2, 10, 4):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 12, complete=False)  # a crash before meta.json: not a checkpoint
    (tmp_path / ".step_14.tmp").mkdir()  # a crash mid-save
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4, 10]  # 10 > 4 numerically
    assert latest_checkpoint(tmp_path) == (10, tmp_path / "step_10")


def test_pruning_keeps_the_newest_and_clearing_removes_everything(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path, step)
    prune_checkpoints(tmp_path, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    (tmp_path / ".step_8.tmp").mkdir()
    (tmp_path / "notes.txt").write_text("not ours")
    assert clear_checkpoints(tmp_path) == [".step_8.tmp", "step_4", "step_6"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_ready_file_round_trip_and_malformed() -> None:
    assert protocol.parse_ready(protocol.ready_text(2, 7)) == (2, 7)
    with pytest.raises(ValueError, match="WORLD_SIZE RESUMED_STEP"):
        protocol.parse_ready("2\n")


# -- the real thing ----------------------------------------------------------------------------


def test_one_rank_saves_and_loads_without_object_collectives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's object collectives run gloo copies on a thread of their own, which throttled a
    2-thread `lockgate sft` for the rest of its run (checkpoint.py): one rank must not call them,
    and still write a checkpoint it loads back."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        world = Distributed(0, 1, torch.device("cpu"), init_device_mesh("cpu", (1,)))
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()

        def refused(*args: object, **kwargs: object) -> None:
            raise AssertionError("a one-rank checkpoint ran an object collective")

        for name in (
            "all_gather_object",
            "gather_object",
            "broadcast_object_list",
            "scatter_object_list",
        ):
            monkeypatch.setattr(dist, name, refused)
        path = save_checkpoint(tmp_path / "ckpt", 3, model, optimizer, world, keep=2)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
        assert load_checkpoint(path, model, optimizer, world) == 3
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    finally:
        dist.destroy_process_group()


def test_snapshot_pruning_drops_an_earlier_runs_later_steps(tmp_path: Path) -> None:
    from lockgate.trainer.export import prune_snapshots

    for step in (1, 28, 29, 30):  # 28-30 from an earlier run in the same run dir
        (tmp_path / f"step_{step}").mkdir()
    prune_snapshots(tmp_path, keep=3, current=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    for step in (2, 3, 4):
        (tmp_path / f"step_{step}").mkdir()
    prune_snapshots(tmp_path, keep=3, current=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3", "step_4"]
