"""The trainer on a CUDA GPU: NCCL, FSDP2 with bf16 compute over fp32 master weights, and
snapshots exported from GPU memory.

CI has no GPU, so these are skipped there; the checkpoint-resume test in
tests/integration/test_trainer_checkpoint.py has a CUDA case too, tests/gpu/test_sft.py one of
`lockgate sft`. docs/design.md ("GPU") says how to run them and when they last passed on a GPU.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.trainer_runs import near_policy_batch, needs_gpu, train, weights


def _relative_distance(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], origin: dict[str, torch.Tensor]
) -> float:
    """||a - b|| / ||b - origin|| over all weights: how far apart two runs ended up, relative to
    how far training moved them."""
    apart = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in b)
    moved = sum(float((b[k] - origin[k]).double().pow(2).sum()) for k in b)
    return math.sqrt(apart / moved)


@needs_gpu
async def test_the_gpu_trainer_follows_the_cpu_trainer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Same batches, same seed: bf16 compute moves the weights where fp32 on the CPU does."""
    batches = [near_policy_batch(tiny_model_dir, k) for k in (1, 2, 3)]
    options = {"ppo_mode": "decoupled", "mini_batches": 2, "kl_coef": 0.05}
    gpu = await train(tiny_model_dir, tmp_path / "gpu", 1, batches, device="cuda", **options)
    cpu = await train(tiny_model_dir, tmp_path / "cpu", 1, batches, device="cpu", **options)
    assert "rank(s) on cuda" in (tmp_path / "gpu" / "trainer.log").read_text()
    assert "rank(s) on cpu" in (tmp_path / "cpu" / "trainer.log").read_text()

    start = load_file(str(tiny_model_dir / "model.safetensors"))
    for k, tensor in weights(gpu[-1]).items():
        assert tensor.dtype == torch.float32, k  # the snapshot holds the fp32 master weights
    distance = _relative_distance(weights(gpu[-1]), weights(cpu[-1]), start)
    print(f"\nGPU vs CPU after 3 steps: {distance:.3f} of the distance trained")
    assert distance < 0.25

    for g, c in zip(gpu, cpu, strict=True):
        print({k: (round(g.metrics[k], 5), round(c.metrics[k], 5)) for k in sorted(c.metrics)})
        assert g.metrics.keys() == c.metrics.keys()
        assert all(math.isfinite(v) for v in g.metrics.values()), g.metrics
        assert g.metrics["tokens"] == c.metrics["tokens"]
        assert g.metrics["loss"] == pytest.approx(c.metrics["loss"], rel=0.05, abs=2e-3)
        # bf16 logits add to the perturbation the rollout logprobs already carry
        assert g.metrics["mismatch_kl"] == pytest.approx(c.metrics["mismatch_kl"], rel=0.5)
    assert gpu[-1].metrics["ref_kl"] > 0.0
