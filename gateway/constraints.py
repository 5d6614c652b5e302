"""`tool_choice: "required"` and named functions, honoured by constrained decoding.

The model's own tool-call syntax is described by xgrammar's structural tags (the grammar engine
vLLM uses for structured outputs), so the gateway writes no grammar of its own: it asks xgrammar
for the tag of the chat format in use and passes it to vLLM as
`sampling_params.structured_outputs.structural_tag`.

A constrained call's logprobs are those of the unconstrained model (vLLM reports them before the
grammar mask), so its record says `constrained` and training may treat it accordingly.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from lockgate.gateway.errors import bad_request
from lockgate.gateway.schema import NamedToolChoice, ToolSpec

# `renderers` chat-format name -> xgrammar's model key for the same tool-call syntax.
_XGRAMMAR_FORMATS = {"qwen3": "qwen_3"}

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
) -> dict[str, Any] | None:
    """vLLM `structured_outputs` forcing a tool call, or None when nothing is forced.

    `reasoning`: "auto" lets the model think first (an optional <think> block), "disabled"
    makes the tool call the very first thing it writes.
    """
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if not tools:
        raise bad_request(
            "tool_choice requires 'tools': there is no tool to call", param="tool_choice"
        )
    fmt = _XGRAMMAR_FORMATS.get(renderer)
    if fmt is None:
        raise bad_request(
            f"tool_choice '{_describe(tool_choice)}' is not supported for the '{renderer}' "
            f"chat format (constrained tool calls exist for: {', '.join(_XGRAMMAR_FORMATS)})",
            param="tool_choice",
        )
    choice: str | dict[str, Any] = "required"
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in {t.function.name for t in tools}:
            raise bad_request(
                f"tool_choice names '{name}', which is not among the tools", param="tool_choice"
            )
        choice = tool_choice.model_dump()
    # Imported here: xgrammar is a vLLM dependency, loaded only by calls that need it.
    import xgrammar

    tag = xgrammar.get_model_structural_tag(
        fmt,
        tools=[t.model_dump(exclude_none=True) for t in tools],
        tool_choice=choice,
        reasoning=reasoning,
        parallel_tool_calls=parallel_tool_calls is not False,
        max_whitespace_cnt=MAX_WHITESPACE,
    )
    return {"structural_tag": json.dumps(tag.model_dump(mode="json", exclude_none=True))}


def _describe(tool_choice: str | NamedToolChoice) -> str:
    if isinstance(tool_choice, NamedToolChoice):
        return f"function {tool_choice.function.name}"
    return tool_choice
