"""The DeepResearch agent, driven through lockgate's gateway by a scripted replica.

The replica answers each call with the next scripted completion (token ids of the tiny model's
tokenizer), so the episode is exactly known: the tool calls the agent makes, the tool messages
it sends back, the guards that end it, the reward, and what the gateway recorded (calls, the
tool result as a `tool` turn, one merged training sample per rollout).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from lockgate.examples.deepresearch.agent import AgentConfig, Episode, Tools, run_episode
from lockgate.examples.deepresearch.retrieval.index import BM25Index, Hit
from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica, serve_gateway

CORPUS = [
    {
        "id": "d1",
        "contents": '"Kaven Lomos"\nKaven Lomos was born in Bramholt. He works for Quel Group.',
    },
    {"id": "d2", "contents": '"Quel Group"\nQuel Group is headquartered in Tarport.'},
    {"id": "d3", "contents": '"Lomos Venkar"\nLomos Venkar was born in Tarport.'},
]


class LocalRetrieval:
    """The real BM25 index in-process, with the retrieval client's surface."""

    def __init__(self, index: BM25Index) -> None:
        self.index = index
        self.queries: list[str] = []

    async def search(self, query: str, topk: int = 3) -> list[Hit]:
        self.queries.append(query)
        return self.index.search_batch([query], topk)[0]

    async def document(self, doc_id: str) -> Hit | None:
        return self.index.document(doc_id)


@dataclass
class ScriptedReplica(FakeReplica):
    """Answers the n-th generate request with the n-th scripted completion."""

    script: list[list[int]] = field(default_factory=list)

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/inference/v1/generate":
            self.completion = self.script[len(self.requests)]
        return super().handler(request)


@pytest.fixture(scope="module")
def retrieval_index(tmp_path_factory: pytest.TempPathFactory) -> BM25Index:
    root = tmp_path_factory.mktemp("dr-corpus")
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
    return BM25Index.build(root / "corpus.jsonl", root / "index")


@dataclass
class Rig:
    gateway: httpx.AsyncClient
    replica: ScriptedReplica
    retrieval: LocalRetrieval
    tokens: Any

    def say(self, text: str) -> list[int]:
        """A completion as the model would emit it: the text, then end of turn."""
        return self.tokens.encode(text, add_special_tokens=False) + [
            self.tokens.convert_tokens_to_ids("<|im_end|>")
        ]

    async def episode(self, script: list[str], config: AgentConfig) -> tuple[Episode, str]:
        self.replica.script = [self.say(t) for t in script]
        r = await self.gateway.post("/admin/sessions", json={"task_id": "q"}, headers=_admin())
        session = r.json()
        client = AsyncOpenAI(
            base_url=f"http://gw{session['base_url']}",
            api_key=session["api_key"],
            http_client=self.gateway,
            max_retries=0,
        )
        tools = Tools(self.retrieval, config)
        episode = await run_episode(
            client,
            "m",
            "Where is the employer of Kaven Lomos headquartered?",
            ["Tarport"],
            tools,
            config,
        )
        return episode, session["session_id"]

    async def admin(self, path: str) -> Any:
        r = await self.gateway.get(path, headers=_admin())
        assert r.status_code == 200, r.text
        return r.json()


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def _call(query: str, reasoning: str = "Searching.") -> str:
    arguments = json.dumps({"query": query})
    return (
        f"<think>\n{reasoning}\n</think>\n\n<tool_call>\n"
        f'{{"name": "search", "arguments": {arguments}}}\n</tool_call>'
    )


ANSWER = "<think>\nQuel Group is headquartered in Tarport.\n</think>\n\n<answer>Tarport</answer>"


@pytest.fixture
async def rig(
    tiny_model_dir: Path, tmp_path: Path, retrieval_index: BM25Index
) -> AsyncIterator[Rig]:
    from transformers import AutoTokenizer

    replica = ScriptedReplica(completion=[])
    async with serve_gateway(tiny_model_dir, tmp_path, {REPLICA: replica}, max_model_len=2048) as (
        client,
        _,
    ):
        yield Rig(
            client,
            replica,
            LocalRetrieval(retrieval_index),
            AutoTokenizer.from_pretrained(str(tiny_model_dir)),
        )


