"""The bounds that make a forced tool call fit its token budget (gateway/calls/forced_budget.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from lockgate.gateway.calls.constraints import tool_call_constraint
from lockgate.gateway.calls.forced_budget import (
    CallDoesNotFit,
    bound_strings,
    most_tokens,
    plan_forced_budget,
    shortest_instance,
)
from lockgate.gateway.schema import ToolSpec

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
BEGIN, END = '<tool_call>\n{"name": "get_weather", "arguments": ', "}\n</tool_call>"


def _words(text: str) -> int:
    """A stand-in tokenizer: a token per whitespace-separated word."""
    return len(text.split())


# BEGIN's 4 words, the shortest arguments '{"city":""}' (1), END's 2 and the stop.
FLOOR = 4 + 1 + 2 + 1
# The JSON places where whitespace may go: inside the braces, either side of the colon.
PLACES = 4


def test_a_tight_budget_shares_what_the_call_leaves_between_thinking_and_the_string() -> None:
    calls = {"get_weather": (BEGIN, CITY, END)}
    plan = plan_forced_budget(48, calls, _words, may_think=True, whitespace=4)
    assert plan.whitespace == 1  # 4 a place: 16 of the 40 tokens the call leaves
    slack = 48 - FLOOR - PLACES
    assert plan.think_tokens == (slack - 4) // 2
    assert plan.string_chars == slack - 4 - plan.think_tokens
    assert plan.one_call  # no room for a second call
    # Never more than the budget: the call, the thinking and its markers, the string.
    assert FLOOR + PLACES + 4 + plan.think_tokens + plan.string_chars <= 48


def test_an_ample_budget_keeps_the_whitespace_and_allows_parallel_calls() -> None:
    plan = plan_forced_budget(
        4096, {"get_weather": (BEGIN, CITY, END)}, _words, may_think=True, whitespace=4
    )
    assert plan.whitespace == 4 and not plan.one_call
    assert plan.think_tokens is not None and plan.think_tokens > 1900
    # Strings stay free (escapes and all): the room left after thinking is large.
    assert plan.string_chars is None


def test_without_thinking_or_strings_the_room_goes_where_it_can() -> None:
    calls = {"get_weather": (BEGIN, CITY, END)}
    plan = plan_forced_budget(48, calls, _words, may_think=False, whitespace=4)
    assert plan.think_tokens is None and plan.string_chars == 48 - FLOOR - PLACES
    enum_only = {**CITY, "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}
    plan = plan_forced_budget(
        48, {"get_weather": (BEGIN, enum_only, END)}, _words, may_think=True, whitespace=1
    )
    assert plan.string_chars is None
    # No string to share with: the thinking takes what the call and its markers leave.
    assert plan.think_tokens == 48 - FLOOR - PLACES - 4


def test_too_little_room_for_thinking_means_none() -> None:
    plan = plan_forced_budget(
        FLOOR + PLACES + 3,
        {"get_weather": (BEGIN, CITY, END)},
        _words,
        may_think=True,
        whitespace=4,
    )
    assert plan.think_tokens is None and plan.string_chars == 3


def test_with_no_room_left_a_string_may_only_be_empty() -> None:
    """Every string's share comes out of what the call leaves, never a token more."""
    two = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city", "unit"],
    }
    # 8 places: inside the 2 braces, either side of the 2 colons and the comma.
    needed = FLOOR + 8
    plan = plan_forced_budget(
        needed + 1, {"f": (BEGIN, two, END)}, _words, may_think=False, whitespace=4
    )
    assert plan.string_chars == 0
    assert (
        plan_forced_budget(
            needed + 4, {"f": (BEGIN, two, END)}, _words, may_think=False, whitespace=4
        ).string_chars
        == 2
    )


def test_a_budget_below_the_shortest_call_is_refused_naming_the_tool() -> None:
    calls = {"get_weather": (BEGIN, CITY, END), "noop": ("<tool_call> noop", {}, END)}
    with pytest.raises(CallDoesNotFit, match="'get_weather'") as info:
        plan_forced_budget(FLOOR + PLACES - 1, calls, _words, may_think=True, whitespace=4)
    assert info.value.needed == FLOOR + PLACES
    assert f"its shortest form takes {FLOOR + PLACES} tokens" in str(info.value)


