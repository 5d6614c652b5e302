"""`lockgate sft` on a GPU: it trains the CPU run's steps in bf16 and saves fp32 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_sft import (
    _config,
    _lockgate_sft,
    _ok,
    _records,
    _saved_dtypes,
    full_run,
)
from tests.support.trainer_runs import needs_gpu

__all__ = ["full_run"]  # the fixtures, used by name


@needs_gpu
def test_on_a_gpu_sft_trains_the_cpu_steps_in_bf16_and_saves_fp32_weights(
    full_run: Path, tmp_path: Path
) -> None:
    # `auto` compute on cuda is bf16 over fp32 master weights: near the CPU's fp32 losses.
    config = _config(tmp_path, loop={"max_steps": 4}, trainer={"device": "cuda"})
    _ok(_lockgate_sft(config))
    gpu = _records(tmp_path / "out")
    assert len(gpu) == 4
    for a, b in zip(gpu, _records(full_run)[:4], strict=True):
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=0.03)
        assert a["sft/trained_tokens"] == b["sft/trained_tokens"]
    assert gpu[-1]["sft/loss"] < gpu[0]["sft/loss"]
    assert _saved_dtypes(tmp_path / "out") == {torch.float32}
