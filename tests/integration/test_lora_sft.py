"""`lockgate sft` with `model.lora`, a real run (torchrun on gloo with the tiny model): only the
adapters train and are checkpointed, the loss falls, `final/` is an HF model that transformers
loads (the adapters merged in) and `final_adapter/` the adapter, whose model on the base computes
final/'s logits; a run resumed from its adapter checkpoint continues the same losses. The run's
data and config are test_sft.py's."""

from __future__ import annotations

import json
import subprocess
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from lockgate.trainer.logprobs import load_from_dir
from lockgate.trainer.lora import is_adapter_dir, is_lora_name
from tests.integration.test_sft import _config, _lockgate_sft, _ok, _records

LORA = {"lora": {"rank": 8, "alpha": 16}}
# Adapters start as the base model and move a low-rank slice of it: a larger rate than full
# fine-tuning's, over test_sft.py's 24 steps.
TRAINER = {"lr": 0.01, "checkpoint_every": 4}
LOOP = {"epochs": 12}
STEPS = 24


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = _config(tmp_path_factory.mktemp("lora-sft"), model=LORA, trainer=TRAINER, loop=LOOP)
    result = _lockgate_sft(config)
    _ok(result)
    assert f"sft step {STEPS}/{STEPS}" in result.stderr
    return config.parent / "out"


def test_the_adapters_learn_and_final_is_the_merged_model(
    lora_run: Path, tiny_model_dir: Path
) -> None:
    losses = [r["sft/loss"] for r in _records(lora_run)]
    assert len(losses) == STEPS
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    print(f"\nlora sft losses {[round(x, 3) for x in losses]}")
    # A rank-8 slice of a 64-wide random model learns more slowly than full fine-tuning
    # (test_sft.py's run halves its loss in these steps), but it must clearly learn.
    assert last < 0.9 * first, losses
    assert all(b < a for a, b in pairwise(losses[:8])), losses

    final, adapter = lora_run / "final", lora_run / "final_adapter"
    assert (final / "config.json").is_file() and not is_adapter_dir(final)
    assert is_adapter_dir(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())

    merged = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with_adapter = load_from_dir(adapter, torch.device("cpu"))
    ids = torch.randint(0, merged.config.vocab_size, (2, 40), generator=torch.Generator())
    with torch.no_grad():
        ours = merged(input_ids=ids).logits
        theirs = with_adapter(input_ids=ids).logits
        before = base(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert float((ours - before).abs().max()) > 1e-2  # training moved the model

    # Checkpoints hold the adapters and their optimizer state, no base weight.
    saved = FileSystemReader(str(lora_run / "checkpoints" / f"step_{STEPS}")).read_metadata()
    weights = [
        k.removeprefix("model.") for k in saved.state_dict_metadata if k.startswith("model.")
    ]
    assert weights and all(is_lora_name(k) for k in weights)


def test_a_resumed_lora_run_continues_the_same_losses(lora_run: Path, tmp_path: Path) -> None:
    config = _config(tmp_path, model=LORA, trainer=TRAINER, loop={**LOOP, "max_steps": 6})
    _ok(_lockgate_sft(config))
    out = tmp_path / "out"
    # Checkpoints at 4 and at the last step, 6; drop 6 so the resume redoes steps 5-6.
    subprocess.run(["rm", "-r", str(out / "checkpoints" / "step_6")], check=True)
    _ok(_lockgate_sft(config, "--resume", "--set", "loop.max_steps=null"))
    resumed, uninterrupted = _records(out), _records(lora_run)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=1e-5, abs=1e-6), a["step"]