def test_free_strings_are_bounded_wherever_they_are_and_tighter_bounds_kept() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "q": {"type": "string"},
            "short": {"type": "string", "maxLength": 3, "minLength": 2},
            "kind": {"type": "string", "enum": ["a", "b"]},
            "date": {"type": "string", "format": "date"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "opt": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "n": {"type": "integer"},
        },
        "$defs": {"Name": {"type": ["string", "null"]}},
    }
    out = bound_strings(schema, 10)
    props = out["properties"]
    # No control characters (the call stays valid JSON), and at most 10 UTF-8 bytes: 10 ASCII
    # characters, or 2 of any kind (one takes up to 4 bytes, each maybe a token of its own).
    bounded = "^(?:[\\x20-\\x7f]{0,10}|[^\\x00-\\x1f]{0,2})$"
    assert props["q"] == {"type": "string", "pattern": bounded}
    assert props["short"]["pattern"] == "^(?:[\\x20-\\x7f]{2,3}|[^\\x00-\\x1f]{2,2})$"
    assert "pattern" not in props["kind"] and "pattern" not in props["date"]
    assert props["tags"]["items"]["pattern"] == bounded
    assert props["opt"]["anyOf"][0]["pattern"] == bounded
    assert props["n"] == {"type": "integer"}
    assert out["$defs"]["Name"]["pattern"] == bounded
    assert "pattern" not in schema["properties"]["q"]  # the tool's own schema is untouched
    # A minimum length over the bound is cut to it, so the schema stays satisfiable (in ASCII:
    # 10 characters of any kind could take 40 tokens).
    assert bound_strings({"type": "string", "minLength": 50}, 10)["pattern"] == (
        "^[\\x20-\\x7f]{10,10}$"
    )
    # Too tight for a character that may take 4 tokens: ASCII only.
    assert bound_strings({"type": "string"}, 3)["pattern"] == "^[\\x20-\\x7f]{0,3}$"


def test_the_worst_case_counts_markers_as_one_token_and_text_a_token_a_byte() -> None:
    special = {"<tool_call>": 1012, "</tool_call>": 1013}
    assert most_tokens('<tool_call>\n{"a": ', special) == 1 + 7
    assert most_tokens("}\n</tool_call>", special) == 3
    # A byte-level tokenizer may spell a character outside ASCII a byte a token.
    assert most_tokens('{"é": "中"}', special) == 8 + 2 + 3


@pytest.mark.parametrize(
    ("schema", "shortest"),
    [
        (CITY, {"city": ""}),
        ({"type": "object", "properties": {"a": {"type": "integer"}}}, {}),
        ({"properties": {"b": {"type": "boolean"}}, "required": ["b"]}, {"b": False}),
        ({"type": "string", "enum": ["London", "Rome"]}, "Rome"),
        ({"anyOf": [{"type": "string", "minLength": 4}, {"type": "null"}]}, None),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [0, 0]),
        ({"type": "number", "minimum": 5}, 5),
        ({"const": "x"}, "x"),
        ({"type": ["null", "string"]}, None),
        ("not a schema", {}),
    ],
)
def test_the_shortest_instance_satisfies_the_schema_briefly(schema: Any, shortest: Any) -> None:
    assert shortest_instance(schema) == shortest
    json.dumps(shortest_instance(schema))  # always JSON


