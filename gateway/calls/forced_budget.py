"""How a forced tool call (`tool_choice` required or named) is made to fit `max_tokens`.

OpenAI promises a tool call when one is forced. A model that may think first can think until
its budget is gone, and a weak one can write a string argument that never ends; either way the
answer is cut (`finish_reason: length`) before the call closes, and agent frameworks raise
(the openai-agents SDK: `ModelBehaviorError`). So the grammar of a forced call is bounded from
the budget: the call's fixed syntax and the shortest arguments its schema allows are reserved
first; of what is left, half may go to thinking (a token-exact bound in the grammar). When the
budget is tight (under four such calls) the rest goes to the free-text string arguments,
bounded in UTF-8 bytes (a byte-level tokenizer's token spells at least one byte, and may spell
a character outside ASCII a byte a token: `bound_strings`), the JSON whitespace is cut to one
character a place and only one call is allowed; an ample budget leaves strings, whitespace and
parallel calls as they are.

The reserve counts the call as the grammar lets the model write it, because only the most
tokens the grammar allows makes the promise hold; a count of how a model usually writes it
would not. The format's markers are matched as their special tokens. The call's head (the
tool's name and the JSON around it, up to its arguments) is held to the tokenizer's own
tokens when the caller gives its `encode` (`held_head`), so it counts exactly those
(`head_tokens`); the whitespace that ends the head stays characters, so that a model may join
it to the arguments' first token as its tokenizer does. Everything else is characters, which a
byte-level tokenizer may spell a byte a token: the arguments, the tail after them and the head
when no tokenizer is given count a token a UTF-8 byte (`most_tokens`), the JSON whitespace a
token a place.

A head held to tokens needs an xgrammar that keys cached token masks by the token too:
xgrammar 0.2.8's compiler cache shares one mask between rules that differ only in a token, so
a replica must run with its cache off (`VLLM_XGRAMMAR_CACHE_MB=0`, which the launcher sets);
docs/performance.md.

Pure: token counts come from functions the caller passes (`most_tokens` for the worst
case the grammar allows, `head_tokens` for a head held to the tokenizer's tokens).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The think block's own markers and the blank line after it, in tokens.
THINK_OVERHEAD_TOKENS = 4
# The stop token after the call.
END_OF_TURN_TOKENS = 1
# The most UTF-8 bytes one character takes, so the most tokens a byte-level tokenizer may spell
# it in (the tiny model's random weights do spell 3- and 4-byte characters a byte a token).
MAX_CHAR_BYTES = 4


@dataclass(frozen=True)
class ForcedBudget:
    """The bounds that make a forced call fit: `think_tokens` None means no thinking at all;
    `string_chars` is the most tokens any one free-text string argument may take, as that many
    ASCII characters or a quarter as many others (`bound_strings`; None: unbounded);
    `whitespace` the JSON whitespace allowed in one place; `one_call` when the budget is too
    tight for parallel calls (the first takes all the room)."""

    think_tokens: int | None
    string_chars: int | None
    whitespace: int
    one_call: bool


class CallDoesNotFit(ValueError):
    """Even the shortest call to some tool needs more tokens than the budget."""

    def __init__(self, needed: int, budget: int, tool: str) -> None:
        super().__init__(
            f"max_tokens {budget} is too small for a forced call to '{tool}': its shortest "
            f"form takes {needed} tokens"
        )
        self.needed = needed


def plan_forced_budget(
    budget: int,
    calls: Mapping[str, tuple[str, Mapping[str, Any], str]],
    count_tokens: Callable[[str], int],
    *,
    may_think: bool,
    whitespace: int,
    count_head: Callable[[str], int] | None = None,
    think_overhead: int = THINK_OVERHEAD_TOKENS,
    fixed: int = 0,
    arguments: Callable[[Any], tuple[str, int]] | None = None,
) -> ForcedBudget:
    """The bounds for a forced call within `budget` tokens.

    `calls`: per tool, the call's opening text, its parameters' JSON schema and its closing
    text, as the chat format writes them. The reserve is the longest shortest call over the
    tools (the model picks which), with `whitespace` characters allowed in each JSON position
    (cut to one, which is all a compact call needs, unless the budget is ample). The opening
    text counts by `count_head` (default: `count_tokens`), the rest by `count_tokens`.
    `think_overhead`: the tokens of the think block's own markers, written only with thinking;
    `fixed`: tokens the format writes before every call, thinking or not (a think block the
    prompt opened is closed even when empty). `arguments`: the text of a schema's shortest
    arguments and their whitespace positions as the format writes them (default: JSON,
    `json_arguments`).
    """
    head = count_head or count_tokens
    spell = arguments or json_arguments
    tool, floor, positions = max(
        ((name, *_shortest_call(spec, head, count_tokens, spell)) for name, spec in calls.items()),
        key=lambda t: t[1] + t[2] * whitespace,
    )
    floor += END_OF_TURN_TOKENS + fixed
    # A budget of four calls or more is ample: it keeps the whitespace and parallel calls.
    ample = budget >= 4 * (floor + positions * whitespace)
    if not ample:
        whitespace = 1
    needed = floor + positions * whitespace
    if needed > budget:
        raise CallDoesNotFit(needed, budget, tool)
    strings = max(_free_strings(spec[1]) for spec in calls.values())
    slack = budget - needed
    think: int | None = None
    if may_think and slack >= think_overhead:
        # Without strings to write, the thinking may have all the room.
        think = (slack - think_overhead) // (2 if strings else 1)
        slack -= think_overhead + think
    string_chars = slack // strings if strings and not ample else None
    return ForcedBudget(
        think_tokens=think, string_chars=string_chars, whitespace=whitespace, one_call=not ample
    )


def bound_strings(schema: Any, max_chars: int) -> Any:
    """`schema` with every free-text string (no enum, const, pattern or format) at most
    `max_chars` UTF-8 bytes, so at most `max_chars` tokens however the model spells it: up to
    `max_chars` ASCII characters, or up to a quarter as many when any is outside ASCII (one
    takes up to four bytes, which a byte-level tokenizer may spell a byte a token); a tighter
    `maxLength` already there is kept.

    The bound is a pattern, not `maxLength`: xgrammar (0.2) lets a string under `maxLength`
    hold raw control characters, which makes the call invalid JSON, and drops the bound when a
    pattern is present. The pattern admits no escapes, so a bounded string holds no quote or
    backslash: the price of a call that must fit a tight budget.
    """
    if isinstance(schema, list):
        return [bound_strings(s, max_chars) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _bound_child(key, value, max_chars) for key, value in schema.items()}
    if _is_free_string(schema):
        out["pattern"] = _bounded_string_pattern(schema, max_chars)
    return out


def _bounded_string_pattern(schema: Mapping[str, Any], max_bytes: int) -> str:
    """A pattern for a string of at most `max_bytes` UTF-8 bytes, without control characters,
    within the schema's own length bounds (a minimum over the bound is cut to it)."""
    most = int(schema.get("maxLength", max_bytes))
    longest = min(most, max_bytes)
    shortest = min(int(schema.get("minLength", 0)), longest)
    ascii_only = f"[\\x20-\\x7f]{{{shortest},{longest}}}"
    # Any character but a control one, each counted as its most bytes.
    wide = min(most, max_bytes // MAX_CHAR_BYTES)
    if wide < max(shortest, 1):
        return f"^{ascii_only}$"
    return f"^(?:{ascii_only}|[^\\x00-\\x1f]{{{shortest},{wide}}})$"


def _bound_child(key: str, value: Any, max_chars: int) -> Any:
    if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(
        value, dict
    ):
        return {name: bound_strings(sub, max_chars) for name, sub in value.items()}
    if key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "prefixItems"):
        return bound_strings(value, max_chars)
    return value


