"""The real trainer: torchrun ranks, FSDP2 on gloo, snapshots that transformers loads."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from lockgate.coordinator.launch.trainer import TrainerError, TrainerProcess, thread_env
from lockgate.trainer.batch import TrainBatch, TrainSample
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.logprobs import logprobs_from_dir
from tests.support.trainer_runs import max_diff, near_policy_batch, synthetic_batch, train, weights

# One CPU rank runs a micro-batch's samples one at a time by default, several ranks pack them
# (trainer/model.py): both sides pack here, so only the sharding differs.
PACKED = {"micro_batch_packing": "packed"}


async def test_two_ranks_train_exactly_like_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    batches = [synthetic_batch(1), synthetic_batch(2)]
    one = await train(tiny_model_dir, tmp_path / "ws1", 1, batches, **PACKED)
    two = await train(tiny_model_dir, tmp_path / "ws2", 2, batches, **PACKED)
    a, b = weights(one[-1]), weights(two[-1])
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    worst = max_diff(a, b)
    moved = max_diff(a, start)
    print(f"\nws1 vs ws2 max weight difference {worst:.2e}; moved from init by {moved:.2e}")
    assert worst < 1e-5
    assert moved > 1e-4  # the step really changed the weights


async def test_one_sample_at_a_time_trains_like_packing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    batches = [synthetic_batch(1), synthetic_batch(2)]
    packed = await train(tiny_model_dir, tmp_path / "packed", 1, batches, **PACKED)
    alone = await train(
        tiny_model_dir, tmp_path / "alone", 1, batches, micro_batch_packing="per_sample"
    )
    worst = max_diff(weights(packed[-1]), weights(alone[-1]))
    moved = max_diff(weights(packed[-1]), load_file(str(tiny_model_dir / "model.safetensors")))
    print(f"\npacked vs one at a time {worst:.2e}; moved from init by {moved:.2e}")
    # The same sums in another order: float rounding only, far below the update's size.
    assert worst < 5e-5
    assert moved > 1e-4


async def test_snapshot_is_an_hf_model_whose_logprobs_changed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    (result,) = await train(tiny_model_dir, tmp_path / "run", 1, [synthetic_batch(1)])
    snapshot = Path(result.weights_dir)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (snapshot / name).is_file()
    seq = synthetic_batch(1).samples[0].input_ids
    before = logprobs_from_dir(tiny_model_dir, [seq])[0]
    after = logprobs_from_dir(snapshot, [seq])[0]
    assert before[0] == after[0] == 0.0
    assert max(abs(x - y) for x, y in zip(before, after, strict=True)) > 1e-4


async def test_a_bad_batch_fails_the_step_with_the_trainers_traceback(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = TrainerConfig(model_dir=tiny_model_dir, world_size=1, device="cpu")
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
        **PACKED,
    }
    batches = [near_policy_batch(tiny_model_dir, k) for k in (1, 2)]
    one = await train(tiny_model_dir, tmp_path / "ws1", 1, batches, **options)
    two = await train(
        tiny_model_dir, tmp_path / "ws2", 2, batches, activation_checkpointing=True, **options
    )
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    worst = max_diff(weights(one[-1]), weights(two[-1]))
    moved = max_diff(weights(one[-1]), start)
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


def test_rank_threads_sleep_beside_other_work_and_spin_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Spinning OpenMP threads beside a busy core made a 2-thread rank >4x slower.
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert thread_env(2) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    # Alone (`lockgate sft`), spinning threads are faster.
    assert thread_env(2, alone=True)["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert thread_env(1)["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert thread_env(2, alone=True)["OMP_WAIT_POLICY"] == "PASSIVE"


async def test_the_entropy_coef_sharpens_or_flattens_the_real_policy(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With zero advantages only the entropy term moves the weights: a negative coefficient
    (entropy minimisation) must lower the policy's entropy on the batch, and a positive one
    leave it higher than the negative one does."""
    zero = synthetic_batch(1).samples
    zero = [s.model_copy(update={"advantages": [0.0] * len(s.advantages)}) for s in zero]
    batches = [TrainBatch(step=k, samples=zero) for k in (1, 2)]
    entropy = {}
    for coef in (-1.0, 1.0):
        results = await train(
            tiny_model_dir, tmp_path / f"c{coef}", 1, batches, entropy_coef=coef, lr=1e-2
        )
        # a step's entropy is measured before its update: step 2's is the policy after step 1
        entropy[coef] = (results[0].metrics["entropy"], results[1].metrics["entropy"])
    print(f"\nentropy before -> after one step: {entropy}")
    assert entropy[-1.0][0] == pytest.approx(entropy[1.0][0])
    assert entropy[-1.0][1] < entropy[-1.0][0] - 0.01
    # the tiny model starts near uniform, so the bonus can only raise it a little
    assert entropy[1.0][1] > entropy[-1.0][1]
