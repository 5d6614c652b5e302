"""The scripted oracle: search the entity, read its document, answer; and the SFT transcripts.

The oracle knows which entity a synthetic question starts from and which facts to read (its
kind), but nothing else: it searches like the agent does, must find the entity's document among
the top-k hits and reads each fact off the text, so a 2-hop question's second search uses what
the first one found. Its success rate is the ceiling retrieval leaves for the agent.

The same run, written as chat messages (the agent's system prompt and tools, a short reasoning
per turn, the tool calls and the tool results as they came back), is the supervised warm start:
exactly the conversation the agent would have had, so `lockgate sft` teaches the format and the
RL phase starts from a policy that already searches.

The first reasoning says how many searches the question needs ("I need two searches."). Without
it, whether to search again or answer is decided after reading a fact ("X works for Y."), many
tokens after the question's wording that tells a 1-hop question from a 2-hop one; the 3.5M
model did not tie that decision to the question, and RL, rewarded mostly on 1-hop questions,
made it answer 2-hop ones after the first search (EXPERIMENTS.md). Said up front, the count is
read where the question is still close, and the later decision can look back at it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pydantic import BaseModel

from lockgate.examples.deepresearch.agent import SYSTEM_PROMPT, TOOLS, AgentConfig, format_hits
from lockgate.examples.deepresearch.questions import Question
from lockgate.examples.deepresearch.retrieval.client import Hit

Search = Callable[[str, int], Awaitable[list[Hit]]]

_PLANS = {1: "I need one search.", 2: "I need two searches."}  # words the tokenizer holds

# What a fact looks like in a document, and how the oracle says it in its reasoning.
_FACTS: dict[str, tuple[re.Pattern[str], str]] = {
    "birthplace": (re.compile(r"born in \d+ in ([^.]+)\."), "{} was born in {}."),
    "birth_year": (re.compile(r"born in (\d+)"), "{} was born in {}."),
    "employer": (re.compile(r"works for ([^.]+)\."), "{} works for {}."),
    "headquarters": (re.compile(r"headquartered in ([^.]+)\."), "{} is headquartered in {}."),
    "founded": (re.compile(r"founded in (\d+)"), "{} was founded in {}."),
    "city_country": (re.compile(r"is a city in ([^.]+)\."), "{} is in {}."),
}

# The facts each question kind reads, in order; each one's value is the next search.
KIND_FACTS: dict[str, tuple[str, ...]] = {
    "birthplace": ("birthplace",),
    "birth_year": ("birth_year",),
    "employer": ("employer",),
    "headquarters": ("headquarters",),
    "founded": ("founded",),
    "city_country": ("city_country",),
    "birth_country": ("birthplace", "city_country"),
    "employer_hq": ("employer", "headquarters"),
    "employer_founded": ("employer", "founded"),
    "hq_country": ("headquarters", "city_country"),
}


class OracleRun(BaseModel):
    answer: str | None
    messages: list[dict[str, Any]]
    searches: int
    failure: str | None = None


def _kind(question: Question) -> str:
    kind = question.source.rsplit("/", 1)[-1]
    if kind not in KIND_FACTS or not question.chain:
        raise ValueError(f"question {question.id} is not a synthetic one the oracle can follow")
    return kind


def _tool_turn(reasoning: str, n: int, query: str, result: str) -> list[dict[str, Any]]:
    call_id = f"call_{n}"
    arguments = json.dumps({"query": query}, ensure_ascii=False)
    return [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": reasoning,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "search", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


async def run_oracle(question: Question, search: Search, config: AgentConfig) -> OracleRun:
    """Follow the question's kind through the search results; the messages a transcript holds."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question.question},
    ]
    entity = question.chain[0].entity
    facts = KIND_FACTS[_kind(question)]
    reasoning, said = f"{_PLANS[len(facts)]} I need to find {entity}.", ""
    for n, fact in enumerate(facts):
        hits = await search(entity, config.topk)
        messages += _tool_turn(reasoning, n, entity, format_hits(hits, config.doc_chars))
        page = next((h for h in hits if h.title == entity), None)
        if page is None:
            return OracleRun(answer=None, messages=messages, searches=n + 1, failure="not found")
        pattern, say = _FACTS[fact]
        found = pattern.search(page.text)
        if found is None:
            return OracleRun(answer=None, messages=messages, searches=n + 1, failure="no fact")
        value = found.group(1).strip()
        said = say.format(entity, value)
        entity, reasoning = value, f"{said} I need to find {value}."
    messages.append(
        {
            "role": "assistant",
            "content": f"<answer>{entity}</answer>",
            "reasoning_content": said,
        }
    )
    return OracleRun(answer=entity, messages=messages, searches=n + 1)


def transcript_line(run: OracleRun) -> str:
    """One line of the chat JSONL `lockgate sft` reads."""
    return json.dumps({"messages": run.messages, "tools": TOOLS}, ensure_ascii=False)


async def oracle_transcripts(
    questions: Sequence[Question], search: Search, config: AgentConfig
) -> list[OracleRun]:
    """The oracle's runs that reached the gold answer (the others teach nothing right)."""
    runs = []
    for question in questions:
        run = await run_oracle(question, search, config)
        if run.answer is not None and run.answer in question.golden_answers:
            runs.append(run)
    return runs
