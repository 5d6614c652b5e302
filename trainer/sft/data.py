"""Chat JSONL -> token ids with an assistant-only loss mask, and the order steps take them in.

Pure logic (no torch): the tokenizer is anything with transformers' `apply_chat_template`.

Each line is `{"messages": [...], "tools": [...]}` in OpenAI's chat format, rendered in the run's
chat format (`model.chat_format`, decided as a training run's gateway decides it). A format with
a `renderers` renderer of its own is rendered and masked by it (`renderer_mask.py`: 1 exactly
on the tokens the assistant samples, its turn-closing token included).

The generic format (`default`) is rendered once with the model's own chat template, which says
nothing of which tokens are sampled, so assistant message i's tokens are found by rendering
prefixes: `messages[:i]` with the generation prompt (where the model starts writing) and
`messages[:i+1]` (where its turn ends). Both must be exact token prefixes of the whole render;
a template that re-renders history (Qwen3's drops the <think> block of every turn before the
last user message) breaks that, and a mask from such renders would train tokens the model never
generates, so the conversation is an error naming its line. The mask is 1 from after the
generation prompt up to and including the end-of-turn token (the model must learn to stop), 0
on whatever the template adds after it and on every other message.

Tool-call arguments given as a JSON string are parsed into an object first, so the two forms
OpenAI clients produce render to the same tokens (the template's canonical JSON).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lockgate.trainer.sft.renderer_mask import GENERIC, format_renderer, render_with_sampled_mask

_ROLES: frozenset[str] = frozenset(("system", "user", "assistant", "tool"))


class ChatTokenizer(Protocol):
    """The part of a transformers tokenizer this module uses."""

    eos_token: str | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def convert_tokens_to_ids(self, tokens: str) -> Any: ...

    def decode(self, token_ids: Any, **kwargs: Any) -> str: ...


class ChatLine(BaseModel):
    """One JSONL line. Messages stay dicts: the template reads fields we do not model
    (`reasoning_content`, `name`, ...)."""

    model_config = ConfigDict(extra="ignore")
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages")
    @classmethod
    def _roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, m in enumerate(messages):
            if m.get("role") not in _ROLES:
                raise ValueError(f"message {i} has role {m.get('role')!r}, not one of {_ROLES}")
        return messages


@dataclass(frozen=True)
class Example:
    """One training sequence: `loss_mask[t]` is 1 where token t is trained on."""

    input_ids: list[int]
    loss_mask: list[int]
    line: int  # 1-based line of the JSONL file it came from


@dataclass
class DataStats:
    conversations: int = 0
    examples: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_untrained: int = 0  # no assistant token (left after truncation)
    tokens: int = 0
    trained_tokens: int = 0

    def summary(self, name: str) -> str:
        return (
            f"{name}: {self.examples} of {self.conversations} conversations, {self.tokens} "
            f"tokens ({self.trained_tokens} trained); {self.truncated} truncated, "
            f"{self.dropped_overlong} dropped as too long, {self.dropped_untrained} dropped "
            "without an assistant token"
        )


class TemplateMismatch(ValueError):
    """The chat template renders a conversation's prefix differently from the whole."""


def load_tokenizer(model_dir: Path) -> ChatTokenizer:
    from transformers import AutoTokenizer  # slow to import: only where tokenizing

    tokenizer: ChatTokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer


