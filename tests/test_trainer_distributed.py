"""The real trainer: torchrun ranks, FSDP2 on gloo, snapshots that transformers loads."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lockgate.coordinator.trainer_process import TrainerError, TrainerProcess
from lockgate.trainer.batch import TrainBatch, TrainSample
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


async def _train(model_dir: Path, run_dir: Path, world_size: int, steps: int) -> list[Path]:
    config = TrainerConfig(
        model_dir=model_dir, world_size=world_size, lr=1e-3, micro_batch_tokens=64
    )
    trainer = TrainerProcess(config, run_dir, run_dir / "trainer.log")
    trainer.start()
    try:
        out = []
        for step in range(1, steps + 1):
            result = await trainer.train_step(_batch(step))
            assert result.step == step
            assert result.metrics["tokens"] > 0
            out.append(Path(result.weights_dir))
        return out
    finally:
        trainer.stop()


async def test_two_ranks_train_exactly_like_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    one = await _train(tiny_model_dir, tmp_path / "ws1", 1, 2)
    two = await _train(tiny_model_dir, tmp_path / "ws2", 2, 2)
    a, b = (
        load_file(str(one[-1] / "model.safetensors")),
        load_file(str(two[-1] / "model.safetensors")),
    )
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    assert a.keys() == b.keys() == start.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    moved = max((a[k] - start[k]).abs().max().item() for k in a)
    print(f"\nws1 vs ws2 max weight difference {worst:.2e}; moved from init by {moved:.2e}")
    assert worst < 1e-5
    assert moved > 1e-4  # the step really changed the weights


async def test_snapshot_is_an_hf_model_whose_logprobs_changed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    (snapshot,) = await _train(tiny_model_dir, tmp_path / "run", 1, 1)
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
