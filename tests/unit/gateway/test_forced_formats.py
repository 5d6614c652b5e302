"""Forced tool calls in every constrained chat format (gateway/calls/forced_formats.py): the
grammar the gateway sends, compiled by xgrammar as vLLM compiles it on the format's tiny model,
admits the call exactly as the format's renderer writes it, and any path through it closes within
the budget as a call the format's parser reads back (issue 42). Formats left out are a 400."""

from __future__ import annotations

import random
from functools import cache
from typing import Any

import numpy as np
import pytest
import renderers
from transformers import AutoTokenizer

from lockgate.gateway.calls.constraints import tool_call_constraint
from lockgate.gateway.calls.forced_formats import FORCED_FORMATS
from lockgate.gateway.errors import GatewayError
from lockgate.gateway.schema import NamedToolChoice, ToolSpec
from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec
from lockgate.trainer.tiny_models.harmony_vocab import require_o200k

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
TOOLS = [ToolSpec.model_validate(t) for t in (WEATHER, SEARCH)]
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@cache
def _format(name: str) -> tuple[Any, renderers.Renderer]:
    if name == "gpt-oss":
        require_o200k()  # harmony's vocabulary, from setup's copy
    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_model(spec=family_spec(name))))
    return tok, renderers.create_renderer(tok, renderers.config_from_name(name))


def _constraint(
    name: str, choice: Any, max_tokens: int, reasoning: str, earlier_calls: int = 0
) -> dict[str, Any]:
    tok, _ = _format(name)
    out = tool_call_constraint(
        name,
        TOOLS,
        choice,
        reasoning=reasoning,  # type: ignore[arg-type]
        parallel_tool_calls=None,
        special_tokens=dict(tok.get_added_vocab()),
        max_tokens=max_tokens,
        earlier_calls=earlier_calls,
    )
    assert out is not None
    return out


def _matcher(name: str, constraint: dict[str, Any]) -> tuple[Any, Any, Any]:
    """A matcher of the constraint compiled as vLLM compiles it, its vocabulary, and the stop
    tokens the sampler may pick (vLLM's stops: the format's and the model's end-of-text, less
    those the constraint biases away)."""
    import xgrammar as xgr

    tok, renderer = _format(name)
    info = _tokenizer_info(name)
    grammar = _compiled(name, constraint["structured_outputs"]["structural_tag"])
    biased = _biased(constraint)
    stops = {*renderer.get_stop_token_ids(), tok.eos_token_id, *biased} - {None}
    matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=sorted(stops))
    return matcher, info, sorted(stops - biased)


@cache
def _tokenizer_info(name: str) -> Any:
    import xgrammar as xgr

    tok, _ = _format(name)
    return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))


@cache
def _compiled(name: str, structural_tag: str) -> Any:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(_tokenizer_info(name), cache_enabled=False)
    return compiler.compile_structural_tag(structural_tag)


def _allowed(mask: Any, vocab_size: int, biased: set[int]) -> Any:
    """The ids a token bitmask allows (bit i % 32 of word i // 32), less the biased ones."""
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
    bits[list(biased)] = 0
    return np.flatnonzero(bits)


@cache
def _token_lengths(name: str) -> Any:
    """Each token's length as the tokenizer spells it, by id."""
    tok, _ = _format(name)
    return np.array([len(t or "") for t in tok.convert_ids_to_tokens(list(range(len(tok))))])


def _biased(constraint: dict[str, Any]) -> set[int]:
    """The tokens the constraint's `logit_bias` keeps out (vLLM's strongest bias)."""
    bias = constraint.get("logit_bias", {})
    assert all(b == -100.0 for b in bias.values())
    return {int(t) for t in bias}


def _shortest_served(name: str, choice: Any) -> int:
    return _shortest_served_after(name, choice, 0)


def _written_call(name: str) -> list[int]:
    """A call to get_weather as the format's renderer writes an assistant turn holding it (the
    turn's tokens after the prompt, through its closing token)."""
    _, renderer = _format(name)
    call = {"type": "function", "id": CALL_IDS.get(name, "c1"), "function": {"name": "get_weather"}}
    call["function"]["arguments"] = {"city": "Paris", "unit": "C"}  # type: ignore[index]
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    if name == "gpt-oss":
        # Harmony's loss mask leaves out each message's header, which the model writes too
        # after the analysis message: the call's message whole, from its <|start|>.
        tok, _ = _format(name)
        ids = renderer.render_ids([*ASK, turn], tools=[WEATHER, SEARCH])  # type: ignore[list-item]
        start = tok.convert_tokens_to_ids("<|start|>")
        return ids[len(ids) - 1 - ids[::-1].index(start) :]
    if name == "glm-4.5":
        # Its loss mask leaves out the newline the turn opens with, and its template closes a
        # call's turn with no token of its own: the turn after the prompt, then the stop the
        # model ends a call with (the tool's answer comes as an observation).
        tok, _ = _format(name)
        ids = renderer.render_ids([*ASK, turn], tools=[WEATHER, SEARCH])  # type: ignore[list-item]
        prompt = renderer.render_ids(ASK, tools=[WEATHER, SEARCH], add_generation_prompt=True)  # type: ignore[arg-type]
        assert ids[: len(prompt)] == prompt
        return ids[len(prompt) :] + [tok.convert_tokens_to_ids("<|observation|>")]
    sample = renderers.build_training_sample(renderer, [*ASK, turn], tools=[WEATHER, SEARCH])  # type: ignore[list-item]
    return [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]


