"""`tool_choice: "required"` and named functions, honoured by constrained decoding.

The model's own tool-call syntax is described by xgrammar's structural tags (the grammar engine
vLLM uses for structured outputs), so the gateway writes no grammar of its own: it asks xgrammar
for the tag of the chat format in use (its own, or one lockgate builds from xgrammar's parts
where xgrammar's does not write the format's syntax: forced_tags.py) and passes it to vLLM as
`sampling_params.structured_outputs.structural_tag`.

A constrained call's logprobs are those of the unconstrained model (vLLM reports them before the
grammar mask), so its record says `constrained` and training may treat it accordingly.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

from lockgate.gateway.calls.forced_budget import (
    CallDoesNotFit,
    ForcedBudget,
    bound_strings,
    glm_xml_arguments,
    head_tokens,
    held_head,
    most_tokens,
    plan_forced_budget,
)
from lockgate.gateway.calls.forced_formats import FORCED_FORMATS, ForcedFormat
from lockgate.gateway.errors import bad_request
from lockgate.gateway.schema import NamedToolChoice, ToolSpec

# Whitespace the grammar allows between JSON tokens, at most, in one place: unbounded, a weak
# model can fill its whole budget with it inside a call; no real call needs more.
MAX_WHITESPACE = 4

Reasoning = Literal["auto", "disabled"]


def tool_call_constraint(
    renderer: str,
    tools: list[ToolSpec] | None,
    tool_choice: str | NamedToolChoice | None,
    *,
    reasoning: Reasoning,
    parallel_tool_calls: bool | None,
    special_tokens: Mapping[str, int] | None = None,
    max_tokens: int | None = None,
    encode: Callable[[str], list[int]] | None = None,
    earlier_calls: int = 0,
) -> dict[str, Any] | None:
    """The sampling parameters forcing a tool call (vLLM's `structured_outputs`, and a
    `logit_bias` keeping out stop tokens a call does not end on, where the format has them:
    forced_formats.py), or None when nothing is forced.

    `reasoning`: "auto" lets the model think first (an optional <think> block), "disabled"
    makes the tool call the very first thing it writes. `special_tokens`: the tokenizer's
    added tokens; format markers among them are matched as those tokens. With `max_tokens`,
    the thinking and the string arguments are bounded so that the call fits the budget
    (forced_budget.py); a budget too small for any call is a 400. `encode`: the tokenizer's
    (no special tokens added); with it each call's head is held to the tokens it writes, and
    the budget counts those (forced_budget.py says why, and what the replicas need for it).
    `earlier_calls`: the tool calls of the conversation so far, the index of this one where
    the format numbers its calls (Kimi-K2).
    """
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    forced, choice, tools = _forced_choice(renderer, tools, tool_choice)
    # Imported here: xgrammar is a vLLM dependency, loaded only by calls that need it.
    import xgrammar

    from lockgate.gateway.calls import forced_tags

    forced_tags.register()

    def tag_for(reasoning: Reasoning) -> Any:
        tag = xgrammar.get_model_structural_tag(
            forced.xgrammar,
            tools=[t.model_dump(exclude_none=True) for t in tools],
            tool_choice=choice,
            reasoning=forced.xgrammar_reasoning(reasoning),
            parallel_tool_calls=parallel_tool_calls is not False and not forced.one_call,
            max_whitespace_cnt=MAX_WHITESPACE,
        )
        if forced.indexed:
            tag.format = forced_tags.with_call_index(tag.format, earlier_calls)
        return tag

    tag = tag_for(reasoning)
    special = dict(special_tokens or {})
    strings: int | None = None
    if max_tokens is not None:
        calls = {_tool_named_in(begin, tools): spec for begin, spec in _calls_in(tag.format)}
        try:
            budget = plan_forced_budget(
                max_tokens,
                calls,
                functools.partial(most_tokens, special=special),
                may_think=forced.may_think(reasoning),
                whitespace=MAX_WHITESPACE,
                think_overhead=forced.think_overhead,
                fixed=forced.fixed,
                count_head=functools.partial(head_tokens, special=special, encode=encode)
                if encode
                else None,
                arguments=glm_xml_arguments if forced.arguments == "glm_xml" else None,
            )
        except CallDoesNotFit as exc:
            raise bad_request(str(exc), param="max_tokens") from exc
        if budget.think_tokens is None and reasoning == "auto":
            tag = tag_for("disabled")  # no room to think: the call comes first
        tag.format = _within_budget(tag.format, forced.bounded(budget))
        strings = budget.string_chars
    tag.format = _as_special_tokens(tag.format, special, encode)
    if forced.arguments == "glm_xml":
        tag.format = forced_tags.glm_xml_as_tokens(tag.format, special, strings)
    return _sampling(tag, forced, special)


def _sampling(tag: Any, forced: ForcedFormat, special: Mapping[str, int]) -> dict[str, Any]:
    """The tag as vLLM's `structured_outputs`, and the stops a call does not end on biased
    away where the format has them."""
    out: dict[str, Any] = {
        "structured_outputs": {
            "structural_tag": json.dumps(tag.model_dump(mode="json", exclude_none=True))
        }
    }
    if banned := [special[t] for t in forced.other_stops if t in special]:
        # vLLM's strongest bias; ids as strings, as JSON keys are.
        out["logit_bias"] = {str(t): -100.0 for t in banned}
    return out


def _forced_choice(
    renderer: str, tools: list[ToolSpec] | None, tool_choice: str | NamedToolChoice
) -> tuple[ForcedFormat, str | dict[str, Any], list[ToolSpec]]:
    """The format's forced-call rules, xgrammar's tool choice and the tools, or a 400 naming
    what the request asks that cannot be forced."""
    if not tools:
        raise bad_request(
            "tool_choice requires 'tools': there is no tool to call", param="tool_choice"
        )
    forced = FORCED_FORMATS.get(renderer)
    if forced is None:
        raise bad_request(
            f"tool_choice '{_describe(tool_choice)}' is not supported for the '{renderer}' "
            f"chat format (constrained tool calls exist for: {', '.join(FORCED_FORMATS)})",
            param="tool_choice",
        )
    if not isinstance(tool_choice, NamedToolChoice):
        return forced, "required", tools
    name = tool_choice.function.name
    if name not in {t.function.name for t in tools}:
        raise bad_request(
            f"tool_choice names '{name}', which is not among the tools", param="tool_choice"
        )
    return forced, tool_choice.model_dump(), tools


def _calls_in(fmt: Any) -> list[tuple[str, tuple[str, Any, str]]]:
    """Each call tag in the format: its opening text, and (opening, schema, closing)."""
    from xgrammar import structural_tag as st

    if isinstance(fmt, st.TagFormat):
        end = fmt.end if isinstance(fmt.end, str) else max(fmt.end, key=len)
        if isinstance(fmt.content, st.JSONSchemaFormat) and isinstance(fmt.begin, str):
            return [(fmt.begin, (fmt.begin, fmt.content.json_schema, end))]
        # A tag around calls (DeepSeek's tool-calls block) writes its text with each of them.
        wrap = fmt.begin if isinstance(fmt.begin, str) else ""
        return [
            (b, (wrap + head, schema, tail + end))
            for b, (head, schema, tail) in _calls_in(fmt.content)
        ]
    if isinstance(fmt, st.TriggeredTagsFormat | st.TagsWithSeparatorFormat):
        return [c for t in fmt.tags for c in _calls_in(t)]
    if isinstance(fmt, st.SequenceFormat):
        return [c for e in fmt.elements for c in _calls_in(e)]
    if isinstance(fmt, st.OptionalFormat):
        return _calls_in(fmt.content)
    return []


def _tool_named_in(begin: str, tools: list[ToolSpec]) -> str:
    """The tool a call's opening text names (quoted in JSON formats, bare in DeepSeek's)."""
    named = [t.function.name for t in tools if t.function.name in begin]
    return max(named, key=len, default=begin)


def _within_budget(fmt: Any, budget: ForcedBudget) -> Any:
    """The same format with the thinking, the strings and the whitespace of `budget`."""
    from xgrammar import structural_tag as st

    if isinstance(fmt, st.TagFormat):
        content = fmt.content
        if isinstance(content, st.AnyTextFormat) and budget.think_tokens is not None:
            content = content.model_copy(update={"max_tokens": budget.think_tokens})
        elif isinstance(content, st.JSONSchemaFormat):
            schema = content.json_schema
            # Other styles bound their strings themselves (forced_tags.glm_xml_as_tokens).
            if budget.string_chars is not None and content.style == "json":
                schema = bound_strings(schema, budget.string_chars)
            content = content.model_copy(
                update={"json_schema": schema, "max_whitespace_cnt": budget.whitespace}
            )
        else:
            content = _within_budget(content, budget)
        return fmt.model_copy(update={"content": content})
    if isinstance(fmt, st.TriggeredTagsFormat) and fmt.at_least_one:
        # Calls back to back, separated as the format separates parallel calls, and nothing
        # else: free text after a call would run on to the budget's end, so that the answer
        # ends `length` rather than `tool_calls`.
        return st.TagsWithSeparatorFormat(
            tags=[_within_budget(t, budget) for t in fmt.tags],
            separator="\n",
            at_least_one=True,
            stop_after_first=fmt.stop_after_first or budget.one_call,
        )
    if isinstance(fmt, st.TriggeredTagsFormat):
        return fmt.model_copy(update={"tags": [_within_budget(t, budget) for t in fmt.tags]})
    if isinstance(fmt, st.TagsWithSeparatorFormat):
        tags = [_within_budget(t, budget) for t in fmt.tags]
        one = fmt.stop_after_first or budget.one_call
        return fmt.model_copy(update={"tags": tags, "stop_after_first": one})
    if isinstance(fmt, st.SequenceFormat):
        return fmt.model_copy(
            update={"elements": [_within_budget(e, budget) for e in fmt.elements]}
        )
    if isinstance(fmt, st.OptionalFormat):
        return fmt.model_copy(update={"content": _within_budget(fmt.content, budget)})
    return fmt


def _as_special_tokens(
    fmt: Any, special: dict[str, int], encode: Callable[[str], list[int]] | None = None
) -> Any:
    """The same format with the chat format's markers (`<tool_call>`, `</think>`, ...) matched
    as their special tokens, not as text.

    xgrammar's model tags match markers as strings, which the tokenizer can also spell with
    ordinary tokens; a model spelling `<tool_call>` that way writes a call the format's parser
    (which looks for the special token) does not see. A trained model uses the special token
    anyway; a weak or random one may not. Tokens go by id: vLLM checks a tag without the
    tokenizer, and token strings cannot be resolved there. With `encode`, the head after an
    opening marker is held to the tokens `encode` writes (`_held`); the rest stays text.
    """
    from xgrammar import structural_tag as st

    def split_begin(text: str) -> tuple[str, str] | None:
        return next(((m, text[len(m) :]) for m in special if text.startswith(m)), None)

    def split_end(text: str) -> tuple[str, str] | None:
        return next(((text[: -len(m)], m) for m in special if text.endswith(m)), None)

    def tag(t: st.TagFormat) -> st.TagFormat:
        content = _as_special_tokens(t.content, special, encode)
        begin: str | st.TokenFormat = t.begin
        end: Any = t.end
        if isinstance(begin, str) and (b := split_begin(begin)):
            begin = st.TokenFormat(token=special[b[0]])
            if b[1]:
                head = _held(b[1], encode) if encode else _spelled(b[1], special)
                content = st.SequenceFormat(elements=[*head, content])
        if isinstance(end, str) and (e := split_end(end)):
            end = st.TokenFormat(token=special[e[1]])
            if e[0]:
                content = st.SequenceFormat(elements=[content, *_spelled(e[0], special)])
        return st.TagFormat(begin=begin, content=content, end=end)

    if isinstance(fmt, st.TagFormat):
        return tag(fmt)
    if isinstance(fmt, st.TriggeredTagsFormat) and set(fmt.triggers) <= special.keys():
        return st.TokenTriggeredTagsFormat(
            trigger_tokens=[special[t] for t in fmt.triggers],
            tags=[tag(t) for t in fmt.tags],
            exclude_tokens=[special[x] for x in fmt.excludes if x in special],
            at_least_one=fmt.at_least_one,
            stop_after_first=fmt.stop_after_first,
        )
    if isinstance(fmt, st.TagsWithSeparatorFormat):
        return fmt.model_copy(update={"tags": [tag(t) for t in fmt.tags]})
    if isinstance(fmt, st.SequenceFormat):
        return st.SequenceFormat(
            elements=[_as_special_tokens(e, special, encode) for e in fmt.elements]
        )
    if isinstance(fmt, st.OptionalFormat):
        return st.OptionalFormat(content=_as_special_tokens(fmt.content, special, encode))
    return fmt


def _spelled(text: str, special: Mapping[str, int]) -> list[Any]:
    """Fixed text as text, with the format's markers inside it (DeepSeek's `<｜tool▁sep｜>` after
    the name, its `<｜tool▁call▁end｜>` before `<｜tool▁calls▁end｜>`) as their tokens: spelt
    as text, a marker could take a token a byte, past what the budget reserves, and the parser
    would not see it."""
    import re

    from xgrammar import structural_tag as st

    markers = sorted((m for m in special if m in text), key=len, reverse=True)
    if not markers:
        return [st.ConstStringFormat(value=text)]
    pieces = re.split("(" + "|".join(map(re.escape, markers)) + ")", text)
    return [
        st.TokenFormat(token=special[p]) if p in special else st.ConstStringFormat(value=p)
        for p in pieces
        if p
    ]


def _held(text: str, encode: Callable[[str], list[int]]) -> list[Any]:
    """A head's text as the tokens `encode` writes, then its closing whitespace as text
    (forced_budget.held_head): what `head_tokens` counts."""
    from xgrammar import structural_tag as st

    held, loose = held_head(text)
    out: list[Any] = [st.TokenFormat(token=t) for t in encode(held)]
    return out + ([st.ConstStringFormat(value=loose)] if loose else [])


def _describe(tool_choice: str | NamedToolChoice) -> str:
    if isinstance(tool_choice, NamedToolChoice):
        return f"function {tool_choice.function.name}"
    return tool_choice
