"""Structural tags lockgate writes itself, for formats whose call syntax xgrammar's built-in tags
do not write as the format's `renderers` renderer does, token for token.

Each is built from xgrammar's own structural-tag parts and registered in its model-tag registry
under a `lockgate_` key, so `xgrammar.get_model_structural_tag` reads the tools and the tool
choice for it as it does for its own (a named function arrives here as the one tool, `forced`).
Only forced calls come here: `tool_choice` required or a named function.

- `lockgate_harmony` (gpt-oss): renderers writes a call as its own message,
  `<|start|>assistant to=functions.NAME<|channel|>commentary<|message|>{...}<|call|>`, after the
  analysis message the generation prompt opened. xgrammar's `harmony` tag spells the header
  with a `<|constrain|>json` or ` json` content type that renderers never writes, and expects
  the prompt to stop at `<|start|>assistant`. The call ends on `<|call|>`, a stop token: a
  stop token ends the grammar rather than being part of it, so the tag ends at the arguments.

- `lockgate_glm45` (GLM-4.5): `\\n<think>...</think>\\n<tool_call>NAME\\n` then each argument
  as `<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n`, then `</tool_call>`. xgrammar's
  `glm_4_7` tag admits neither the newlines around the think block nor the empty block GLM-4.5
  writes with thinking off, and its `glm_xml` argument style matches the argument markers as
  text, which a model may spell in ordinary tokens the parser does not read as markers. The
  tag is written with that style (so the budget reads its schema) and `glm_xml_as_tokens`
  rewrites the arguments from token-level parts: each marker its special token, a value raw
  text without markers (bounded in tokens) where the parser reads it raw, JSON otherwise.

And one rewrite of xgrammar's own tag: `with_call_index` (Kimi-K2), whose call id
`functions.NAME:INDEX` xgrammar leaves an unbounded run of digits, which no budget bounds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from lockgate.gateway.calls.forced_budget import bound_strings, glm_raw

# Harmony's markers: none may appear inside the analysis text, or the parser (which reads the
# reply message by message at these tokens) would see a message there.
HARMONY_MARKERS: Final = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
HARMONY_ANALYSIS_END: Final = "<|end|>"


def harmony_call_head(name: str) -> str:
    """The header renderers writes before a call's arguments (its own assistant message)."""
    return f"<|start|>assistant to=functions.{name}<|channel|>commentary<|message|>"


def _harmony(
    tools: list[Any] | None,
    builtin_tools: list[Any] | None,
    tool_choice: str,
    reasoning: str,
    *,
    max_whitespace_cnt: int | None = None,
    **_: Any,
) -> Any:
    """The analysis message the prompt opened, closed (empty when thinking is off), then one
    call message; no final message."""
    from xgrammar import structural_tag as st

    analysis = st.TagFormat(
        begin="",
        content=st.AnyTextFormat(excludes=list(HARMONY_MARKERS)),
        end=HARMONY_ANALYSIS_END,
    )
    calls = st.TagsWithSeparatorFormat(
        tags=[
            st.TagFormat(
                begin=harmony_call_head(tool.function.name),
                content=_arguments(tool, max_whitespace_cnt),
                end="",
            )
            for tool in tools or []
        ],
        separator="",
        at_least_one=True,
        stop_after_first=True,
    )
    return st.StructuralTag(format=st.SequenceFormat(elements=[analysis, calls]))


def _arguments(tool: Any, max_whitespace_cnt: int | None, style: str = "json") -> Any:
    """A tool's arguments to its schema (any object where it gives none), in `style`."""
    from xgrammar import structural_tag as st

    schema = tool.function.parameters
    if schema is None or getattr(tool.function, "strict", None) is False:
        schema = True
    return st.JSONSchemaFormat(
        json_schema=schema, max_whitespace_cnt=max_whitespace_cnt, style=style
    )


def with_call_index(fmt: Any, index: int) -> Any:
    """xgrammar's `kimi` tag with each call's index fixed to `index` (Kimi-K2 numbers the calls
    of a conversation from 0, which is what the model writes) and its call section a tag
    around the calls, whose markers the budget then counts with each call
    (constraints.py `_calls_in`). Only a forced call's section, one call, is read here."""
    from xgrammar import structural_tag as st

    if isinstance(fmt, st.SequenceFormat):
        parts = [with_call_index(e, index) for e in fmt.elements]
        match parts:
            case [st.ConstStringFormat() as a, calls, st.ConstStringFormat() as b]:
                return st.TagFormat(begin=a.value, content=calls, end=b.value)
        return fmt.model_copy(update={"elements": parts})
    if isinstance(fmt, st.TagsWithSeparatorFormat):
        return fmt.model_copy(update={"tags": [_indexed(t, index) for t in fmt.tags]})
    if isinstance(fmt, st.TagFormat):  # a named function's one call
        return _indexed(fmt, index)
    return fmt


def _indexed(tag: Any, index: int) -> Any:
    """A call tag `begin`, (digits, argument marker, arguments), `end` as `begin` + index +
    argument marker, then the arguments."""
    from xgrammar import structural_tag as st

    match tag.content:
        case st.SequenceFormat(
            elements=[st.RegexFormat(), st.ConstStringFormat(value=marker), arguments]
        ):
            begin = f"{tag.begin}{index}{marker}"
            return st.TagFormat(begin=begin, content=arguments, end=tag.end)
    raise ValueError(f"not a Kimi-K2 call tag: {tag}")


