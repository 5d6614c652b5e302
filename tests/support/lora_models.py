"""LoRA models for the trainer's LoRA tests: the tiny model with adapters that have trained."""

from __future__ import annotations

from pathlib import Path

import torch

from lockgate.trainer.config import LoraSpec
from lockgate.trainer.model import load_policy


def trained_lora_model(model_dir: Path, spec: LoraSpec, *, seed: int = 3) -> torch.nn.Module:
    """The model at `model_dir` with `spec`'s adapters, B random (as after training) rather
    than zero. torch is seeded first, so every process (and rank) draws the same A."""
    torch.manual_seed(0)
    model = load_policy(model_dir, torch.device("cpu"), spec)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model
