"""Trainer runs shared by the trainer tests: synthetic batches, a run through the real trainer
process, and comparisons of the snapshots it exports."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lockgate.coordinator.launch.trainer import TrainerProcess
from lockgate.trainer.batch import StepResult, TrainBatch, TrainSample
from lockgate.trainer.config import Device, TrainerConfig
from lockgate.trainer.logprobs import logprobs_from_dir

# CI has no GPU, so these run only where one is (docs/design.md, "GPU", says how to run them
# and whether they have run yet); every path they cover also runs on the CPU in CI.
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def synthetic_batch(step: int, seed: int = 0) -> TrainBatch:
    """Six random sequences with a short prompt; odd samples rewarded, even ones penalised."""
    rng = random.Random(seed)
    samples = []
    for i in range(6):
        n, p = rng.randint(10, 40), rng.randint(3, 8)
        mask = [0] * p + [1] * (n - p)
        samples.append(
            TrainSample(
                input_ids=[rng.randrange(1000) for _ in range(n)],
                loss_mask=mask,
                rollout_logprobs=[-7.0 * m for m in mask],
                advantages=[(1.0 if i % 2 else -1.0) * m for m in mask],
            )
        )
    return TrainBatch(step=step, samples=samples)


async def train(
    model_dir: Path,
    run_dir: Path,
    world_size: int,
    batches: list[TrainBatch],
    device: Device = "cpu",
    **options: Any,
) -> list[StepResult]:
    """Train `batches` in a fresh trainer process tree; the results of every step.

    The CPU by default, whatever the machine has: the tests' tolerances are fp32's.
    """
    config = TrainerConfig(
        model_dir=model_dir,
        world_size=world_size,
        device=device,
        **({"lr": 1e-3, "micro_batch_tokens": 64} | options),
    )
    trainer = TrainerProcess(config, run_dir, run_dir / "trainer.log")
    trainer.start()
    try:
        out = []
        for batch in batches:
            result = await trainer.train_step(batch)
            assert result.step == batch.step
            assert result.metrics["tokens"] > 0
            out.append(result)
        return out
    finally:
        trainer.stop()


def weights(result: StepResult) -> dict[str, torch.Tensor]:
    return load_file(str(Path(result.weights_dir) / "model.safetensors"))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def near_policy_batch(model_dir: Path, step: int) -> TrainBatch:
    """Rollout logprobs = the initial policy's own, slightly perturbed (a sampler that nearly
    matches the trainer), so behaviour weights start near 1 as they would in a real run."""
    batch = synthetic_batch(step, seed=step)
    exact = logprobs_from_dir(model_dir, [s.input_ids for s in batch.samples])
    rng = random.Random(100 + step)
    samples = [
        s.model_copy(
            update={
                "rollout_logprobs": [
                    (lp + rng.uniform(-0.05, 0.05)) * m
                    for lp, m in zip(lps, s.loss_mask, strict=True)
                ]
            }
        )
        for s, lps in zip(batch.samples, exact, strict=True)
    ]
    return TrainBatch(step=step, samples=samples)
