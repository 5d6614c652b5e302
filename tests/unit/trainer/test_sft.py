"""`lockgate sft`'s pure parts: the assistant-only mask token by token, and the step plan (real
runs: tests/integration/test_sft.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lockgate.coordinator.config import read_config_file
from lockgate.trainer.sft import data as sft_data
from lockgate.trainer.sft.config import SFTConfig
from lockgate.trainer.sft.data import (
    ChatTokenizer,
    TemplateMismatch,
    end_of_turn_id,
    load_tokenizer,
    plan_steps,
    render_with_mask,
    tokenize_file,
)
from tests.integration.test_sft import CHATS, REPLAYED, SEARCH, _call, _write_jsonl

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> ChatTokenizer:
    return load_tokenizer(tiny_model_dir)


def test_the_mask_is_one_exactly_on_what_each_assistant_turn_generates(
    tokenizer: ChatTokenizer,
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "look it up",
            "tool_calls": [
                _call(1, "search", '{"query": "France capital"}'),
                _call(2, "search", {"query": "Paris"}),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Paris is the capital."},
        {"role": "tool", "tool_call_id": "c2", "content": "Paris: 2.1M people."},
        {"role": "assistant", "content": "Paris."},
    ]
    ids, mask = render_with_mask(tokenizer, messages, [SEARCH], end_of_turn_id(tokenizer, None))

    turn_1 = (
        "<think>\nlook it up\n</think>\n\n"
        '<tool_call>\n{"name": "search", "arguments": {"query": "France capital"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "Paris"}}\n</tool_call><|im_end|>'
    )
    turn_2 = "<think>\n\n</think>\n\nParis.<|im_end|>"
    system = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        f"<tools></tools> XML tags:\n<tools>\n{json.dumps(SEARCH)}\n</tools>\n\nFor each "
        "function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    )
    pieces = [
        (system + "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n", 0),
        (turn_1, 1),
        (
            "\n<|im_start|>user\n<tool_response>\nParis is the capital.\n</tool_response>\n"
            "<tool_response>\nParis: 2.1M people.\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n",
            0,
        ),
        (turn_2, 1),
        ("\n", 0),
    ]
    # Every token's text, in order, must tile the hand-written pieces; its mask is its piece's.
    tokens = [tokenizer.decode([t]) for t in ids]
    assert "".join(tokens) == "".join(text for text, _ in pieces)
    expected, at = [], 0
    bounds = []
    for text, trained in pieces:
        bounds.append((at, at + len(text), trained))
        at += len(text)
    at = 0
    for token in tokens:
        (trained,) = [m for lo, hi, m in bounds if lo <= at and at + len(token) <= hi]
        expected.append(trained)
        at += len(token)
    assert mask == expected
    # Both turns end on the trained end-of-turn token; the template's newline after it is not.
    ends = [t for t in range(len(ids) - 1) if mask[t] and not mask[t + 1]]
    assert [tokens[t] for t in ends] == ["<|im_end|>", "<|im_end|>"]
    assert [tokens[t + 1] for t in ends] == ["\n", "\n"]


def test_tool_call_arguments_as_a_json_string_or_an_object_train_the_same_tokens(
    tokenizer: ChatTokenizer,
) -> None:
    as_string = CHATS[0]["messages"]
    as_object = json.loads(json.dumps(as_string))
    call = as_object[2]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])
    eot = end_of_turn_id(tokenizer, None)
    a = render_with_mask(tokenizer, as_string, [SEARCH], eot)
    b = render_with_mask(tokenizer, as_object, [SEARCH], eot)
    assert a == b


def test_a_template_that_re_renders_history_is_an_error_naming_the_line(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    # Qwen3's own format is masked by its renderer; its template alone cannot mask this chat.
    path = _write_jsonl(tmp_path / "chats.jsonl", [CHATS[3], REPLAYED])
    with pytest.raises(TemplateMismatch, match=r"chats\.jsonl line 2: message 1 \(assistant\)"):
        tokenize_file(
            path,
            tokenizer,
            chat_format="default",
            max_length=512,
            overlong="drop",
            end_of_turn=None,
        )


def test_forked_workers_render_what_one_process_renders_in_file_order(
    tokenizer: ChatTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks of two lines over two workers, whatever the file's length.
    monkeypatch.setattr(sft_data, "_PARALLEL_FROM", 1)
    monkeypatch.setattr(sft_data, "_CHUNK", 2)
    path = _write_jsonl(tmp_path / "chats.jsonl", CHATS * 3)
    args: dict[str, Any] = {
        "chat_format": "default",  # the template's prefix renders, which can fail a line
        "max_length": 4096,
        "overlong": "drop",
        "end_of_turn": None,
    }
    one, one_stats = tokenize_file(path, tokenizer, **args)
    two, two_stats = tokenize_file(path, tokenizer, workers=2, **args)
    assert two == one and two_stats == one_stats
    assert [e.line for e in two] == list(range(1, 3 * len(CHATS) + 1))
    # A worker's error reaches the caller as it is, naming its line.
    bad = _write_jsonl(tmp_path / "bad.jsonl", [*CHATS, REPLAYED])
    with pytest.raises(TemplateMismatch, match=rf"bad\.jsonl line {len(CHATS) + 1}: message 1"):
        tokenize_file(bad, tokenizer, workers=2, **args)


def test_overlong_chats_are_truncated_or_dropped_and_counted(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    path = _write_jsonl(tmp_path / "chats.jsonl", CHATS)
    args: dict[str, Any] = {"chat_format": "qwen3", "end_of_turn": None}
    full, _ = tokenize_file(path, tokenizer, max_length=4096, overlong="drop", **args)
    # Two tokens short of the shortest tool chat: all four lose their answer's end, the two
    # plain chats fit.
    limit = min(len(e.input_ids) for e in full if len(e.input_ids) > 100) - 2
    cut, stats = tokenize_file(path, tokenizer, max_length=limit, overlong="truncate", **args)
    assert (stats.truncated, stats.dropped_overlong, stats.examples) == (4, 0, 6)
    for e, f in zip(cut, full, strict=True):
        n = min(limit, len(f.input_ids))
        assert (e.input_ids, e.loss_mask) == (f.input_ids[:n], f.loss_mask[:n])
    kept, stats = tokenize_file(path, tokenizer, max_length=limit, overlong="drop", **args)
    assert (stats.truncated, stats.dropped_overlong) == (0, 4)
    assert [e.line for e in kept] == [4, 6]


def test_the_step_plan_is_a_seeded_shuffle_per_epoch_with_conversation_or_token_batches() -> None:
    lengths = [5, 7, 3, 9, 4, 6, 8]
    plan = plan_steps(
        lengths, batch_size=3, batch_unit="conversations", epochs=2, shuffle=True, seed=1
    )
    assert [len(s.indices) for s in plan] == [3, 3, 1, 3, 3, 1]
    assert [s.epoch for s in plan] == [1, 1, 1, 2, 2, 2]
    for epoch in (1, 2):
        seen = [i for s in plan if s.epoch == epoch for i in s.indices]
        assert sorted(seen) == list(range(7))
    orders = [[i for s in plan if s.epoch == e for i in s.indices] for e in (1, 2)]
    assert orders[0] != orders[1]  # reshuffled each epoch
    again = plan_steps(
        lengths, batch_size=3, batch_unit="conversations", epochs=2, shuffle=True, seed=1
    )
    assert again == plan
    by_tokens = plan_steps(
        lengths, batch_size=12, batch_unit="tokens", epochs=1, shuffle=False, seed=0
    )
    assert [s.indices for s in by_tokens] == [[0, 1], [2, 3], [4, 5], [6]]


def test_the_shipped_example_parses_and_its_chats_render(tokenizer: ChatTokenizer) -> None:
    path = ROOT / "examples/sft/config.yaml"
    config = SFTConfig.model_validate(read_config_file(path, ["loop.epochs=2"]))
    assert config.loop.epochs == 2 and config.model.path is None
    data = config.resolved(path.parent, Path("unused")).data
    examples, stats = tokenize_file(
        data.path,
        tokenizer,
        chat_format="qwen3",
        max_length=data.max_length,
        overlong="drop",
        end_of_turn=None,
    )
    assert stats.examples == stats.conversations == len(examples) > 0
