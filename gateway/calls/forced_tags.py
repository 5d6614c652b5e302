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

And one rewrite of xgrammar's own tag: `with_call_index` (Kimi-K2), whose call id
`functions.NAME:INDEX` xgrammar leaves an unbounded run of digits, which no budget bounds.
"""

from __future__ import annotations

from typing import Any, Final

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


def _arguments(tool: Any, max_whitespace_cnt: int | None) -> Any:
    """A tool's arguments as JSON to its schema (any JSON object where it gives none)."""
    from xgrammar import structural_tag as st

    schema = tool.function.parameters
    if schema is None or getattr(tool.function, "strict", None) is False:
        schema = True
    return st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=max_whitespace_cnt)


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


BUILDERS: Final = {"lockgate_harmony": _harmony}


def register() -> None:
    """Put lockgate's tags in xgrammar's registry (once is enough; again is harmless)."""
    import xgrammar

    for key, build in BUILDERS.items():
        xgrammar.register_model_structural_tag(key)(build)