def end_of_turn_id(tokenizer: ChatTokenizer, token: str | None) -> int:
    """The id of `token`, or of the tokenizer's eos_token when None; a ValueError if unknown."""
    name = token if token is not None else tokenizer.eos_token
    if name is None:
        raise ValueError("the tokenizer has no eos_token: set data.end_of_turn")
    found = tokenizer.convert_tokens_to_ids(name)
    if not isinstance(found, int) or found < 0:
        raise ValueError(f"end-of-turn token {name!r} is not a single token of this tokenizer")
    return found


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages with tool-call arguments as objects (JSON strings parsed)."""
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [_parsed_call(call, i) for call in message["tool_calls"]]
        out.append(message)
    return out


def _parsed_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    function = call.get("function", call)
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ValueError(f"message {index}: tool call arguments are not JSON: {exc}") from None
    function = {**function, "arguments": parsed}
    return {**call, "function": function} if "function" in call else function


def _render(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    generation_prompt: bool,
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=True,
        add_generation_prompt=generation_prompt,
        return_dict=False,
    )
    return list(ids)


def _check_prefix(
    tokenizer: ChatTokenizer, prefix: list[int], full: list[int], index: int, what: str
) -> None:
    if full[: len(prefix)] == prefix:
        return
    at = next(
        (k for k, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b),
        min(len(prefix), len(full)),
    )
    raise TemplateMismatch(
        f"message {index} (assistant): the chat template renders {what} differently from the "
        f"whole conversation (it re-renders history), so the loss mask would be wrong; at token "
        f"{at} the prefix has {tokenizer.decode(prefix[at : at + 12])!r}, the whole "
        f"{tokenizer.decode(full[at : at + 12])!r}. A model whose format `renderers` knows "
        "is masked by its renderer: set model.chat_format to it"
    )


def render_with_mask(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    eot_id: int,
) -> tuple[list[int], list[int]]:
    """The conversation's token ids and its assistant-only loss mask (see the module doc)."""
    messages = normalize_messages(messages)
    full = _render(tokenizer, messages, tools, generation_prompt=False)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("message 0 is an assistant message: nothing comes before it")
        start = _render(tokenizer, messages[:i], tools, generation_prompt=True)
        _check_prefix(tokenizer, start, full, i, "the messages before it plus the prompt")
        through = _render(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        _check_prefix(tokenizer, through, full, i, "the conversation up to it")
        span = full[len(start) : len(through)]
        if eot_id not in span:
            raise ValueError(
                f"message {i} (assistant): its turn has no end-of-turn token "
                f"{tokenizer.decode([eot_id])!r} (set data.end_of_turn)"
            )
        end = len(start) + len(span) - span[::-1].index(eot_id)
        mask[len(start) : end] = [1] * (end - len(start))
    return full, mask


# A conversation's messages and tools -> its token ids and loss mask.
Masker = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], tuple[list[int], list[int]]]


def chat_masker(tokenizer: ChatTokenizer, chat_format: str, end_of_turn: str | None) -> Masker:
    """How a run's conversations become ids and a loss mask: by the format's renderer, or by
    the model's template for the generic format (see the module doc)."""
    if chat_format == GENERIC:
        eot = end_of_turn_id(tokenizer, end_of_turn)
        return partial(render_with_mask, tokenizer, eot_id=eot)
    if end_of_turn is not None:
        raise ValueError(
            f"data.end_of_turn is for the generic template format only: the '{chat_format}' "
            "renderer marks the tokens that close its assistant turns itself"
        )
    return partial(_mask_by_renderer, format_renderer(tokenizer, chat_format))


def _mask_by_renderer(
    renderer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[int], list[int]]:
    return render_with_sampled_mask(renderer, normalize_messages(messages), tools)


def _raw_lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open() as f:
        for number, text in enumerate(f, start=1):
            if text.strip():
                yield number, text


def _parse_line(path: Path, number: int, text: str) -> ChatLine:
    """The line as a ChatLine; a ValueError naming the line."""
    try:
        return ChatLine.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{path} line {number}: {where}: {first['msg']}") from None


Rendered = tuple[int, list[int], list[int]]  # line number, token ids, loss mask


def _render_line(masker: Masker, path: Path, number: int, text: str) -> Rendered:
    line = _parse_line(path, number, text)
    try:
        ids, mask = masker(line.messages, line.tools)
    except ValueError as exc:
        raise type(exc)(f"{path} line {number}: {exc}") from None
    return number, ids, mask


# A forked worker's masker (its tokenizer, renderer), inherited from the parent (never pickled).
_worker: Masker | None = None


def _start_worker(masker: Masker) -> None:
    global _worker
    _worker = masker


