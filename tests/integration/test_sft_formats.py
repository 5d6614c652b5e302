"""`lockgate sft` on tiny models of families other than Qwen3 and Llama 3: a real run (torchrun on
gloo) over tool-using chats, each masked by its format's renderer, trains a few steps and exits
0 (issue 42, must-show 3; the mask token by token: tests/unit/trainer/test_sft_formats.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from lockgate.trainer.sft.data import read_examples
from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec
from tests.integration.test_sft import CHATS, _lockgate_sft, _records, _write_jsonl

STEPS = 3
# The token each format's final answer ends on (GLM-4.5's is added: its template leaves the
# last turn unclosed).
LAST = {
    "glm-4.5": "<|endoftext|>",
    "deepseek-r1": "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "gpt-oss": "<|return|>",
}


@pytest.mark.parametrize("family", sorted(LAST))
def test_a_tool_chat_run_trains_in_the_models_format_and_exits_0(
    family: str, tmp_path: Path
) -> None:
    model = ensure_tiny_model(spec=family_spec(family))
    _write_jsonl(tmp_path / "chats.jsonl", CHATS)
    config = {
        "out_dir": "out",
        "model": {"path": str(model)},
        "data": {"path": "chats.jsonl", "max_length": 512},
        "loop": {"max_steps": STEPS, "batch_size": 2, "log_every": 1},
        "trainer": {"lr": 0.003, "device": "cpu", "checkpoint_every": 0},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    result = _lockgate_sft(tmp_path / "config.yaml")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["model"]["chat_format"] == family
    assert [r["step"] for r in _records(out)] == list(range(1, STEPS + 1))
    assert all(r["sft/trained_tokens"] > 0 for r in _records(out))
    assert (out / "final" / "model.safetensors").exists()
    # Every chat is trained, its answer through the format's closing token.
    tok = AutoTokenizer.from_pretrained(str(model))
    examples = read_examples(out / "data" / "train.jsonl")
    assert len(examples) == len(CHATS)
    for e in examples:
        last = max(k for k, m in enumerate(e.loss_mask) if m)
        assert tok.convert_ids_to_tokens(e.input_ids[last]) == LAST[family]
