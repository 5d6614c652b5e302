"""The real trainer: torchrun ranks, FSDP2 on gloo, snapshots that transformers loads."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lockgate.coordinator.trainer_process import TrainerError, TrainerProcess
from lockgate.trainer.batch import StepResult, TrainBatch, TrainSample
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.logprobs import logprobs_from_dir


def _batch(step: int, seed: int = 0) -> TrainBatch:
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


async def _train(
    model_dir: Path,
    run_dir: Path,
    world_size: int,
    batches: list[TrainBatch],
    **options: Any,
) -> list[StepResult]:
    config = TrainerConfig(
        model_dir=model_dir, world_size=world_size, lr=1e-3, micro_batch_tokens=64, **options
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


def _weights(result: StepResult) -> dict[str, torch.Tensor]:
    return load_file(str(Path(result.weights_dir) / "model.safetensors"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


async def test_two_ranks_train_exactly_like_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    batches = [_batch(1), _batch(2)]
    one = await _train(tiny_model_dir, tmp_path / "ws1", 1, batches)
    two = await _train(tiny_model_dir, tmp_path / "ws2", 2, batches)
    a, b = _weights(one[-1]), _weights(two[-1])
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    worst = _max_diff(a, b)
    moved = _max_diff(a, start)
    print(f"\nws1 vs ws2 max weight difference {worst:.2e}; moved from init by {moved:.2e}")
    assert worst < 1e-5
    assert moved > 1e-4  # the step really changed the weights


async def test_snapshot_is_an_hf_model_whose_logprobs_changed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    (result,) = await _train(tiny_model_dir, tmp_path / "run", 1, [_batch(1)])
    snapshot = Path(result.weights_dir)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (snapshot / name).is_file()
    seq = _batch(1).samples[0].input_ids
    before = logprobs_from_dir(tiny_model_dir, [seq])[0]
    after = logprobs_from_dir(snapshot, [seq])[0]
    assert before[0] == after[0] == 0.0
    assert max(abs(x - y) for x, y in zip(before, after, strict=True)) > 1e-4


async def test_a_bad_batch_fails_the_step_with_the_trainers_traceback(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = TrainerConfig(model_dir=tiny_model_dir, world_size=1)
    trainer = TrainerProcess(config, tmp_path, tmp_path / "trainer.log")
    trainer.start()
    try:
        bad = TrainBatch(
            step=1,
            samples=[
                TrainSample(
                    input_ids=[1, 10**6],
                    loss_mask=[0, 1],
                    rollout_logprobs=[0, -1],
                    advantages=[0, 1],
                )
            ],
        )
        with pytest.raises(TrainerError, match="step 1"):
            await trainer.train_step(bad)
    finally:
        trainer.stop()


def _near_policy_batch(model_dir: Path, step: int) -> TrainBatch:
    """Rollout logprobs = the initial policy's own, slightly perturbed (a sampler that nearly
    matches the trainer), so behaviour weights start near 1 as they would in a real run."""
    batch = _batch(step, seed=step)
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


async def test_every_objective_option_trains_the_same_on_two_ranks_as_on_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Decoupled PPO with three updates per batch, sequence-level TIS, a KL penalty to the
    reference model, an entropy bonus, a cosine schedule with warmup, Dr. GRPO's aggregation,
    and activation checkpointing on the two-rank side only (it must not change the numbers)."""
    options: dict[str, Any] = {
        "ppo_mode": "decoupled",
        "mini_batches": 3,
        "tis_level": "sequence",
        "tis_cap": 2.0,
        "kl_coef": 0.05,
        "entropy_coef": 0.01,
        "lr_schedule": "cosine",
        "warmup_steps": 1,
        "decay_steps": 3,
        "loss_agg": "seq-mean-token-sum",
    }
    batches = [_near_policy_batch(tiny_model_dir, k) for k in (1, 2)]
    one = await _train(tiny_model_dir, tmp_path / "ws1", 1, batches, **options)
    two = await _train(
        tiny_model_dir, tmp_path / "ws2", 2, batches, activation_checkpointing=True, **options
    )
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    worst = _max_diff(_weights(one[-1]), _weights(two[-1]))
    moved = _max_diff(_weights(one[-1]), start)
    print(f"\nall options: ws1 vs ws2 {worst:.2e}; moved from init by {moved:.2e}")
    # Each rank packs its own samples, so the two sides round differently, and six AdamW
    # updates of this objective grow that to a few 1e-5 while the weights move ~5e-3; a real
    # fault (a lost micro-batch, a wrong normalisation across ranks) is of the update's order.
    assert worst < 1e-4
    assert moved > 1e-4

    for a, b in zip(one, two, strict=True):
        for key, value in a.metrics.items():
            assert math.isfinite(value), key
            # timings vary, and micro-batches are counted per rank
            if not key.endswith("_time_s") and key != "micro_batches":
                assert b.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    first, second = one[0].metrics, one[1].metrics
    assert first["updates"] == 3
    # step 1 is the warmup's last step (the peak); step 2 is 1/3 into the cosine decay
    assert first["lr"] == pytest.approx(1e-3)
    assert second["lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi / 3)))
    # The second update of step 1 runs on weights the first one changed: its ratio to the
    # proximal (start-of-step) policy is no longer 1.
    assert first["ratio_max"] > 1.0 or first["ratio_min"] < 1.0
    # the rollout logprobs were perturbed by at most 0.05 nats a token
    assert 0.3 < first["is_weight_mean"] < 3.0
    assert 0.0 <= first["tis_truncated_frac"] <= 1.0
    assert 0.0 < first["mismatch_kl"] < 0.01
    # the policy moved away from the reference during step 1
    assert second["ref_kl"] > 0.0
    assert first["entropy"] > 0.0
