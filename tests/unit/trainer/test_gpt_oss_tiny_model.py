"""The tiny gpt-oss model's tokenizer is o200k_harmony (harmony's own ids for any text and for
its special tokens), and its template writes what `renderers`' gpt-oss renderer writes beyond the
shared family tests: typed tool parameters, several calls and results, reasoning kept only for an
open tool cycle, and a final answer closed with <|return|>."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import renderers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec
from lockgate.trainer.tiny_models.harmony_vocab import require_o200k


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    require_o200k()
    return AutoTokenizer.from_pretrained(str(ensure_tiny_model(spec=family_spec("gpt-oss"))))


def test_the_tokenizer_gives_harmonys_ids(tok: PreTrainedTokenizerBase) -> None:
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    rng = random.Random(0)
    alphabet = "abcXYZ 0123456789\n\t'.,!{}\"éß東京😀/"
    texts = ["It's   THE'LL don't\r\n\tcode {\"a\": 1}", "def f(x):\n    return x**2\n\n\n"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(200)]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == enc.encode(text), text
    for token in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"):
        assert tok.convert_tokens_to_ids(token) == enc.encode(token, allowed_special="all")[0]
    assert len(tok) == 201088 and tok.eos_token == "<|return|>"


TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "Desc.",
            "parameters": {
                "type": "object",
                "properties": {
                    "u": {"type": "string", "enum": ["c", "f"], "description": "The unit."},
                    "xs": {"type": "array", "items": {"type": "string"}},
                    "o": {"type": "object"},
                    "flag": {"type": "boolean", "default": True},
                    "n": {"type": ["integer", "null"]},
                },
                "required": ["u"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "g", "parameters": {"type": "object", "properties": {}}},
    },
    {"type": "function", "function": {"name": "h", "description": "No parameters."}},
]

CALLS = {
    "role": "assistant",
    "reasoning_content": "Both tools.",
    "content": "",
    "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"u": "c"}}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ],
}
RESULTS = [
    {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "r1"},
    {"role": "tool", "tool_call_id": "c2", "content": "r2"},
]
ANSWER = {"role": "assistant", "reasoning_content": "Done now.", "content": "Done."}


@pytest.mark.parametrize(
    ("messages", "generation_prompt", "reasoning_kept"),
    [
        ([{"role": "user", "content": "hi"}, CALLS, *RESULTS], True, True),  # an open tool cycle
        ([{"role": "user", "content": "hi"}, CALLS, *RESULTS, ANSWER], False, False),  # <|return|>
        (
            [{"role": "user", "content": "hi"}, ANSWER, {"role": "user", "content": "more"}],
            True,
            False,
        ),
    ],
)
def test_the_template_writes_harmony_as_the_renderer_does(
    tok: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    generation_prompt: bool,
    reasoning_kept: bool,
) -> None:
    renderer = renderers.create_renderer(tok, renderers.config_from_name("gpt-oss"))
    text = tok.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=generation_prompt, tokenize=False
    )
    got = renderer.render_ids(messages, tools=TOOLS, add_generation_prompt=generation_prompt)
    assert tok.encode(text, add_special_tokens=False) == got, (text, tok.decode(got))
    assert ("Both tools." in text) == reasoning_kept
    assert text.endswith("<|return|>") == (messages[-1] is ANSWER)


def test_the_model_is_built_only_with_the_vocabulary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lockgate.coordinator.cli.main import main
    from lockgate.trainer.tiny_models.harmony_vocab import MissingVocabulary

    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("LOCKGATE_CACHE", str(tmp_path))
    with pytest.raises(MissingVocabulary, match=r"run scripts/setup\.sh"):
        ensure_tiny_model(spec=family_spec("gpt-oss"))
    assert main(["build-model", "--format", "gpt-oss"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockgate: --format gpt-oss: the gpt-oss (harmony) format needs")
    assert "run scripts/setup.sh" in err and err.count("\n") == 1


def test_the_trainers_forward_is_transformers_gpt_oss_forward() -> None:
    """The tiny model is gpt-oss's own architecture, and the trainer's forward (packed, one row
    at a time, rows sharing a long prefix) computes what transformers' eager gpt-oss does: its
    attention sinks and its sliding window (128, exceeded here) included."""
    import torch
    from transformers import AutoModelForCausalLM

    from lockgate.trainer.model import forward_logits, load_policy, pad_batch

    model_dir = ensure_tiny_model(spec=family_spec("gpt-oss"))
    ours = load_policy(model_dir, torch.device("cpu")).eval()
    assert type(ours).__name__ == "GptOssForCausalLM"
    assert ours.config.layer_types == ["sliding_attention", "full_attention"]
    reference = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(0, 199_000, (300,), generator=gen).tolist()
    shares_prefix = first[:200] + torch.randint(0, 199_000, (60,), generator=gen).tolist()
    rows = [first, first[:150], shares_prefix]
    ids = pad_batch(rows, torch.long, torch.device("cpu"))
    lengths = [len(r) for r in rows]
    with torch.no_grad():
        want = [reference(input_ids=torch.tensor([r])).logits[0] for r in rows]
        for pack in (True, False):
            got = forward_logits(ours, ids, lengths, pack=pack)
            for i, n in enumerate(lengths):
                torch.testing.assert_close(got[i, :n], want[i], rtol=1e-4, atol=1e-4)
