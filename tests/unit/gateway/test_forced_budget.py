"""The bounds that make a forced tool call fit its token budget (gateway/calls/forced_budget.py)."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from lockgate.coordinator.launch.replicas import xgrammar_cache_environment
from lockgate.gateway.calls.constraints import tool_call_constraint
from lockgate.gateway.calls.forced_budget import (
    CallDoesNotFit,
    bound_strings,
    head_tokens,
    held_head,
    most_tokens,
    plan_forced_budget,
    shortest_instance,
)
from lockgate.gateway.errors import GatewayError
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


def test_a_head_held_to_tokens_counts_its_marker_its_tokens_and_its_closing_space() -> None:
    special = {"<tool_call>": 1012}
    assert held_head('\n{"a": ') == ('\n{"a":', " ")
    assert held_head("x") == ("x", "")
    # The marker, then the stand-in tokenizer's 3 words, then the closing space (a byte).
    assert head_tokens(BEGIN, special, lambda t: t.split()) == 1 + 3 + 1
    # No marker to open it: the head is characters, the worst case.
    assert head_tokens('{"a": ', special, lambda t: t.split()) == most_tokens('{"a": ', special)


def test_the_head_counts_by_its_own_counter_and_the_rest_by_the_worst_case() -> None:
    calls = {"get_weather": (BEGIN, CITY, END)}
    plan = plan_forced_budget(
        FLOOR + PLACES, calls, _words, may_think=False, whitespace=4, count_head=lambda _: 4
    )
    assert plan.string_chars == 0
    with pytest.raises(CallDoesNotFit) as info:
        plan_forced_budget(
            FLOOR + PLACES, calls, _words, may_think=False, whitespace=4, count_head=lambda _: 5
        )
    assert info.value.needed == FLOOR + PLACES + 1


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


def _forced(tok: Any, schema: Any, max_tokens: int, name: str = "get_weather") -> dict[str, Any]:
    """The constraint the gateway sends for a forced call to the tool `name`."""
    tools = [
        ToolSpec.model_validate(
            {"type": "function", "function": {"name": name, "parameters": schema}}
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
        encode=functools.partial(tok.encode, add_special_tokens=False),
    )
    assert constraint is not None
    return constraint


def _replica_compiler(tok: Any) -> tuple[Any, Any]:
    """xgrammar's compiler as a replica the launcher starts makes it, and its tokenizer info:
    vLLM's XgrammarBackend sizes the compiler's cache from VLLM_XGRAMMAR_CACHE_MB (512 unless
    set), which the launcher sets."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    megabytes = int(xgrammar_cache_environment().get("VLLM_XGRAMMAR_CACHE_MB", "512"))
    return xgr.GrammarCompiler(info, max_threads=8, cache_limit_bytes=megabytes * 2**20), info


def _compiled(
    tok: Any, constraint: dict[str, Any], compiler: tuple[Any, Any] | None = None
) -> tuple[Any, Any, list[int]]:
    """The constraint compiled by xgrammar as vLLM does: its grammar, tokenizer info, stops."""
    compile_with, info = compiler or _replica_compiler(tok)
    grammar = compile_with.compile_structural_tag(
        constraint["structured_outputs"]["structural_tag"]
    )
    stops = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    return grammar, info, stops


def _shortest_served(tok: Any, schema: Any) -> int:
    """The smallest budget the gateway serves a forced call to the tool in."""
    with pytest.raises(GatewayError) as info:
        _forced(tok, schema, 1)
    return int(str(info.value).split("takes ")[1].split(" ")[0])


def _walks(tok: Any, compiled: tuple[Any, Any, list[int]], budget: int, walks: int) -> int:
    """Random walks through a compiled grammar, half of them spelling everything in the
    shortest tokens allowed (the longest spelling): each takes only what the mask allows,
    the matcher takes it, and the walk ends, within `budget`. The longest walk's length."""
    import xgrammar as xgr

    grammar, info, stops = compiled
    rng = random.Random(43)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    lengths = []
    for walk in range(walks):
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
            assert matcher.accept_token(token), tok.decode(ids)  # what the mask allows
            ids.append(token)
        assert matcher.is_terminated() and len(ids) <= budget, tok.decode(ids)
        assert tok.convert_tokens_to_ids("<tool_call>") in ids
        lengths.append(len(ids))
    return max(lengths)


@pytest.mark.parametrize("schema", [CITY, TWO], ids=["one-string", "two-strings"])
def test_any_path_the_grammar_allows_closes_the_call_within_the_smallest_budget(
    tok: Any, schema: Any
) -> None:
    budget = _shortest_served(tok, schema)
    longest = _walks(tok, _compiled(tok, _forced(tok, schema, budget)), budget, 60)
    print(f"\n60 walks at max_tokens {budget}, {longest} tokens at most")


def test_a_one_string_tool_is_served_at_48_tokens_and_every_walk_fits(tok: Any) -> None:
    assert _walks(tok, _compiled(tok, _forced(tok, CITY, 48)), 48, 40) <= 48


def test_a_budget_below_the_canonical_call_is_refused_naming_the_tokens_it_needs(
    tok: Any,
) -> None:
    """The head counts as the tokenizer writes it, the rest a token a byte."""
    head = tok.encode('\n{"name": "get_weather", "arguments":', add_special_tokens=False)
    # <tool_call>, the head, its space, '{"city":""}', "}\n", </tool_call>, the stop.
    needed = 1 + len(head) + 1 + 11 + 2 + 1 + 1 + PLACES
    assert _shortest_served(tok, CITY) == needed < 48
    with pytest.raises(GatewayError, match=f"its shortest form takes {needed} tokens") as info:
        _forced(tok, CITY, needed - 1)
    assert info.value.status_code == 400


@pytest.mark.parametrize(
    ("version", "env"),
    [("0.2.8", {"VLLM_XGRAMMAR_CACHE_MB": "0"}), ("0.2.9", {}), ("0.3.0rc1", {})],
)
def test_the_launcher_turns_the_cache_off_only_for_an_xgrammar_that_mixes_tokens_up(
    monkeypatch: pytest.MonkeyPatch, version: str, env: dict[str, str]
) -> None:
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda _: version)
    assert xgrammar_cache_environment() == env


def test_grammars_of_several_tools_compiled_in_a_row_each_mask_their_own_head(tok: Any) -> None:
    """One compiler, as one replica holds, compiling different tools' grammars in a row (the
    heads differ only in their tokens): each grammar's masks are its own."""
    compiler = _replica_compiler(tok)
    tools = [
        ("get_weather", CITY),
        ("get_forecast", TWO),
        ("look", {"properties": {"q": {"type": "string"}}, "required": ["q"]}),
        ("get_weather", CITY),
    ]
    for name, schema in tools:
        _walks(tok, _compiled(tok, _forced(tok, schema, 64, name), compiler), 64, 10)


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
    tag = json.loads(constraint["structured_outputs"]["structural_tag"])
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
    # The worst case: the head as the tokenizer writes it, the rest a byte a token, the
    # markers as their tokens, and the stop.
    special = dict(tok.get_added_vocab())
    head = head_tokens(begin, special, functools.partial(tok.encode, add_special_tokens=False))
    fixed = head + sum(most_tokens(p, special) for p in ('{"city":""}', end)) + 1
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
