"""A trainer asked for more GPUs than the machine has: its start fails with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockgate.coordinator.launch.trainer import TrainerError, TrainerProcess
from lockgate.trainer.config import TrainerConfig


async def test_asking_for_more_gpus_than_there_are_fails_the_start_clearly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    ranks = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
    config = TrainerConfig(model_dir=tiny_model_dir, world_size=ranks, device="cuda")
    trainer = TrainerProcess(config, tmp_path, tmp_path / "trainer.log")
    with pytest.raises(TrainerError, match="has no GPU"):
        trainer.start()
