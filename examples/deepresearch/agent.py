"""The DeepResearch agent: plain OpenAI SDK, `search` and `open` function tools, F1 reward.

It runs unchanged against any OpenAI-compatible endpoint: the gateway of a training run (a
session URL and key), a `lockgate` gateway serving for evaluation, or a plain vLLM server
started with tool parsing (`--enable-auto-tool-choice --tool-call-parser hermes`):

    python -m lockgate.examples.deepresearch.agent --base-url URL --model NAME \\
        --retrieval-url http://127.0.0.1:8000 "Where was Kaven Lomos born?"

One episode: the question as the user turn, then up to `max_turns` model calls; each tool call
is answered with a `tool` message (the retrieval service's top-k documents, or a document by
id), and a message without tool calls ends the episode with its `<answer>...</answer>`. Guards:
a tool call repeating an earlier one exactly, or more than `max_tool_calls` calls, ends the
episode with reward 0; a failed or malformed tool call is answered with an error text and
recorded in the episode (and the session's metadata), never raised.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, Field

from lockgate.examples.deepresearch.retrieval.client import (
    Hit,
    RetrievalClient,
    RetrievalError,
)
from lockgate.examples.deepresearch.reward import Score, extract_answer, score, shows_answer

if TYPE_CHECKING:
    from openai import AsyncOpenAI

SYSTEM_PROMPT = (
    "Answer the question. Use the search tool to look facts up; do not guess. "
    "Give the final answer as <answer>...</answer>."
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the knowledge base; returns the top documents.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "open",
            "description": "Read a whole document by its id.",
            "parameters": {
                "type": "object",
                "properties": {"id": {"type": "string"}},
                "required": ["id"],
            },
        },
    },
]

Ending = Literal["answered", "no_answer", "repeated_call", "too_many_calls", "max_turns"]


class AgentConfig(BaseModel):
    max_turns: int = Field(default=4, ge=1, description="Model calls per episode at most.")
    max_tool_calls: int = Field(default=4, ge=1, description="More tool calls end with reward 0.")
    topk: int = Field(default=3, ge=1, le=100, description="Documents per search.")
    max_tokens: int = Field(default=96, ge=1, description="Completion tokens per model call.")
    doc_chars: int = Field(default=400, ge=20, description="A document's text shown, at most.")
    format_weight: float = Field(default=0.0, ge=0, le=1, description="Reward for the form.")
    evidence_weight: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Reward for a tool result that showed a gold answer (reward.py).",
    )
    temperature: float | None = Field(
        default=None, description="Sent with each call; None leaves it to the server."
    )


class ToolEvent(BaseModel):
    name: str
    arguments: str
    error: str | None = None


class Episode(BaseModel):
    answer: str | None
    score: Score
    ended: Ending
    turns: int
    tool_calls: list[ToolEvent]

    @property
    def tool_errors(self) -> list[str]:
        return [f"{t.name}: {t.error}" for t in self.tool_calls if t.error]

    def metadata(self) -> dict[str, Any]:
        """What the session records about the episode (tool errors, how it ended)."""
        return {
            "ended": self.ended,
            "turns": self.turns,
            "tool_calls": len(self.tool_calls),
            "tool_errors": self.tool_errors,
            "answer": self.answer,
            "f1": self.score.f1,
            "em": self.score.em,
        }


def format_hits(hits: Sequence[Hit], doc_chars: int) -> str:
    if not hits:
        return "No results."
    return "\n".join(f"[{h.id}] {h.title}: {h.text[:doc_chars]}" for h in hits)


class Retrieval(Protocol):
    """What the tools need of a retrieval service (`RetrievalClient` is the HTTP one)."""

    async def search(self, query: str, topk: int = 3) -> list[Hit]: ...

    async def document(self, doc_id: str) -> Hit | None: ...


class Tools:
    """Runs the agent's tool calls against a retrieval service; errors become tool output."""

    def __init__(self, retrieval: Retrieval, config: AgentConfig) -> None:
        self.retrieval, self.config = retrieval, config

    async def run(self, name: str, arguments: str) -> tuple[str, str | None]:
        """The tool message's text and the error (None when the call worked)."""
        try:
            args = json.loads(arguments or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        except ValueError as exc:
            return self._error(f"arguments are not valid JSON: {exc}")
        try:
            if name == "search":
                query = args.get("query")
                if not isinstance(query, str) or not query.strip():
                    return self._error("search needs a non-empty string `query`")
                hits = await self.retrieval.search(query, self.config.topk)
                return format_hits(hits, self.config.doc_chars), None
            if name == "open":
                doc_id = args.get("id")
                if not isinstance(doc_id, str) or not doc_id:
                    return self._error("open needs a string `id`")
                hit = await self.retrieval.document(doc_id)
                if hit is None:
                    return self._error(f"no document with id {doc_id}")
                return f"[{hit.id}] {hit.title}: {hit.text}", None
        except RetrievalError as exc:
            return self._error(f"retrieval failed: {exc}")
        return self._error(f"unknown tool {name!r}")

    @staticmethod
    def _error(message: str) -> tuple[str, str]:
        return f"Error: {message}", message


def _assistant_message(message: Any) -> dict[str, Any]:
    calls = [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.function.name, "arguments": c.function.arguments},
        }
        for c in message.tool_calls or []
    ]
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if calls:
        out["tool_calls"] = calls
    return out


