"""How the trainer's device is chosen: the GPUs only when every rank gets one (the trainer on a
CUDA GPU: tests/gpu/test_trainer_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from lockgate.trainer.parallel import resolve_device


def test_auto_takes_the_gpus_only_when_every_rank_gets_one() -> None:
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert resolve_device("cpu", 0, 1) == "cpu"
    assert resolve_device("auto", 0, visible + 1) == "cpu"
    assert resolve_device("auto", 0, max(visible, 1)) == ("cuda" if visible else "cpu")
    with pytest.raises(RuntimeError, match="has no GPU"):
        resolve_device("cuda", visible, visible + 1)