def _render_chunk(path: Path, chunk: list[tuple[int, str]]) -> list[Rendered]:
    assert _worker is not None
    return [_render_line(_worker, path, number, text) for number, text in chunk]


# Lines a worker renders at a time, and the fewest lines worth starting workers for.
_CHUNK = 256
_PARALLEL_FROM = 1024


def _rendered(path: Path, masker: Masker, workers: int) -> Iterator[Rendered]:
    """Every non-blank line rendered, in file order; across `workers` forked processes when
    the file is long enough (rendering is jinja and the tokenizer, CPU-bound Python; measured
    in docs/performance.md, "Trainer")."""
    lines = list(_raw_lines(path))
    if workers <= 1 or len(lines) < _PARALLEL_FROM or "fork" not in get_all_start_methods():
        for number, text in lines:
            yield _render_line(masker, path, number, text)
        return
    chunks = [lines[i : i + _CHUNK] for i in range(0, len(lines), _CHUNK)]
    with ProcessPoolExecutor(
        workers,
        mp_context=get_context("fork"),
        initializer=_start_worker,
        initargs=(masker,),
    ) as pool:
        for rendered in pool.map(partial(_render_chunk, path), chunks):
            yield from rendered


def tokenize_file(
    path: Path,
    tokenizer: ChatTokenizer,
    *,
    chat_format: str,
    max_length: int,
    overlong: Literal["truncate", "drop"],
    end_of_turn: str | None,
    workers: int = 1,
) -> tuple[list[Example], DataStats]:
    """Every conversation of `path` as an Example in `chat_format` (a resolved `renderers`
    name), in file order, and what was cut or left out; rendered by `workers` processes
    (forked, sharing the tokenizer) on long files."""
    masker = chat_masker(tokenizer, chat_format, end_of_turn)
    examples: list[Example] = []
    stats = DataStats()
    for number, ids, mask in _rendered(path, masker, workers):
        stats.conversations += 1
        if len(ids) > max_length:
            if overlong == "drop":
                stats.dropped_overlong += 1
                continue
            stats.truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            stats.dropped_untrained += 1
            continue
        examples.append(Example(ids, mask, number))
        stats.examples += 1
        stats.tokens += len(ids)
        stats.trained_tokens += sum(mask)
    return examples, stats


def write_examples(examples: Sequence[Example], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        for e in examples:
            f.write(json.dumps({"line": e.line, "input_ids": e.input_ids, "mask": e.loss_mask}))
            f.write("\n")
    tmp.replace(path)


def read_examples(path: Path) -> list[Example]:
    with path.open() as f:
        rows = [json.loads(text) for text in f if text.strip()]
    return [Example(r["input_ids"], r["mask"], r["line"]) for r in rows]


@dataclass(frozen=True)
class StepPlan:
    epoch: int  # 1-based
    indices: list[int]  # into the examples


def plan_steps(
    lengths: Sequence[int],
    *,
    batch_size: int,
    batch_unit: Literal["conversations", "tokens"],
    epochs: int,
    shuffle: bool,
    seed: int,
) -> list[StepPlan]:
    """Every optimizer step of the run, in order: a pure function of its arguments, so a
    resumed run recomputes the same plan and takes up at the step after its checkpoint."""
    steps: list[StepPlan] = []
    for epoch in range(1, epochs + 1):
        order = list(range(len(lengths)))
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(order)
        for batch in _batches(order, lengths, batch_size, batch_unit):
            steps.append(StepPlan(epoch, batch))
    return steps


def _batches(order: list[int], lengths: Sequence[int], size: int, unit: str) -> Iterator[list[int]]:
    if unit == "conversations":
        for start in range(0, len(order), size):
            yield order[start : start + size]
        return
    batch: list[int] = []
    tokens = 0
    for i in order:
        if batch and tokens + lengths[i] > size:
            yield batch
            batch, tokens = [], 0
        batch.append(i)
        tokens += lengths[i]
    if batch:
        yield batch