def _is_free_string(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    is_string = kind == "string" or (isinstance(kind, list) and "string" in kind)
    return is_string and not any(k in schema for k in ("enum", "const", "pattern", "format"))


def _free_strings(schema: Any) -> int:
    """How many free-text strings the shortest arguments hold (the required ones)."""
    if not isinstance(schema, dict):
        return 0
    if _is_free_string(schema):
        return 1
    required = set(schema.get("required", ()))
    props = schema.get("properties", {})
    return sum(_free_strings(props[name]) for name in required if name in props)


def _shortest_call(
    spec: tuple[str, Mapping[str, Any], str],
    count_head: Callable[[str], int],
    count_tokens: Callable[[str], int],
    arguments: Callable[[Any], tuple[str, int]],
) -> tuple[int, int]:
    """Tokens of the call with its shortest arguments, and the positions where the grammar
    lets whitespace in."""
    begin, schema, end = spec
    args, positions = arguments(schema)
    return count_head(begin) + count_tokens(args) + count_tokens(end), positions


def json_arguments(schema: Any) -> tuple[str, int]:
    """The shortest arguments as compact JSON, and the positions where the grammar lets
    whitespace in (inside each bracket, either side of each colon and comma; none around the
    whole value)."""
    args = json.dumps(shortest_instance(schema), separators=(",", ":"))
    return args, _json_positions(args)


def _json_positions(text: str) -> int:
    return sum(text.count(c) for c in "{}[]") + 2 * sum(text.count(c) for c in ":,")


def glm_xml_arguments(schema: Any) -> tuple[str, int]:
    """The shortest arguments as GLM-4.5 writes them: a newline after the tool's name, then
    `<arg_key>K</arg_key>`, a newline, `<arg_value>V</arg_value>` and a newline per argument,
    V raw where the parameter's type is a string (`glm_raw`) and compact JSON otherwise, whose
    whitespace positions are the only ones (the newlines are fixed)."""
    instance = shortest_instance(schema)
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    parts, positions = ["\n"], 0
    for key, value in (instance if isinstance(instance, dict) else {}).items():
        raw = glm_raw(props.get(key)) and isinstance(value, str)
        text = value if raw else json.dumps(value, separators=(",", ":"))
        positions += 0 if raw else _json_positions(text)
        parts.append(f"<arg_key>{key}</arg_key>\n<arg_value>{text}</arg_value>\n")
    return "".join(parts), positions


def glm_raw(schema: Any) -> bool:
    """Whether GLM-4.5's parser reads a parameter's value as raw text (its type a string,
    alone) rather than as JSON."""
    return isinstance(schema, dict) and schema.get("type") in ("string", ["string"])


def most_tokens(text: str, special: Mapping[str, int]) -> int:
    """The most tokens a model can spend writing `text` under the grammar: one per format
    marker (matched as its special token) and one per UTF-8 byte otherwise, since the grammar
    lets a byte-level tokenizer spell fixed text a byte a token (a trained model writes far
    fewer)."""
    count = len(text.encode())
    for marker in special:
        if marker in text:
            count -= text.count(marker) * (len(marker.encode()) - 1)
    return count


def held_head(text: str) -> tuple[str, str]:
    """A call's head past its opening marker, as the part held to the tokenizer's tokens and
    the whitespace after it, which stays characters: a tokenizer may spell that whitespace
    together with the arguments' first characters (`" {"`), and holding it apart would make
    the model write a spelling it never learnt."""
    held = text.rstrip()
    return held, text[len(held) :]


def head_tokens(text: str, special: Mapping[str, int], encode: Callable[[str], list[int]]) -> int:
    """The most tokens a call's head `text` takes when the grammar holds it to the tokenizer's
    tokens: its opening marker one, the rest as `encode` writes it (`held_head`), the
    whitespace after that a token a byte. A head without a marker to open it is characters
    (`most_tokens`)."""
    marker = next((m for m in special if text.startswith(m)), None)
    if marker is None:
        return most_tokens(text, special)
    held, loose = held_head(text[len(marker) :])
    return 1 + len(encode(held)) + len(loose.encode())


def shortest_instance(schema: Any) -> Any:
    """A short value the schema accepts (the required properties with their shortest values);
    a schema it cannot read gives {} (the call's reserve is then a little low, not wrong)."""
    if not isinstance(schema, dict):
        return {}
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return min(schema["enum"], key=lambda v: len(json.dumps(v)))
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            options = [shortest_instance(s) for s in schema[key]]
            return min(options, key=lambda v: len(json.dumps(v)))
    kind = schema.get("type", "object" if "properties" in schema else None)
    if isinstance(kind, list):
        kind = "null" if "null" in kind else (kind[0] if kind else None)
    if kind == "string":
        return "x" * int(schema.get("minLength", 0))
    if kind in ("integer", "number"):
        return schema.get("minimum", 0)
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    if kind == "array":
        return [shortest_instance(schema.get("items", {}))] * int(schema.get("minItems", 0))
    props = schema.get("properties", {})
    return {name: shortest_instance(props.get(name, {})) for name in schema.get("required", ())}
