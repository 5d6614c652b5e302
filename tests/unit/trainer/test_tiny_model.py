"""The tiny test model: loads with transformers, builds deterministically, and its tokenizer and
chat template agree token for token with the `renderers` library's Qwen3 renderer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import renderers
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from lockgate.trainer.tiny_models.builder import (
    _QWEN3_ADDED_TOKENS,
    EOS_TOKEN,
    TinyModelSpec,
    build_tiny_model,
    builder_fingerprint,
    ensure_tiny_model,
)

ADD_FUNCTION: dict[str, Any] = {
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
WEATHER_FUNCTION: dict[str, Any] = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"],
    },
}
FLAT_TOOLS = [ADD_FUNCTION, WEATHER_FUNCTION]
OPENAI_TOOLS = [{"type": "function", "function": f} for f in FLAT_TOOLS]

PLAIN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me about Paris in 2 sentences, please."},
]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "id": "call_1",
                "function": {"name": "add", "arguments": {"a": 2, "b": 3}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "And the weather in Oslo?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {
                "type": "function",
                "id": "call_2",
                "function": {
                    "name": "get_weather",
                    "arguments": {"city": "Oslo", "unit": "celsius"},
                },
            },
            {
                "type": "function",
                "id": "call_3",
                "function": {"name": "add", "arguments": {"a": 1, "b": 1}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temperature": -3}'},
    {"role": "tool", "tool_call_id": "call_3", "content": "2"},
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def renderer(tok: PreTrainedTokenizerBase) -> renderers.Renderer:
    # Auto-resolution goes by the tokenizer's name, which a local tiny model does not have.
    return renderers.create_renderer(tok, renderers.config_from_name("qwen3"))


def _template_ids(
    tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    # Recent transformers return a BatchEncoding here, older ones a plain list.
    ids = out["input_ids"] if not isinstance(out, list) else out
    return list(ids)


def test_loads_with_transformers(tiny_model_dir: Path, tok: PreTrainedTokenizerBase) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config.vocab_size >= len(tok)
    ids = tok("Hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)


def test_special_tokens_are_single_ids(tok: PreTrainedTokenizerBase) -> None:
    for content, _special in _QWEN3_ADDED_TOKENS:
        ids = tok.encode(content, add_special_tokens=False)
        assert len(ids) == 1, (content, ids)
        assert tok.convert_ids_to_tokens(ids[0]) == content
    assert tok.eos_token == EOS_TOKEN == "<|im_end|>"
    assert tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_build_is_deterministic(tmp_path: Path) -> None:
    build_tiny_model(tmp_path / "one")
    build_tiny_model(tmp_path / "two")
    one, two = tmp_path / "one", tmp_path / "two"
    assert (one / "tokenizer.json").read_bytes() == (two / "tokenizer.json").read_bytes()
    w1, w2 = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert w1.keys() == w2.keys()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_renderer_matches_template_plain(
    tok: PreTrainedTokenizerBase, renderer: renderers.Renderer
) -> None:
    ids = renderer.render_ids(PLAIN, add_generation_prompt=True)  # type: ignore[arg-type]
    assert ids == _template_ids(tok, PLAIN, None)


@pytest.mark.parametrize("tools", [FLAT_TOOLS, OPENAI_TOOLS], ids=["flat", "openai"])
def test_renderer_matches_template_with_tools(
    tok: PreTrainedTokenizerBase, renderer: renderers.Renderer, tools: list[dict[str, Any]]
) -> None:
    # Both sides embed each tool dict verbatim (`json.dumps` / `tojson`), so they agree only for
    # the same dict shape: a flat ToolSpec and an OpenAI-style tool give different prompts.
    ids = renderer.render_ids(PLAIN, tools=tools, add_generation_prompt=True)  # type: ignore[arg-type]
    assert ids == _template_ids(tok, PLAIN, tools)


@pytest.mark.parametrize("tools", [FLAT_TOOLS, OPENAI_TOOLS], ids=["flat", "openai"])
def test_renderer_matches_template_multi_turn_tool_calls(
    tok: PreTrainedTokenizerBase, renderer: renderers.Renderer, tools: list[dict[str, Any]]
) -> None:
    ids = renderer.render_ids(TOOL_CONVERSATION, tools=tools, add_generation_prompt=True)  # type: ignore[arg-type]
    expected = _template_ids(tok, TOOL_CONVERSATION, tools)
    assert ids == expected
    # Guard against a vacuous match: all three calls and responses made it into the prompt.
    history = tok.decode(expected).split("<|im_end|>", 1)[1]
    assert history.count("<tool_call>") == 3
    assert history.count("<tool_response>") == 3


def test_parse_tool_call(tok: PreTrainedTokenizerBase, renderer: renderers.Renderer) -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
    ids = tok.encode(text, add_special_tokens=False)
    parsed = renderer.parse_response(ids, tools=FLAT_TOOLS)  # type: ignore[arg-type]
    assert [(c.name, c.arguments, c.status) for c in parsed.tool_calls] == [
        ("add", {"a": 1}, renderers.ToolCallParseStatus.OK)
    ]
    assert parsed.content == ""


def test_a_spec_builds_its_own_model_with_its_own_words(tmp_path: Path) -> None:
    words = tuple(f"Zorvanquel Keltismar {i}" for i in range(200))
    spec = TinyModelSpec(
        name="custom", shape={"hidden_size": 128, "num_hidden_layers": 1}, extra_corpus=words
    )
    assert builder_fingerprint(spec=spec) != builder_fingerprint()
    assert builder_fingerprint(spec=spec) != builder_fingerprint(
        spec=TinyModelSpec(name="custom", shape=spec.shape)
    )
    path = ensure_tiny_model(tmp_path, spec)
    assert path.name.startswith("custom-") and ensure_tiny_model(tmp_path, spec) == path
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (128, 1)
    custom = AutoTokenizer.from_pretrained(str(path))
    default = AutoTokenizer.from_pretrained(str(ensure_tiny_model(tmp_path)))
    # The extra corpus taught the tokenizer the new name: fewer pieces than the default's.
    name = "Zorvanquel Keltismar"
    assert len(custom.encode(name)) < len(default.encode(name))
    with pytest.raises(ValueError, match="unknown model shape fields"):
        TinyModelSpec(shape={"hidden": 1}).model_shape()
