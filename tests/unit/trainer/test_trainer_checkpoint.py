"""DCP checkpoints: folder bookkeeping (pure) and a killed two-rank trainer resuming exactly."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockgate.coordinator.launch.trainer import TrainerProcess
from lockgate.trainer import protocol
from lockgate.trainer.batch import StepResult
from lockgate.trainer.checkpoint import (
    clear_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from lockgate.trainer.config import Device, TrainerConfig
from lockgate.trainer.parallel import Distributed
from tests.support.trainer_runs import max_diff, needs_gpu, synthetic_batch


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


def _weights(path: Path | str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            out.setdefault(ppid, []).append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill(trainer: TrainerProcess) -> None:
    """A crash: SIGKILL to torchrun's process group, no STOP, no chance to clean up.

    The ranks live in sessions of their own, outside that group: they must die with torchrun,
    or they would keep serving this run dir next to the resumed trainer.
    """
    proc = trainer._proc
    assert proc is not None
    ranks = _children().get(proc.pid, [])
    assert len(ranks) == trainer.config.world_size
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(r) for r in ranks):
        assert time.monotonic() < deadline, f"ranks {ranks} outlived torchrun"
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("device", "world_size"),
    [("cpu", 2), pytest.param("cuda", 1, marks=needs_gpu, id="cuda-1")],
)
async def test_a_killed_trainer_resumes_from_its_checkpoint_exactly(
    tiny_model_dir: Path, tmp_path: Path, device: Device, world_size: int
) -> None:
    config = TrainerConfig(
        model_dir=tiny_model_dir,
        world_size=world_size,
        device=device,
        lr=1e-3,
        micro_batch_tokens=64,
        # the schedule makes step 3's learning rate depend on the restored step
        lr_schedule="linear",
        warmup_steps=1,
        decay_steps=4,
        checkpoint_every=2,
        resume=True,
    )

    # The uninterrupted reference run is a fresh start in a reused run dir: an earlier run's
    # checkpoint there must go, or a later resume would pick it up.
    straight_dir = tmp_path / "straight"
    stale = _fake_checkpoint(protocol.checkpoints_dir(straight_dir), 9)
    fresh = config.model_copy(update={"resume": False})
    straight = TrainerProcess(fresh, straight_dir, straight_dir / "trainer.log")
    straight.start()
    try:
        assert straight.resumed_step() == 0
        assert not stale.exists()
        expected: list[StepResult] = [
            await straight.train_step(synthetic_batch(k, seed=k)) for k in (1, 2, 3)
        ]
    finally:
        straight.stop()
    # Step 2 was due but never committed before step 3's batch came: it must not be written.
    assert list_checkpoints(protocol.checkpoints_dir(straight_dir)) == []

    run_dir = tmp_path / "interrupted"
    first = TrainerProcess(config, run_dir, run_dir / "trainer.log")
    first.start()
    try:
        assert first.resumed_step() == 0  # resume asked, nothing to resume from yet
        await first.train_step(synthetic_batch(1, seed=1))
        assert (
            "checkpoint_time_s" not in (await first.train_step(synthetic_batch(2, seed=2))).metrics
        )
        first.commit(2)  # written before step 3 trains, and timed in step 3's result
        assert "checkpoint_time_s" in (await first.train_step(synthetic_batch(3, seed=3))).metrics
    finally:
        _kill(first)
    checkpoint = protocol.checkpoints_dir(run_dir) / "step_2"
    assert latest_checkpoint(protocol.checkpoints_dir(run_dir)) == (2, checkpoint)
    assert {*(f"rng_rank{r}.pt" for r in range(world_size)), "meta.json", ".metadata"} <= {
        p.name for p in checkpoint.iterdir()
    }
    # Lose the step-2 snapshot too: the resumed trainer must export it again for the replicas.
    snapshot = protocol.snapshot_dir(run_dir, 2)
    for f in snapshot.iterdir():
        f.unlink()
    snapshot.rmdir()

    second = TrainerProcess(config, run_dir, run_dir / "trainer.log")
    second.start()
    try:
        assert second.resumed_step() == 2
        assert max_diff(_weights(snapshot), _weights(expected[1].weights_dir)) < 1e-6
        resumed = await second.train_step(synthetic_batch(3, seed=3))
    finally:
        second.stop()

    assert resumed.metrics["lr"] == pytest.approx(expected[2].metrics["lr"])
    worst = max_diff(_weights(resumed.weights_dir), _weights(expected[2].weights_dir))
    moved = max_diff(_weights(resumed.weights_dir), _weights(expected[1].weights_dir))
    print(f"\nresumed vs uninterrupted step 3: {worst:.2e}; step 3 moved weights by {moved:.2e}")
    assert worst < 1e-6
    assert moved > 1e-5  # step 3 really trained


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