# A call's id where the format writes it: Kimi-K2 numbers a conversation's calls from 0.
CALL_IDS = {"kimi-k2": "functions.get_weather:0"}
# What the model writes to close the block its prompt opened, before the call.
CLOSES_THE_OPEN_BLOCK = {"deepseek-r1": "</think>", "gpt-oss": "<|end|>"}


# Llama 3's parser keeps only the text after the last <|end_header_id|> of a completion.
PARSER_CUTS = {"llama-3": "<|end_header_id|>"}
CONSTRAINED = sorted(set(FORCED_FORMATS) - {"qwen3"})  # Qwen3's: test_forced_budget.py


@pytest.mark.parametrize("name", CONSTRAINED)
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_the_grammar_admits_the_call_as_the_format_writes_it(name: str, choice: Any) -> None:
    written = _written_call(name)
    prefix = []
    if FORCED_FORMATS[name].reasoning == "prompt_opened":
        tok, _ = _format(name)
        prefix = tok.encode(CLOSES_THE_OPEN_BLOCK[name], add_special_tokens=False)
    matcher, _, _ = _matcher(name, _constraint(name, choice, 96, "disabled"))
    for token in prefix + written[:-1]:
        assert matcher.accept_token(token), _format(name)[0].decode([token])
    assert matcher.accept_token(written[-1]) and matcher.is_terminated()


@pytest.mark.parametrize("name", CONSTRAINED)
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
@pytest.mark.parametrize("reasoning", ["auto", "disabled"])
def test_any_path_closes_within_the_budget_as_a_call_the_parser_reads(
    name: str, choice: Any, reasoning: str
) -> None:
    """Random walks through the grammar at the smallest budget served and at 96, half of them
    spelling everything in the shortest tokens allowed: every one ends within the budget, and
    the format's parser reads a call to an offered tool from it."""
    import xgrammar as xgr

    tok, renderer = _format(name)
    prompt = renderer.render_ids(ASK, tools=[WEATHER, SEARCH], add_generation_prompt=True)  # type: ignore[arg-type]
    rng = random.Random(42)
    for budget in (_shortest_served(name, choice), 96):
        constraint = _constraint(name, choice, budget, reasoning)
        biased = _biased(constraint)
        for walk in range(10):
            matcher, info, stops = _matcher(name, constraint)
            mask = xgr.allocate_token_bitmask(1, info.vocab_size)
            ids: list[int] = []
            while not matcher.is_terminated() and len(ids) <= budget:
                matcher.fill_next_token_bitmask(mask)
                allowed = _allowed(mask, info.vocab_size, biased)
                if walk % 2 and rng.random() < 0.8:
                    text = allowed[~np.isin(allowed, stops)]
                    text = text if len(text) else allowed
                    lengths = _token_lengths(name)[text]
                    allowed = text[lengths == lengths.min()]
                token = int(allowed[rng.randrange(len(allowed))])
                assert matcher.accept_token(token)
                ids.append(token)
            assert matcher.is_terminated() and len(ids) <= budget, (budget, tok.decode(ids))
            if PARSER_CUTS.get(name) in tok.convert_ids_to_tokens(ids):
                continue  # the grammar lets a string hold it; docs/models.md, "Not done yet"
            parsed = renderer.parse_response(ids, tools=[WEATHER, SEARCH], prompt_ids=prompt)  # type: ignore[arg-type]
            names = [c.name for c in parsed.tool_calls if c.status == "ok"]
            assert names and set(names) <= {"get_weather", "search"}, tok.decode(ids)
            if choice is NAMED:
                assert names == ["get_weather"]


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_kimi_k2_call_carries_the_index_of_the_conversations_next_call(choice: Any) -> None:
    """Kimi-K2 numbers a conversation's calls (`functions.NAME:INDEX`): the index is the count
    of earlier calls, and no other, so the budget counts it exactly."""
    tok, _ = _format("kimi-k2")
    begin = tok.encode("<|tool_calls_section_begin|><|tool_call_begin|>", add_special_tokens=False)
    constraint = _constraint("kimi-k2", choice, 96, "auto", earlier_calls=3)
    for index, admitted in (("3", True), ("0", False), ("31", False), ("3 ", False)):
        matcher, _, _ = _matcher("kimi-k2", constraint)
        ids = begin + tok.encode(
            f"functions.get_weather:{index}<|tool_call_argument_begin|>", add_special_tokens=False
        )
        assert all(matcher.accept_token(t) for t in ids) is admitted, index
    # The index's digits are reserved: a later call needs a token more at most.
    assert _shortest_served("kimi-k2", choice) <= _shortest_served_after("kimi-k2", choice, 10)
    assert _shortest_served_after("kimi-k2", choice, 10) <= _shortest_served("kimi-k2", choice) + 1


