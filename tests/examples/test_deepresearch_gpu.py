"""The DeepResearch GPU recipe's config, checked everywhere (its smoke run on a GPU:
tests/gpu/test_deepresearch_gpu.py)."""

from __future__ import annotations

from pathlib import Path

from lockgate.coordinator.config import load_config

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIG = ROOT / "examples/deepresearch/configs/rl_gpu.yaml"


def test_the_gpu_config_is_the_cpu_recipe_on_cuda_with_the_peers_numbers() -> None:
    config = load_config(GPU_CONFIG)
    assert config.trainer.device == "cuda" and config.sync.snapshot_layout == "hf"
    assert config.environment.path == ROOT / "examples/deepresearch/env.py"
    agent = config.environment.args["agent"]
    assert agent["topk"] == 3 and agent["max_turns"] >= 4 and 5 <= config.loop.group_size <= 8
    assert config.algorithm.estimator == "grpo"