# GLM's markers: none may appear inside the reasoning or a string value, where the parser
# would read them as structure.
GLM_MARKERS: Final = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
GLM_STYLE: Final = "glm_xml"


def _glm45(
    tools: list[Any] | None,
    builtin_tools: list[Any] | None,
    tool_choice: str,
    reasoning: str,
    *,
    max_whitespace_cnt: int | None = None,
    parallel_tool_calls: bool = True,
    **_: Any,
) -> Any:
    """The think block GLM-4.5 writes before every call (empty with thinking off) between
    newlines, then calls separated by a newline; arguments in `glm_xml` style until
    `glm_xml_as_tokens` rewrites them."""
    from xgrammar import structural_tag as st

    calls = st.TagsWithSeparatorFormat(
        tags=[
            st.TagFormat(
                begin=f"<tool_call>{tool.function.name}",
                content=_arguments(tool, max_whitespace_cnt, GLM_STYLE),
                end="</tool_call>",
            )
            for tool in tools or []
        ],
        separator="\n",
        at_least_one=True,
        stop_after_first=not parallel_tool_calls,
    )
    think = st.TagFormat(
        begin="<think>", content=st.AnyTextFormat(excludes=list(GLM_MARKERS)), end="</think>"
    )
    newline = st.ConstStringFormat(value="\n")
    return st.StructuralTag(format=st.SequenceFormat(elements=[newline, think, newline, calls]))


def glm_xml_as_tokens(fmt: Any, special: Mapping[str, int], string_tokens: int | None) -> Any:
    """`fmt` with every `glm_xml` argument list written from token-level parts, each free-text
    string at most `string_tokens` tokens (None: unbounded)."""
    from xgrammar import structural_tag as st

    if isinstance(fmt, st.JSONSchemaFormat) and fmt.style == GLM_STYLE:
        return _glm_arguments(fmt, special, string_tokens)
    update: dict[str, Any] = {}
    for field in ("content", "elements", "tags"):
        value = getattr(fmt, field, None)
        if isinstance(value, list):
            update[field] = [glm_xml_as_tokens(v, special, string_tokens) for v in value]
        elif value is not None and not isinstance(value, str | bool | int):
            update[field] = glm_xml_as_tokens(value, special, string_tokens)
    return fmt.model_copy(update=update) if update else fmt


def _glm_arguments(fmt: Any, special: Mapping[str, int], string_tokens: int | None) -> Any:
    """A newline, then each property in the schema's order (the required ones always, the
    others optionally) as `<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n`."""
    from xgrammar import structural_tag as st

    schema = fmt.json_schema if isinstance(fmt.json_schema, dict) else {}
    required = set(schema.get("required", ()))
    items: list[Any] = [st.ConstStringFormat(value="\n")]
    for key, sub in schema.get("properties", {}).items():
        sub = sub if isinstance(sub, dict) else {}
        item = st.SequenceFormat(
            elements=[
                _marker("<arg_key>", special),
                st.ConstStringFormat(value=key),
                _marker("</arg_key>", special),
                st.ConstStringFormat(value="\n"),
                st.TagFormat(
                    begin=_marker("<arg_value>", special),
                    content=_glm_value(sub, fmt.max_whitespace_cnt, string_tokens),
                    end=_marker("</arg_value>", special),
                ),
                st.ConstStringFormat(value="\n"),
            ]
        )
        items.append(item if key in required else st.OptionalFormat(content=item))
    return st.SequenceFormat(elements=items)


def _glm_value(schema: Any, whitespace: int | None, string_tokens: int | None) -> Any:
    """A value as GLM-4.5's parser reads it: raw text where the parameter's type is a string
    (`glm_raw`), JSON otherwise (an enum's or const's values too), free-text strings within
    `string_tokens`."""
    from xgrammar import structural_tag as st

    raw = glm_raw(schema)
    options = [schema["const"]] if "const" in schema else schema.get("enum")
    if options:
        spelled = [o if raw and isinstance(o, str) else json.dumps(o) for o in options]
        return st.OrFormat(elements=[st.ConstStringFormat(value=o) for o in spelled])
    if raw and "pattern" in schema:
        return st.RegexFormat(pattern=schema["pattern"])
    if raw:
        bound = None if "format" in schema else string_tokens
        return st.AnyTextFormat(excludes=list(GLM_MARKERS), max_tokens=bound)
    bounded = schema if string_tokens is None else bound_strings(schema, string_tokens)
    return st.JSONSchemaFormat(json_schema=bounded, max_whitespace_cnt=whitespace)


def _marker(text: str, special: Mapping[str, int]) -> Any:
    """A marker as its special token where the tokenizer has one, else as text."""
    from xgrammar import structural_tag as st

    if text in special:
        return st.TokenFormat(token=special[text])
    return st.ConstStringFormat(value=text)


BUILDERS: Final = {"lockgate_harmony": _harmony, "lockgate_glm45": _glm45}


def register() -> None:
    """Put lockgate's tags in xgrammar's registry (once is enough; again is harmless)."""
    import xgrammar

    for key, build in BUILDERS.items():
        xgrammar.register_model_structural_tag(key)(build)
