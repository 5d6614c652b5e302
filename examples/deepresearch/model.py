"""The CPU recipe's model: a ~3.4M-parameter Qwen3 built offline by lockgate's model builder.

Same builder, chat template and special tokens as the test model, but four layers of width 256
and a tokenizer whose ~1k-token vocabulary also learned the knowledge base's words (made-up
names split into few syllable tokens; digits stay one per token), so a transcript fits a small
context and copying a name is a short job for attention.
"""

from __future__ import annotations

import json
from pathlib import Path

from lockgate.examples.deepresearch.agent import SYSTEM_PROMPT, TOOLS
from lockgate.examples.deepresearch.data import CORPUS, TRAIN
from lockgate.trainer.tiny_models.builder import TinyModelSpec, ensure_tiny_model

MODEL_NAME = "lockgate-deepresearch-qwen3"

SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    # Qwen3's 1e6 leaves a 32-wide head only a few rotary pairs that turn within a transcript;
    # copying a name needs a sharp previous-token head, which 1e4 makes easy to learn.
    "rope_theta": 10_000.0,
}


def _tokenizer_texts(kb_dir: Path) -> tuple[str, ...]:
    """The training world's documents and the agent's scaffolding, for the tokenizer's merges."""
    texts = [SYSTEM_PROMPT, json.dumps(TOOLS)]
    with (kb_dir / CORPUS).open() as f:
        texts += [json.loads(line)["contents"] for line in f if '"id": "t' in line]
    with (kb_dir / TRAIN).open() as f:
        for line in f:
            q = json.loads(line)
            entity = q["chain"][0]["entity"]
            texts.append(q["question"])
            texts.append(json.dumps({"name": "search", "arguments": {"query": entity}}))
            texts.append(f"I need to find {entity}. <answer>{q['golden_answers'][0]}</answer>")
    return tuple(texts)


def model_spec(kb_dir: Path) -> TinyModelSpec:
    return TinyModelSpec(name=MODEL_NAME, shape=SHAPE, extra_corpus=_tokenizer_texts(kb_dir))


def ensure_model(kb_dir: Path, cache_dir: Path | None = None) -> Path:
    """The recipe's untrained model (built once per knowledge base, then cached)."""
    return ensure_tiny_model(cache_dir, model_spec(Path(kb_dir)))
