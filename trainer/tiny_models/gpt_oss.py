"""gpt-oss's tokenizer and chat template for its tiny model: OpenAI's o200k_base vocabulary with
harmony's special tokens at harmony's ids (o200k_harmony), converted offline to a Hugging Face
tokenizer, and a template that writes harmony as the `renderers` gpt-oss renderer does.

The renderer renders through `openai-harmony` itself, so the tokenizer must give harmony's ids
for every text: it is o200k_base's own ranks, merges and split pattern, not a trained one. The
template follows the renderer, where it differs from gpt-oss's own template (docs/models.md): its
generation prompt opens the analysis channel, a tool result's author is the message's `name`
(else `functions.unknown`), and reasoning is kept only for tool calls no later answer closes.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Final

from lockgate.trainer.tiny_models.harmony_vocab import O200K_FILE, require_o200k

# o200k_base's pre-tokenizer split, as tiktoken defines it (its contractions spelled out case by
# case, as js-tiktoken ships it).
_CONTRACTION: Final = "('s|'S|'t|'T|'re|'rE|'Re|'RE|'ve|'vE|'Ve|'VE|'m|'M|'ll|'lL|'Ll|'LL|'d|'D)?"
O200K_PATTERN: Final = "|".join(
    (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        + _CONTRACTION,
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        + _CONTRACTION,
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)

# o200k_harmony's special tokens: ids 199998 up to the model's vocabulary of 201088, the unnamed
# ones reserved under their id.
_FIRST_SPECIAL: Final = 199998
GPT_OSS_VOCAB_SIZE: Final = 201088
_NAMED: Final = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
}
GPT_OSS_TOKENS: Final = tuple(
    (_NAMED.get(i, f"<|reserved_{i}|>"), True) for i in range(_FIRST_SPECIAL, GPT_OSS_VOCAB_SIZE)
)

# Written from the renderer's output: the system preamble harmony writes, the caller's system
# message and the tools (as a TypeScript namespace) in a developer message, one harmony message
# per call, result and answer.
GPT_OSS_CHAT_TEMPLATE: Final = r"""{%- macro ts_type(p) -%}
    {%- if p.enum is defined -%}{%- for v in p.enum -%}{{- v | tojson -}}{%- if not loop.last %} | {% endif -%}{%- endfor -%}
    {%- elif p.type is string or p.type is not defined -%}{{- scalar_type(p) -}}
    {%- else -%}{%- for t in p.type -%}{{- scalar_type({'type': t, 'items': p['items']}) -}}{%- if not loop.last %} | {% endif -%}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro scalar_type(p) -%}
    {%- if p.type in ('integer', 'number') -%}number
    {%- elif p.type in ('string', 'boolean', 'null') -%}{{- p.type -}}
    {%- elif p.type == 'array' -%}{{- (ts_type(p['items']) if p['items'] else 'any') + '[]' -}}
    {%- elif p.type == 'object' -%}{{- '{\n    }' -}}
    {%- else -%}any
    {%- endif -%}
{%- endmacro -%}
{%- macro render_tools(tools) -%}
    {{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
    {%- for tool in tools -%}
        {%- set fn = tool.function if tool.function is defined else tool -%}
        {%- if fn.description -%}{{- '// ' + fn.description + '\n' -}}{%- endif -%}
        {%- set params = fn.parameters or {} -%}
        {%- if params.properties is defined -%}
            {{- 'type ' + fn.name + ' = (_: {\n' -}}
            {%- for name, p in params.properties.items() -%}
                {%- if p.description -%}{{- '// ' + p.description + '\n' -}}{%- endif -%}
                {{- name + ('' if name in (params.required or []) else '?') + ': ' + ts_type(p) + ',' -}}
                {%- if p.default is defined -%}{{- ' // default: ' + (p.default | tojson) -}}{%- endif -%}
                {{- '\n' -}}
            {%- endfor -%}
            {{- '}) => any;\n\n' -}}
        {%- else -%}
            {{- 'type ' + fn.name + ' = (_: any) => any;\n\n' -}}
        {%- endif -%}
    {%- endfor -%}
    {{- '} // namespace functions' -}}
{%- endmacro -%}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}
{%- if system is not none or tools -%}
    {{- '<|start|>developer<|message|>' -}}
    {%- if system is not none -%}{{- '# Instructions\n\n' + system -}}{%- if tools -%}{{- '\n\n' -}}{%- endif -%}{%- endif -%}
    {%- if tools -%}{{- render_tools(tools) -}}{%- endif -%}
    {{- '<|end|>' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- if loop.first and system is not none -%}
    {%- elif m.role == 'user' -%}
        {{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}
    {%- elif m.role in ('system', 'developer') -%}
        {{- '<|start|>developer<|message|># Instructions\n\n' + m.content + '<|end|>' -}}
    {%- elif m.role == 'tool' -%}
        {%- set author = m.name or 'unknown' -%}
        {%- if not author.startswith('functions.') -%}{%- set author = 'functions.' + author -%}{%- endif -%}
        {{- '<|start|>' + author + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set ns = namespace(keep=m.tool_calls and m.reasoning_content) -%}
        {%- for later in messages[loop.index0 + 1:] -%}
            {%- if later.role == 'assistant' and not later.tool_calls and later.content -%}{%- set ns.keep = false -%}{%- endif -%}
        {%- endfor -%}
        {%- if ns.keep -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' -}}{%- endif -%}
        {%- if m.content -%}
            {%- set last = loop.last and not add_generation_prompt and not m.tool_calls -%}
            {{- '<|start|>assistant<|channel|>final<|message|>' + m.content + ('<|return|>' if last else '<|end|>') -}}
        {%- endif -%}
        {%- for tc in m.tool_calls or [] -%}
            {%- set call = tc.function if tc.function is defined else tc -%}
            {%- set recipient = call.name if call.name.startswith('functions.') else 'functions.' + call.name -%}
            {{- '<|start|>assistant to=' + recipient + '<|channel|>commentary<|message|>' -}}
            {{- call.arguments if call.arguments is string else call.arguments | tojson -}}
            {{- '<|call|>' -}}
        {%- endfor -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' -}}{%- endif -%}"""


def _read_ranks(path: str) -> dict[bytes, int]:
    """A .tiktoken file: one base64 token and its rank a line."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        token, rank = line.split(b" ")
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_gpt_oss_tokenizer(out_dir: Path, chat_template: str) -> tuple[int, dict[str, int]]:
    """Save the o200k_harmony tokenizer into `out_dir`; return its length and the special ids."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class O200kConverter(TikTokenConverter):  # type: ignore[misc]
        """Reads the ranks itself: the `tiktoken` package it would call is not a dependency."""

        load_tiktoken_bpe = staticmethod(_read_ranks)

    vocab = require_o200k() / O200K_FILE
    tok = O200kConverter(vocab_file=str(vocab), pattern=O200K_PATTERN).converted()
    if tok.get_vocab_size() != _FIRST_SPECIAL:
        raise ValueError(f"{vocab} holds {tok.get_vocab_size()} ranks, not o200k_base's")
    tok.add_special_tokens(
        [AddedToken(content, normalized=False, special=True) for content, _ in GPT_OSS_TOKENS]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    ids = {content: tok.token_to_id(content) for content, _ in GPT_OSS_TOKENS}
    return tok.get_vocab_size(), ids
