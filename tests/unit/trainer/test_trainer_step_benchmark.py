"""The trainer step benchmark's pure parts: the parameter count behind its TFLOP/s figure, and
the agent-shaped batch it trains on (benchmarks/trainer_step.py; the step itself needs a GPU
to mean anything and is run by hand, benchmarks/README.md)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.trainer_step import SHAPES, make_batch, parameter_count


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_parameter_count_is_the_models(shape: str) -> None:
    config = Qwen3Config(**SHAPES[shape])
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    assert parameter_count(config.to_dict()) == sum(p.numel() for p in model.parameters())


def test_a_group_shares_its_prompt_and_trains_on_its_responses_only() -> None:
    batch = make_batch(1, vocab=100, groups=2, group_size=4, prompt=10, response=8)
    assert len(batch.samples) == 8
    for g in range(2):
        group = batch.samples[4 * g : 4 * g + 4]
        assert len({tuple(s.input_ids[:10]) for s in group}) == 1
        assert sorted(s.advantages[-1] for s in group) == [-1.0, -1.0, 1.0, 1.0]
        for s in group:
            assert s.loss_mask[:10] == [0] * 10 and all(s.loss_mask[10:])
            assert 4 <= len(s.input_ids) - 10 <= 12
    assert batch.samples[0].input_ids[:10] != batch.samples[4].input_ids[:10]
