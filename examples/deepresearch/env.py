"""The DeepResearch environment for `lockgate train`: tasks, the agent, the retrieval service.

Config (`environment.args`, all optional):
- `kb_dir`: the knowledge base directory; unset builds the CPU one (`data.build_cpu_kb`) in the
  cache. `corpus`, `train_questions`, `heldout_questions` point at other files instead (the GPU
  recipe's wiki corpus and NQ / HotpotQA questions).
- `retrieval_url`: a retrieval service that already runs; unset starts one on the corpus (a
  child process, stopped with the run).
- `num_train`, `num_val`: how many questions to use (val = held-out questions, validated greedily
  every `loop.val_every` steps).
- `train_hops`: train only on questions of these hop counts (e.g. `[1]`, a curriculum); held-out
  validation keeps every question.
- `fresh_train_worlds`: train on this many questions over fresh worlds instead, each searched in
  its own in-process index (`fresh_worlds.py`); validation keeps the held-out world.
- `fresh_world`: those worlds' sizes (`WorldSizes` fields: people, organisations, cities,
  countries; default 60/15/12/4; the held-out world is 300/60/40/8). In a world of 4 countries
  a guess answers a country question one time in four; on held-out-sized worlds RL still
  learnt to skip the second search (EXPERIMENTS.md), so that is not why it does.
- `fresh_two_hop_share`: the share of 2-hop questions among them (default 0.5, as the held-out
  split). RL's positive advantages come mostly from 1-hop questions, which succeed more often;
  a larger share gives 2-hop groups (and the second search they need) more of the update. At
  0.75 (run F) 1-hop questions got second searches too; the recipe keeps 0.5.
- `fresh_distractors`: search each fresh world together with the knowledge base's training
  worlds (~9,000 documents), as the held-out world is searched; off, a world is searched alone.
- `agent`: the agent's settings (`AgentConfig`: max_turns, topk, max_tokens, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from lockgate.agent_runtime import Agent, RolloutContext, Task
from lockgate.agent_runtime.connections import shared_transport
from lockgate.examples.deepresearch.agent import AgentConfig, Episode, Tools, run_episode
from lockgate.examples.deepresearch.data import (
    CORPUS,
    HELDOUT,
    TRAIN,
    build_cpu_kb,
    load_questions,
    training_world_documents,
)
from lockgate.examples.deepresearch.fresh_worlds import (
    FRESH_WORLD,
    WORLD_SEED,
    WorldRetrievals,
    fresh_world_tasks,
)
from lockgate.examples.deepresearch.questions import Question
from lockgate.examples.deepresearch.retrieval.client import RetrievalClient
from lockgate.examples.deepresearch.retrieval.launcher import RetrievalService
from lockgate.examples.deepresearch.serving import start_retrieval
from lockgate.examples.deepresearch.world import WorldSizes
from lockgate.trainer.tiny_models.builder import default_cache_dir


def question_task(q: Question) -> Task:
    data = {"question": q.question, "golden_answers": q.golden_answers, "hops": q.hops}
    return Task(id=q.id, data=data)


async def task_episode(
    task: Task, ctx: RolloutContext, tools: Tools, config: AgentConfig
) -> Episode:
    """One episode of the agent on a question task, through the rollout's session."""
    async with ctx.openai_client(max_retries=0) as client:
        return await run_episode(
            client, ctx.model, task.data["question"], task.data["golden_answers"], tools, config
        )


class DeepResearchEnvironment:
    def __init__(
        self,
        model_dir: Path,
        *,
        kb_dir: Path | None = None,
        corpus: Path | None = None,
        train_questions: Path | None = None,
        heldout_questions: Path | None = None,
        retrieval_url: str | None = None,
        num_train: int | None = None,
        num_val: int | None = None,
        train_hops: Sequence[int] | None = None,
        fresh_train_worlds: int | None = None,
        fresh_world: dict[str, int] | None = None,
        fresh_two_hop_share: float = 0.5,
        fresh_distractors: bool = False,
        agent: dict[str, Any] | None = None,
        log_dir: Path | None = None,
    ) -> None:
        kb: Path | None = None
        if kb_dir is not None:
            kb = Path(kb_dir)
        elif not (corpus and train_questions and heldout_questions):
            kb = build_cpu_kb(default_cache_dir() / "deepresearch-kb")
        self.corpus = Path(corpus) if corpus else _in(kb, CORPUS)
        train = load_questions(Path(train_questions or _in(kb, TRAIN)))
        if train_hops is not None:
            train = [q for q in train if q.hops in set(train_hops)]
        self._train = train[:num_train]
        sizes = WorldSizes(**fresh_world) if fresh_world else FRESH_WORLD
        self._fresh = (
            fresh_world_tasks(fresh_train_worlds, sizes=sizes, two_hop_share=fresh_two_hop_share)
            if fresh_train_worlds
            else None
        )
        distractors: list[dict[str, str]] = []
        if fresh_distractors:
            if kb is None:
                raise ValueError("fresh_distractors needs a CPU knowledge base (kb_dir)")
            distractors = training_world_documents(kb)
        self.worlds = WorldRetrievals(sizes=sizes, distractors=distractors)
        self._val = load_questions(Path(heldout_questions or _in(kb, HELDOUT)), num_val)
        self.agent_config = AgentConfig.model_validate(agent or {})
        if retrieval_url is not None:
            self.service = RetrievalService.external(retrieval_url)
        else:
            self.service = start_retrieval(self.corpus, log_dir or Path("logs"))
        self.retrieval = RetrievalClient(self.service.url)

    def train_tasks(self) -> Sequence[Task]:
        if self._fresh is not None:
            return self._fresh
        return [question_task(q) for q in self._train]

    def val_tasks(self) -> Sequence[Task]:
        return [question_task(q) for q in self._val]

    @property
    def agent(self) -> Agent:
        config, tools = self.agent_config, Tools(self.retrieval, self.agent_config)
        worlds = self.worlds

        async def research(task: Task, ctx: RolloutContext) -> float:
            seed = task.data.get(WORLD_SEED)
            here = tools if seed is None else Tools(await worlds.get(seed), config)
            episode = await task_episode(task, ctx, here, config)
            await _record(ctx, episode.metadata())
            return episode.score.reward

        return research

    @property
    def reward(self) -> None:
        return None  # the agent returns its F1

    def close(self) -> None:
        self.service.stop()
        self.worlds.close()


def _in(kb: Path | None, name: str) -> Path:
    assert kb is not None  # set whenever a file of it is not given
    return kb / name


async def _record(ctx: RolloutContext, metadata: dict[str, Any]) -> None:
    """The episode's outcome (tool errors, how it ended, EM and F1) in the session's metadata."""
    # The run's shared connection pool, as the agent's own OpenAI client uses.
    async with httpx.AsyncClient(transport=shared_transport(), timeout=30.0) as http:
        response = await http.post(
            f"{ctx.base_url.removesuffix('/v1')}/metadata",
            json={"metadata": metadata},
            headers={"Authorization": f"Bearer {ctx.api_key}"},
        )
        response.raise_for_status()


def make_environment(
    model_dir: Path, log_dir: Path | None = None, **args: Any
) -> DeepResearchEnvironment:
    return DeepResearchEnvironment(model_dir, log_dir=log_dir, **args)