async def run_episode(
    client: AsyncOpenAI,
    model: str,
    question: str,
    gold: Sequence[str],
    tools: Tools,
    config: AgentConfig,
) -> Episode:
    """One episode of the agent on `question`, scored against `gold`."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    events: list[ToolEvent] = []
    seen: set[tuple[str, str]] = set()
    evidence = False
    extra = {} if config.temperature is None else {"temperature": config.temperature}
    for turn in range(1, config.max_turns + 1):
        response = await client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=config.max_tokens, **extra
        )
        message = response.choices[0].message
        messages.append(_assistant_message(message))
        if not message.tool_calls:
            answer = extract_answer(message.content)
            ending: Ending = "answered" if answer is not None else "no_answer"
            return Episode(
                answer=answer,
                score=score(
                    answer,
                    gold,
                    format_weight=config.format_weight,
                    evidence_weight=config.evidence_weight,
                    evidence=evidence,
                ),
                ended=ending,
                turns=turn,
                tool_calls=events,
            )
        for call in message.tool_calls:
            key = (call.function.name, call.function.arguments)
            if key in seen or len(events) >= config.max_tool_calls:
                events.append(ToolEvent(name=key[0], arguments=key[1]))
                return _failed("repeated_call" if key in seen else "too_many_calls", turn, events)
            seen.add(key)
            text, error = await tools.run(*key)
            evidence = evidence or (error is None and shows_answer(text, gold))
            events.append(ToolEvent(name=key[0], arguments=key[1], error=error))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return _failed("max_turns", config.max_turns, events)


def _failed(ending: Ending, turns: int, events: list[ToolEvent]) -> Episode:
    return Episode(
        answer=None,
        score=score(None, ()),
        ended=ending,
        turns=turns,
        tool_calls=events,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lockgate.examples.deepresearch.agent",
        description="Run the DeepResearch agent once against any OpenAI-compatible endpoint.",
    )
    parser.add_argument("question")
    parser.add_argument("--base-url", required=True, help="OpenAI-compatible base URL (…/v1)")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--model", required=True)
    parser.add_argument("--retrieval-url", required=True, help="the retrieval service's URL")
    parser.add_argument("--gold", action="append", default=[], help="a gold answer (repeatable)")
    parser.add_argument("--temperature", type=float, default=None)
    args = parser.parse_args(argv)
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    from openai import AsyncOpenAI

    config = AgentConfig(temperature=args.temperature)
    async with (
        AsyncOpenAI(base_url=args.base_url, api_key=args.api_key) as client,
        RetrievalClient(args.retrieval_url) as retrieval,
    ):
        episode = await run_episode(
            client, args.model, args.question, args.gold, Tools(retrieval, config), config
        )
    print(json.dumps({"reward": episode.score.reward, **episode.metadata()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
