"""DCP checkpoints: a killed two-rank trainer resuming exactly (and a one-rank CUDA case, skipped
without a GPU)."""

from __future__ import annotations

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
    latest_checkpoint,
    list_checkpoints,
)
from lockgate.trainer.config import Device, TrainerConfig
from tests.support.trainer_runs import max_diff, needs_gpu, synthetic_batch
from tests.unit.trainer.test_trainer_checkpoint import _fake_checkpoint


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
