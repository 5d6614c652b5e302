"""The gateway's direct Rust tokenizer gives exactly what transformers' tokenizer gives: the same
ids for every text, the same text for every ids, and so the same renders and parses through
`renderers`."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import renderers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lockgate.gateway.calls.tokenizer import FastTokenizer, fast_tokenizer
from tests.unit.trainer.test_tiny_model import OPENAI_TOOLS, PLAIN, TOOL_CONVERSATION

PIECES = [
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|endoftext|>",
    "\n",
    "\n\n",
    "  ",
    "\t",
    " ",
    "hello",
    " world",
    "Hello!",
    "déjà vu",
    "日本語のテキスト",
    "🙂👍🏽",
    '{"name": "add", "arguments": {"a": 2}}',
    "user\n",
    "assistant\n",
    "<|im_start|>assistant\n",
    "\u200b",
    "a" * 40,
]


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def fast(hf: PreTrainedTokenizerBase) -> FastTokenizer:
    out = fast_tokenizer(hf)
    assert isinstance(out, FastTokenizer)
    return out


def _texts() -> list[str]:
    rng = random.Random(0)
    out = list(PIECES)
    for _ in range(400):
        out.append("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 8))))
    return out


def test_encode_is_transformers(hf: PreTrainedTokenizerBase, fast: FastTokenizer) -> None:
    for text in _texts():
        for special in (False, True):
            expected = hf.encode(text, add_special_tokens=special)
            # Twice: the second may come from the adapter's cache of short texts.
            assert fast.encode(text, add_special_tokens=special) == expected, text
            assert fast.encode(text, add_special_tokens=special) == expected, text


def test_cached_ids_are_not_shared(fast: FastTokenizer) -> None:
    fast.encode("\n", add_special_tokens=False).append(-1)
    assert -1 not in fast.encode("\n", add_special_tokens=False)


def test_decode_is_transformers(hf: PreTrainedTokenizerBase, fast: FastTokenizer) -> None:
    rng = random.Random(1)
    vocab = len(hf)
    assert len(fast) == vocab
    for _ in range(400):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), ids
    assert fast.decode(7) == hf.decode(7)


def test_token_ids_are_transformers(hf: PreTrainedTokenizerBase, fast: FastTokenizer) -> None:
    for token in ["<tool_call>", "</think>", "<|im_end|>", "not-a-token", "hello"]:
        assert fast.convert_tokens_to_ids(token) == hf.convert_tokens_to_ids(token)
    assert fast.convert_tokens_to_ids(["<think>", "x"]) == hf.convert_tokens_to_ids(
        ["<think>", "x"]
    )


def _renderer(tok: Any) -> renderers.Renderer:
    return renderers.create_renderer(tok, renderers.config_from_name("qwen3"))


@pytest.mark.parametrize(
    ("messages", "tools"),
    [(PLAIN, None), (PLAIN, OPENAI_TOOLS), (TOOL_CONVERSATION, OPENAI_TOOLS)],
)
def test_renders_and_parses_are_transformers(
    hf: PreTrainedTokenizerBase,
    fast: FastTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> None:
    slow, quick = _renderer(hf), _renderer(fast)
    prompt = slow.render_ids(messages, tools=tools, add_generation_prompt=True)  # type: ignore[arg-type]
    assert quick.render_ids(messages, tools=tools, add_generation_prompt=True) == prompt  # type: ignore[arg-type]
    answers = [
        "<think>\nhmm</think>\n\nThe answer is 5.<|im_end|>",
        "Let me check.\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
        "<think>\nstill thinking",
        "plain 🙂 text<|im_end|>",
    ]
    for answer in answers:
        completion = hf.encode(answer, add_special_tokens=False)
        assert quick.parse_response(
            completion, tools=tools, prompt_ids=prompt
        ) == slow.parse_response(completion, tools=tools, prompt_ids=prompt)  # type: ignore[arg-type]
        follow = [{"role": "user", "content": "thanks, and 3 + 4?"}]
        bridged, expected = (
            r.bridge_to_next_turn(prompt, completion, follow, tools=tools)  # type: ignore[arg-type]
            for r in (quick, slow)
        )
        assert (bridged and bridged.token_ids) == (expected and expected.token_ids)
