"""The one decision of a run's chat format (gateway/calls/chat_format.py), against the config and
tokenizer_config files of real models (tests/support/model_configs: the fields the detector
reads, hand-written, no weights), and where a run and `lockgate sft` take it from."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.errors import ConfigError
from lockgate.coordinator.launch.parts import chat_format_of, gateway_config_of
from lockgate.gateway.calls.chat_format import (
    GENERIC,
    ChatFormatError,
    bridges_turns,
    detect_chat_format,
    known_formats,
    resolve_chat_format,
)
from lockgate.gateway.calls.rendering import ChatRenderer

CONFIGS = Path(__file__).resolve().parents[2] / "support" / "model_configs"

# Fixture folder -> the format `renderers` has for that checkpoint (docs/models.md names them).
REAL_MODELS = {
    "qwen3-0.6b": "qwen3",
    "llama-3.2-1b-instruct": "llama-3",
    "gpt-oss-20b": "gpt-oss",
    "deepseek-r1": "deepseek-r1",
    "deepseek-v3": "deepseek-v3",
    "glm-4.5-air": "glm-4.5",
    "kimi-k2-instruct": "kimi-k2",
    "gemma-4-e2b-it": "gemma4",
    # Qwen2.5 writes Hermes tool calls and no <think>: no renderer of its own, so its template.
    "qwen2.5-7b-instruct": GENERIC,
    # Gemma 3's turn markers are no `renderers` format (Gemma 4's are): its own template serves.
    "gemma-3-1b-it": GENERIC,
}


@pytest.mark.parametrize(("folder", "expected"), sorted(REAL_MODELS.items()))
def test_auto_detects_each_real_models_format_from_its_files(folder: str, expected: str) -> None:
    assert detect_chat_format(CONFIGS / folder) == expected


def test_a_hub_cache_snapshot_is_known_by_its_checkpoint_name() -> None:
    # No template at all: renderers' own table of checkpoints decides from the cache path.
    snapshot = next((CONFIGS / "hub-cache").glob("models--*/snapshots/*"))
    assert detect_chat_format(snapshot) == "nemotron-3"


def test_the_name_the_files_were_saved_under_decides_before_the_template(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"_name_or_path": "openai/gpt-oss-20b"}')
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "<|im_start|>{{ x }}"}')
    assert detect_chat_format(tmp_path) == "gpt-oss"


def test_a_template_that_fits_several_formats_is_one_line_naming_them() -> None:
    with pytest.raises(ChatFormatError) as caught:
        detect_chat_format(CONFIGS / "glm-5")
    message = str(caught.value)
    assert "\n" not in message
    assert "glm-5, glm-5.1, glm-5.3" in message and "model.chat_format" in message


def test_a_model_without_template_or_known_name_is_one_line_naming_the_choices() -> None:
    with pytest.raises(ChatFormatError) as caught:
        detect_chat_format(CONFIGS / "no-template")
    message = str(caught.value)
    assert "\n" not in message and "no chat template" in message
    assert "llama-3, " in message and "qwen3" in message and "auto" not in message.split(":")[-1]


def test_a_named_format_is_taken_as_given_and_an_unknown_one_refused() -> None:
    # A fine-tune whose template was edited: the run names its format.
    assert resolve_chat_format("llama-3", CONFIGS / "no-template") == "llama-3"
    assert resolve_chat_format("auto", CONFIGS / "llama-3.2-1b-instruct") == "llama-3"
    with pytest.raises(ChatFormatError, match="unknown chat format 'llama3'; choose auto or"):
        resolve_chat_format("llama3", CONFIGS / "llama-3.2-1b-instruct")


def test_known_formats_are_renderers_names_without_auto_or_custom() -> None:
    names = known_formats()
    assert {"qwen3", "llama-3", "gpt-oss", "deepseek-r1", "glm-4.5", "gemma4", GENERIC} <= set(
        names
    )
    assert "auto" not in names and "custom" not in names
    assert bridges_turns("qwen3") and not bridges_turns(GENERIC)


def _run_config(tmp_path: Path, chat_format: str) -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": "t",
            "run_dir": str(tmp_path / "run"),
            "model": {"chat_format": chat_format},
            "environment": {"path": "env.py"},
        }
    )


def test_a_runs_gateway_renders_in_the_format_the_run_decided(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    auto = gateway_config_of(_run_config(tmp_path, "auto"), tiny_model_dir, [], tmp_path, "x" * 8)
    assert auto.renderer == "qwen3"
    named = gateway_config_of(
        _run_config(tmp_path, "default"), tiny_model_dir, [], tmp_path, "x" * 8
    )
    assert named.renderer == GENERIC
    with pytest.raises(ConfigError, match=r"^model\.chat_format: cannot detect"):
        chat_format_of(_run_config(tmp_path, "auto"), CONFIGS / "no-template")


def test_the_generic_renderer_serves_with_a_warning_and_parses_hermes_calls(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        renderer = ChatRenderer(tiny_model_dir, GENERIC)
    assert any("counted as a split" in r.getMessage() for r in caplog.records)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    ids = renderer.tokenizer.encode(call + "<|im_end|>", add_special_tokens=False)
    parsed = renderer.parse_completion(ids, [], None)
    assert parsed.has_tool_calls
    assert parsed.message.tool_calls is not None
    assert parsed.message.tool_calls[0].function.name == "add"


# What each family's model writes when it calls add(a=2, b=3): the format's own call syntax,
# after the generation prompt its renderer ends with, through the token that ends the turn.
_DS = {
    k: f"<\uff5c{k.replace(' ', chr(0x2581))}\uff5c>"
    for k in (
        "tool calls begin",
        "tool calls end",
        "tool call begin",
        "tool call end",
        "tool sep",
        "end of sentence",
    )
}
CALL_TEXT = {
    "qwen3": '<think>\n\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}'
    "\n</tool_call><|im_end|>",
    "llama-3": '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>',
    "deepseek-r1": "Adding.\n</think>\n\n"
    + _DS["tool calls begin"]
    + _DS["tool call begin"]
    + "function"
    + _DS["tool sep"]
    + 'add\n```json\n{"a": 2, "b": 3}\n```'
    + _DS["tool call end"]
    + _DS["tool calls end"]
    + _DS["end of sentence"],
    "glm-4.5": "\n<think></think>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>"
    "\n<arg_key>b</arg_key>\n<arg_value>3</arg_value>\n</tool_call><|observation|>",
    # Kimi-K2 names the tool in the call's id, functions.NAME:INDEX.
    "kimi-k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0"
    '<|tool_call_argument_begin|>{"a": 2, "b": 3}<|tool_call_end|><|tool_calls_section_end|>'
    "<|im_end|>",
    "default": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
}
ADD_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


@pytest.mark.parametrize("name", sorted(CALL_TEXT))
def test_each_formats_tool_call_parses_and_the_tool_turn_bridges_onto_its_tokens(
    name: str,
) -> None:
    from lockgate.gateway.calls.rendering import PreviousTurn, token_array
    from lockgate.gateway.schema import ChatMessage, ToolSpec
    from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec

    renderer = ChatRenderer(ensure_tiny_model(spec=family_spec(name)), name)
    tools = [ToolSpec.model_validate(t) for t in ADD_TOOL]
    asked = [ChatMessage.model_validate({"role": "user", "content": "What is 2 + 3?"})]
    prompt = renderer.render_prompt(asked, tools, None).prompt_ids
    completion = renderer.tokenizer.encode(CALL_TEXT[name], add_special_tokens=False)
    assert completion[-1] in renderer.stop_token_ids
    parsed = renderer.parse_completion(completion, prompt, tools)
    (call,) = parsed.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    reply = parsed.message.model_dump(exclude_none=True)
    history = [
        *asked,
        ChatMessage.model_validate(reply),
        ChatMessage.model_validate({"role": "tool", "tool_call_id": call.id, "content": "5"}),
    ]
    previous = PreviousTurn(
        messages=[m.model_dump(exclude_none=True) for m in asked],
        tools=[t.model_dump(exclude_none=True) for t in tools],
        prompt_ids=prompt,
        completion_ids=token_array(completion),
    )
    nxt = renderer.render_prompt(history, tools, previous)
    # Bridged: the next prompt is the previous call's exact tokens, extended (0 splits); only
    # the generic template re-renders, and the gateway counts that.
    assert nxt.extends_previous is bridges_turns(name)
    if bridges_turns(name):
        assert nxt.prompt_ids[: len(prompt) + len(completion)].tolist() == [
            *prompt.tolist(),
            *completion,
        ]


def test_messages_a_format_cannot_write_are_a_400_naming_it() -> None:
    from lockgate.gateway.errors import GatewayError
    from lockgate.gateway.schema import ChatMessage
    from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec

    renderer = ChatRenderer(ensure_tiny_model(spec=family_spec("llama-3")), "llama-3")
    call = {"type": "function", "function": {"name": "add", "arguments": "{}"}}
    two_calls = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {**call, "id": "c1"},
            {**call, "id": "c2"},
        ],
    }
    messages = [
        ChatMessage.model_validate(m)
        for m in (
            {"role": "user", "content": "hi"},
            two_calls,
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
            {"role": "tool", "tool_call_id": "c2", "content": "2"},
        )
    ]
    with pytest.raises(GatewayError) as caught:
        renderer.render_prompt(messages, None, None)
    assert caught.value.status_code == 400
    assert "'llama-3' chat format cannot render these messages" in str(caught.value)


@pytest.mark.parametrize("name", ["gpt-oss", "kimi-k2"])
def test_a_tool_result_without_a_name_is_authored_by_its_calls_function(name: str) -> None:
    """OpenAI clients send a tool result with its call's id and no `name`; gpt-oss heads a
    result `functions.<name>` and Kimi-K2 with the name too, so the gateway fills it in."""
    from lockgate.gateway.schema import ChatMessage
    from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec

    if name == "gpt-oss":
        from lockgate.trainer.tiny_models.harmony_vocab import require_o200k

        require_o200k()
    renderer = ChatRenderer(ensure_tiny_model(spec=family_spec(name)), name)
    call = {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    messages = [
        ChatMessage.model_validate(m)
        for m in (
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_7", "content": "5"},
        )
    ]
    text = renderer.tokenizer.decode(renderer.render_prompt(messages, None, None).prompt_ids)
    named = [*messages[:2], messages[2].model_copy(update={"name": "add"})]
    same = renderer.tokenizer.decode(renderer.render_prompt(named, None, None).prompt_ids)
    assert text == same
    assert "unknown" not in text and "add" in text.split("What is 2 + 3?")[1]
