"""`lockgate sft` masks a tool-using chat in every family's format: the trained tokens are exactly
what the format's assistant writes (its reasoning, call or answer and the token that closes its
turn), token by token against the format's renderer (issue 42, must-show 3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import renderers

from lockgate.trainer.sft import data as sft_data
from lockgate.trainer.sft.data import ChatTokenizer, chat_masker, load_tokenizer, tokenize_file
from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec
from lockgate.trainer.tiny_models.families import FAMILIES
from tests.integration.test_sft import SEARCH

CALL = {"query": "France capital"}
ID = "functions.search:0"  # Kimi-K2 writes the call's id and reads the tool's name from it
# Two assistant turns: a reasoned tool call, then, after its result, a reasoned answer.
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "search first",
        "tool_calls": [
            {"id": ID, "type": "function", "function": {"name": "search", "arguments": CALL}}
        ],
    },
    {"role": "tool", "tool_call_id": ID, "content": "Paris is the capital."},
    {"role": "assistant", "content": "Paris.", "reasoning_content": "found it"},
]

# What each format's assistant writes in the two turns, spelled from the format's syntax.
# DeepSeek-R1's template keeps no reasoning in a rendered conversation (it splits every
# assistant turn at </think>); GLM-4.5 closes the call's turn with the observation marker and
# leaves the last answer unclosed, so its stop token is added; Llama 3, Kimi-K2 (whose template
# reads no reasoning_content) and the generic Qwen2.5-style template have no reasoning.
QWEN_CALL = (
    '<tool_call>\n{"name": "search", "arguments": {"query": "France capital"}}\n</tool_call>'
)
TURNS = {
    "qwen3": [
        f"<think>\nsearch first\n</think>\n\n{QWEN_CALL}<|im_end|>",
        "<think>\nfound it\n</think>\n\nParis.<|im_end|>",
    ],
    "llama-3": [
        '{"name": "search", "parameters": {"query": "France capital"}}<|eot_id|>',
        "Paris.<|eot_id|>",
    ],
    "deepseek-r1": [
        "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>function"
        '<\uff5ctool\u2581sep\uff5c>search\n```json\n{"query": "France capital"}\n```'
        "<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>"
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "Paris.<\uff5cend\u2581of\u2581sentence\uff5c>",
    ],
    "glm-4.5": [
        "<think>search first</think>\n<tool_call>search\n<arg_key>query</arg_key>\n"
        "<arg_value>France capital</arg_value>\n</tool_call><|observation|>",
        "<think>found it</think>\nParis.<|endoftext|>",
    ],
    "kimi-k2": [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0"
        '<|tool_call_argument_begin|>{"query": "France capital"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>",
        "Paris.<|im_end|>",
    ],
    "default": [f"{QWEN_CALL}<|im_end|>", "Paris.<|im_end|>"],
}


@pytest.fixture(scope="module", params=sorted(TURNS))
def family_tokenizer(request: pytest.FixtureRequest) -> tuple[str, ChatTokenizer]:
    return request.param, load_tokenizer(ensure_tiny_model(spec=family_spec(request.param)))


def _spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The runs of trained tokens, in order."""
    spans: list[list[int]] = []
    for k, (token, trained) in enumerate(zip(ids, mask, strict=True)):
        if trained and (k == 0 or not mask[k - 1]):
            spans.append([])
        if trained:
            spans[-1].append(token)
    return spans


def test_each_format_trains_exactly_its_assistants_tokens(
    family_tokenizer: tuple[str, ChatTokenizer],
) -> None:
    name, tok = family_tokenizer
    chat_format = FAMILIES[name].format
    ids, mask = chat_masker(tok, chat_format, None)(CHAT, [SEARCH])
    spans = _spans(ids, mask)
    assert [tok.decode(s) for s in spans] == TURNS[name]
    if chat_format == "default":
        return  # the template is its format: tests/unit/trainer/test_sft.py masks it by prefixes
    renderer = renderers.create_renderer(tok, renderers.config_from_name(chat_format))
    rendered = renderer.render(CHAT, tools=[SEARCH])  # type: ignore[arg-type]
    # Token by token: the renderer's own ids (GLM's added stop after them), trained exactly
    # where the renderer says the model samples.
    added = len(ids) - len(rendered.token_ids)
    assert ids[: len(rendered.token_ids)] == rendered.token_ids
    assert mask[: len(rendered.token_ids)] == [int(s) for s in rendered.sampled_mask]
    assert added == (1 if name == "glm-4.5" else 0)
    assert ids[len(rendered.token_ids) :] == renderer.get_stop_token_ids()[:added]
    # Each turn's trained tokens are a whole completion: the format's parser reads the call
    # and the answer back from them.
    call, answer = (renderer.parse_response(s) for s in spans)
    assert [(c.name, c.arguments) for c in call.tool_calls] == [("search", CALL)]
    assert (answer.content or "").strip() == "Paris." and not answer.tool_calls


def test_tool_call_arguments_as_a_json_string_train_as_an_object(
    family_tokenizer: tuple[str, ChatTokenizer],
) -> None:
    name, tok = family_tokenizer
    as_string = json.loads(json.dumps(CHAT))
    as_string[2]["tool_calls"][0]["function"]["arguments"] = json.dumps(CALL)
    masker = chat_masker(tok, FAMILIES[name].format, None)
    assert masker(as_string, [SEARCH]) == masker(CHAT, [SEARCH])


def test_end_of_turn_is_refused_where_the_renderer_marks_the_turns_end(
    family_tokenizer: tuple[str, ChatTokenizer],
) -> None:
    name, tok = family_tokenizer
    if FAMILIES[name].format == "default":
        pytest.skip("the generic template takes data.end_of_turn")
    with pytest.raises(ValueError, match=f"data.end_of_turn is for the generic .* '{name}'"):
        chat_masker(tok, name, "<|endoftext|>")


def test_an_unknown_format_is_an_error_naming_the_known_ones(
    family_tokenizer: tuple[str, ChatTokenizer],
) -> None:
    _, tok = family_tokenizer
    with pytest.raises(ValueError, match=r"name='llama3'\. Known: .*'llama-3'"):
        chat_masker(tok, "llama3", None)


def test_forked_workers_mask_as_one_process_does(
    family_tokenizer: tuple[str, ChatTokenizer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, tok = family_tokenizer
    monkeypatch.setattr(sft_data, "_PARALLEL_FROM", 1)
    monkeypatch.setattr(sft_data, "_CHUNK", 2)
    path = tmp_path / "chats.jsonl"
    path.write_text((json.dumps({"messages": CHAT, "tools": [SEARCH]}) + "\n") * 5)
    args: dict[str, Any] = {
        "chat_format": FAMILIES[name].format,
        "max_length": 4096,
        "overlong": "drop",
        "end_of_turn": None,
    }
    one, _ = tokenize_file(path, tok, **args)
    two, _ = tokenize_file(path, tok, workers=2, **args)
    assert two == one and len(one) == 5
    assert [tok.decode(s) for s in _spans(one[0].input_ids, one[0].loss_mask)] == TURNS[name]
