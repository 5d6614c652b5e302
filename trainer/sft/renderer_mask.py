"""A conversation's token ids and loss mask from its chat format's `renderers` renderer.

The renderer knows, token by token, which tokens of a rendered conversation the model samples
(its `sampled_mask`): an assistant turn's reasoning, content and tool calls, and the token that
closes the turn, even where the format writes that token as the next role's marker (GLM's
`<|observation|>`), but not the role headers, separators or generation-prompt prefills around
them. The mask is that signal, so every format trains exactly the tokens its assistant writes,
with no prefix renders to line up. The whole conversation is rendered once, as the format
renders history: Qwen3 and DeepSeek-R1 drop the reasoning of turns their template drops it from
(the gateway's recorded samples keep it within a tool cycle, by extending the model's own tokens).

A format whose template leaves a final answer unclosed (GLM closes a turn only with the next
role's marker) gets the format's stop token appended and trained, so the model learns to stop.

The generic format (`default`) renders through the model's Jinja template, which says nothing
about which tokens are sampled: `data.py` masks it by rendering prefixes instead.
"""

from __future__ import annotations

from typing import Any

import renderers

GENERIC = "default"  # the `renderers` name of the template-only renderer


def format_renderer(tokenizer: Any, chat_format: str) -> renderers.Renderer:
    """The renderer of `chat_format` (a `renderers` name other than `default`) on `tokenizer`;
    a ValueError naming the format when `renderers` does not know it."""
    if chat_format == GENERIC:
        raise ValueError("the generic format has no sampled mask: render it with its template")
    config = renderers.config_from_name(chat_format)  # an unknown name: a ValueError naming all
    if config is None:
        raise ValueError(f"model.chat_format {chat_format!r} is not resolved to one format")
    return renderers.create_renderer(tokenizer, config)


def render_with_sampled_mask(
    renderer: renderers.Renderer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> tuple[list[int], list[int]]:
    """The conversation's ids and a mask of 1 exactly on the tokens its assistant samples."""
    if messages[0]["role"] == "assistant":
        raise ValueError("message 0 is an assistant message: nothing comes before it")
    sample = renderers.build_training_sample(
        renderer,
        messages,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        ensure_final_stop=True,
    )
    return list(sample.token_ids), [int(m) for m in sample.loss_mask]