TWO = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city", "unit"],
}


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _forced(tok: Any, schema: Any, max_tokens: int) -> dict[str, Any]:
    """The constraint the gateway sends for a forced call to `get_weather`."""
    tools = [
        ToolSpec.model_validate(
            {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
        )
    ]
    constraint = tool_call_constraint(
        "qwen3",
        tools,
        "required",
        reasoning="auto",
        parallel_tool_calls=None,
        special_tokens=dict(tok.get_added_vocab()),
        max_tokens=max_tokens,
    )
    assert constraint is not None
    return constraint


def _compiled(tok: Any, constraint: dict[str, Any]) -> tuple[Any, Any, list[int]]:
    """The constraint compiled by xgrammar as vLLM does: its grammar, tokenizer info, stops."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    grammar = xgr.GrammarCompiler(info).compile_structural_tag(constraint["structural_tag"])
    stops = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    return grammar, info, stops


def _shortest_served(tok: Any, schema: Any) -> int:
    """The smallest budget the gateway serves a forced call to the tool in."""
    from lockgate.gateway.errors import GatewayError

    with pytest.raises(GatewayError) as info:
        _forced(tok, schema, 1)
    return int(str(info.value).split("takes ")[1].split(" ")[0])


@pytest.mark.parametrize("schema", [CITY, TWO], ids=["one-string", "two-strings"])
def test_any_path_the_grammar_allows_closes_the_call_within_the_smallest_budget(
    tok: Any, schema: Any
) -> None:
    """Random walks through the compiled grammar at the smallest budget served, half of them
    spelling everything in the shortest tokens allowed (the longest spelling): every one
    ends, within the budget."""
    import xgrammar as xgr

    budget = _shortest_served(tok, schema)
    grammar, info, stops = _compiled(tok, _forced(tok, schema, budget))
    rng = random.Random(43)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    lengths = []
    for walk in range(60):
        matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=stops)
        ids: list[int] = []
        while not matcher.is_terminated() and len(ids) <= budget:
            matcher.fill_next_token_bitmask(mask)
            allowed = _allowed(mask, info.vocab_size)
            if walk % 2 and rng.random() < 0.8:
                text = [a for a in allowed if a not in stops] or allowed
                shortest = min(len(tok.convert_ids_to_tokens(a)) for a in text)
                allowed = [a for a in text if len(tok.convert_ids_to_tokens(a)) == shortest]
            token = rng.choice(allowed)
            assert matcher.accept_token(token)  # what the mask allows, the matcher takes
            ids.append(token)
        assert matcher.is_terminated() and len(ids) <= budget, tok.decode(ids)
        assert tok.convert_tokens_to_ids("<tool_call>") in ids
        lengths.append(len(ids))
    print(f"\n60 walks at max_tokens {budget}, {max(lengths)} tokens at most")


def test_the_bounded_grammar_admits_a_call_within_budget_and_nothing_past_it(tok: Any) -> None:
    """The constraint the gateway sends, compiled by xgrammar as vLLM does, fed token ids."""
    import xgrammar as xgr

    constraint = _forced(tok, CITY, 96)
    grammar, info, stops = _compiled(tok, constraint)

    def accepts(*pieces: str) -> tuple[bool, xgr.GrammarMatcher]:
        """Each piece tokenized on its own."""
        matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=stops)
        ids = [t for p in pieces for t in tok.encode(p, add_special_tokens=False)]
        return all(matcher.accept_token(t) for t in ids), matcher

    begin, end = BEGIN, END
    tag = json.loads(constraint["structural_tag"])
    pattern = next(n for n in _nodes(tag) if "pattern" in n)["pattern"]
    longest = int(pattern.split(",")[1].split("}")[0])  # the string's share: ASCII characters
    ok, matcher = accepts("<think>short</think>\n\n", begin, '{"city": "Paris"}', end)
    assert ok
    # After the call, only the end of the turn: no free text, no second call.
    assert matcher.accept_token(stops[1]) and matcher.is_terminated()
    assert accepts(begin, '{"city": "Paris"}', end)[0]  # thinking is optional
    assert not accepts(begin, '{"city": "P\x03"}', end)[0]  # raw control characters: bad JSON
    assert not accepts(begin, '{"city": "%s"}' % ("x" * 40), end)[0]  # past the strings' share
    assert accepts(begin, '{"city": "%s"}' % ("x" * longest), end)[0]
    # The share is in bytes: a character outside ASCII may take a token per byte (the random
    # model spelt 3- and 4-byte ones so, and ran past the budget), so it counts 4.
    assert accepts(begin, '{"city": "%s"}' % ("中" * (longest // 4)), end)[0]
    assert not accepts(begin, '{"city": "%s"}' % ("中" * (longest // 4 + 1)), end)[0]
    assert not accepts(begin, '{"city": "%s"}' % ("x" * (longest - 1) + "中"), end)[0]
    # The thinking's share: once spent, the grammar allows only its end.
    think = next(n for n in _nodes(tag) if n.get("type") == "any_text")["max_tokens"]
    matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=stops)
    word = tok.encode(" word", add_special_tokens=False)
    assert len(word) == 1
    assert all(
        matcher.accept_token(t) for t in [tok.convert_tokens_to_ids("<think>")] + word * think
    )
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    assert _allowed(mask, info.vocab_size) == [tok.convert_tokens_to_ids("</think>")]
    # Thinking and the string's shares, and the call's reserve, add up within the budget.
    # The worst case: the fixed text spelt a byte a token, the markers as their tokens.
    special = dict(tok.get_added_vocab())
    fixed = sum(most_tokens(p, special) for p in (begin, '{"city":""}', end)) + 1  # + the stop
    assert fixed + PLACES + 4 + think + longest <= 96, (fixed, think, longest)
    assert think > 8 and longest > 8  # both shares are real


def _allowed(mask: Any, vocab_size: int) -> list[int]:
    return [i for i in range(vocab_size) if (int(mask[0, i // 32]) >> (i % 32)) & 1]


def _nodes(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [node, *(n for v in node.values() for n in _nodes(v))]
    if isinstance(node, list):
        return [n for v in node for n in _nodes(v)]
    return []