async def test_a_two_hop_episode_is_one_recorded_sample_with_tool_turns(rig: Rig) -> None:
    config = AgentConfig(max_turns=4)
    episode, sid = await rig.episode([_call("Kaven Lomos"), _call("Quel Group"), ANSWER], config)

    assert episode.ended == "answered" and episode.answer == "Tarport"
    assert episode.score.reward == 1.0 and episode.score.em == 1.0
    assert [(t.name, json.loads(t.arguments)) for t in episode.tool_calls] == [
        ("search", {"query": "Kaven Lomos"}),
        ("search", {"query": "Quel Group"}),
    ]
    assert rig.retrieval.queries == ["Kaven Lomos", "Quel Group"]

    calls = (await rig.admin(f"/admin/sessions/{sid}/calls"))["calls"]
    assert len(calls) == 3
    # The second call carries the first result back as a tool message answering the call's id.
    sent = calls[1]["request"]["messages"]
    first_call = sent[2]["tool_calls"][0]
    assert sent[2]["role"] == "assistant" and first_call["function"]["name"] == "search"
    assert sent[3]["role"] == "tool" and sent[3]["tool_call_id"] == first_call["id"]
    assert sent[3]["content"].startswith("[d1] Kaven Lomos: Kaven Lomos was born in Bramholt.")
    # Each prompt extends the previous prompt + completion: one training sample, no split.
    for before, after in itertools.pairwise(calls):
        assert after["prompt_ids"][: len(before["prompt_ids"]) + len(before["completion_ids"])] == (
            before["prompt_ids"] + before["completion_ids"]
        )
    samples = await rig.admin(f"/admin/sessions/{sid}/samples")
    assert len(samples["samples"]) == 1
    assert (await rig.admin(f"/admin/sessions/{sid}"))["rerender_splits"] == 0


async def test_a_repeated_identical_call_ends_the_episode_with_reward_0(rig: Rig) -> None:
    episode, _ = await rig.episode(
        [_call("Kaven Lomos"), _call("Kaven Lomos"), ANSWER], AgentConfig(max_turns=4)
    )
    assert episode.ended == "repeated_call"
    assert episode.score.reward == 0.0 and episode.answer is None
    assert rig.retrieval.queries == ["Kaven Lomos"]  # the repeat was never run


async def test_too_many_tool_calls_end_the_episode_with_reward_0(rig: Rig) -> None:
    script = [_call("Kaven Lomos"), _call("Quel Group"), _call("Tarport"), ANSWER]
    episode, _ = await rig.episode(script, AgentConfig(max_turns=6, max_tool_calls=2))
    assert episode.ended == "too_many_calls" and episode.score.reward == 0.0
    assert len(rig.retrieval.queries) == 2


async def test_no_answer_within_max_turns_scores_0(rig: Rig) -> None:
    episode, _ = await rig.episode(
        [_call("Kaven Lomos"), _call("Quel Group")], AgentConfig(max_turns=2)
    )
    assert episode.ended == "max_turns" and episode.score.reward == 0.0


async def test_a_tool_error_is_recorded_and_answered_not_raised(rig: Rig) -> None:
    bad_call = '<tool_call>\n{"name": "search", "arguments": {"query": ""}}\n</tool_call>'
    script = [bad_call, _call("Quel Group"), ANSWER]
    episode, sid = await rig.episode(script, AgentConfig(max_turns=4))
    assert episode.ended == "answered" and episode.score.reward == 1.0
    assert episode.tool_errors == ["search: search needs a non-empty string `query`"]
    assert episode.metadata()["tool_errors"] == episode.tool_errors
    calls = (await rig.admin(f"/admin/sessions/{sid}/calls"))["calls"]
    assert calls[1]["request"]["messages"][3]["content"].startswith("Error: search needs")


async def test_an_unreachable_retrieval_service_is_a_tool_error() -> None:
    from lockgate.examples.deepresearch.retrieval.client import RetrievalClient

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with RetrievalClient("http://retrieval", transport=httpx.MockTransport(refuse)) as r:
        text, error = await Tools(r, AgentConfig()).run("search", '{"query": "x"}')
    assert error is not None and "retrieval failed" in error
    assert text.startswith("Error: retrieval failed")


async def test_unknown_tools_and_bad_arguments_are_tool_errors(
    retrieval_index: BM25Index,
) -> None:
    tools = Tools(LocalRetrieval(retrieval_index), AgentConfig())
    assert (await tools.run("browse", "{}"))[1] == "unknown tool 'browse'"
    assert "not valid JSON" in str((await tools.run("search", "{query"))[1])
    assert (await tools.run("open", '{"id": "nope"}'))[1] == "no document with id nope"
    text, error = await tools.run("open", '{"id": "d2"}')
    assert error is None and text == "[d2] Quel Group: Quel Group is headquartered in Tarport."