def _shortest_served_after(name: str, choice: Any, earlier_calls: int) -> int:
    with pytest.raises(GatewayError) as info:
        _constraint(name, choice, 1, "auto", earlier_calls=earlier_calls)
    return int(str(info.value).split("takes ")[1].split(" ")[0])


def test_a_glm_call_writes_its_argument_markers_as_their_tokens() -> None:
    """xgrammar's `glm_xml` style would let `<arg_key>` be spelt `<`, `arg`, ...; the parser
    finds markers by their tokens, so only the token is admitted."""
    tok, _ = _format("glm-4.5")
    head = tok.encode("\n<think></think>\n<tool_call>get_weather\n", add_special_tokens=False)
    for token, admitted in (
        (tok.convert_tokens_to_ids("<arg_key>"), True),
        (tok.encode("<", add_special_tokens=False)[0], False),
    ):
        matcher, _, _ = _matcher("glm-4.5", _constraint("glm-4.5", NAMED, 96, "disabled"))
        assert all(matcher.accept_token(t) for t in head)
        assert matcher.accept_token(token) is admitted


@pytest.mark.parametrize(
    ("unit", "spelled"),
    [
        ({"type": "string", "enum": ["C"]}, "C"),
        ({"enum": ["C"]}, '"C"'),
        ({"type": "integer"}, "0"),
    ],
)
def test_a_glm_value_is_raw_text_only_where_its_parser_reads_raw_text(
    unit: dict[str, Any], spelled: str
) -> None:
    """GLM-4.5's parser reads a value raw where the parameter's type is a string and as JSON
    otherwise (an untyped enum too, though its template writes a string raw): the grammar
    writes what the parser reads, and the budget counts the same text."""
    from lockgate.gateway.calls.forced_budget import glm_xml_arguments

    schema = {"type": "object", "properties": {"unit": unit}, "required": ["unit"]}
    tool = ToolSpec.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": schema}}
    )
    tok, renderer = _format("glm-4.5")
    text = f"\n<arg_key>unit</arg_key>\n<arg_value>{spelled}</arg_value>\n"
    assert glm_xml_arguments(schema) == (text, 0)
    ids = tok.encode(f"\n<think></think>\n<tool_call>f{text}</tool_call>", add_special_tokens=False)
    constraint = tool_call_constraint(
        "glm-4.5", [tool], "required", reasoning="disabled", parallel_tool_calls=None,
        special_tokens=dict(tok.get_added_vocab()), max_tokens=96,
    )  # fmt: skip
    matcher, _, _ = _matcher("glm-4.5", constraint)
    assert all(matcher.accept_token(t) for t in ids)
    parsed = renderer.parse_response(ids, tools=[tool.model_dump(exclude_none=True)])
    assert [c.status for c in parsed.tool_calls] == ["ok"]


def test_a_gpt_oss_call_ends_on_call_and_no_other_stop() -> None:
    """The grammar cannot choose which stop token ends it, and harmony's parser reads a call
    only when `<|call|>` closes it: the constraint keeps `<|return|>` and `<|endoftext|>` out."""
    tok, _ = _format("gpt-oss")
    constraint = _constraint("gpt-oss", "required", 96, "auto")
    ids = {tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|endoftext|>")}
    assert _biased(constraint) == ids
    assert tok.convert_tokens_to_ids("<|call|>") not in _biased(constraint)
    assert "logit_bias" not in _constraint("qwen3", "required", 96, "auto")


def test_a_format_without_a_matching_tag_is_a_400_naming_it() -> None:
    with pytest.raises(GatewayError, match=r"not supported for the 'default' chat format") as e:
        tool_call_constraint(
            "default", TOOLS, "required", reasoning="auto", parallel_tool_calls=None
        )
    assert "qwen3, llama-3, deepseek-r1, gpt-oss, kimi-k2, glm-4.5" in str(e.value)
