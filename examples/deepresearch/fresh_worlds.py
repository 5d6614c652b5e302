"""Training questions over fresh worlds, each searched in its own in-process BM25 index.

RL over a fixed training split, even one of 100 small worlds, raised the training reward while
held-out success fell (EXPERIMENTS.md): a run meets the same cities and countries again and
again and can learn them. Here every training question comes from a world no earlier question
used (as the SFT transcripts do, prepare.py), and the agent searches that world alone, so
nothing but reading can raise the reward. Validation keeps the knowledge base's held-out world
and its retrieval service.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from lockgate.agent_runtime import Task
from lockgate.examples.deepresearch.data import write_jsonl
from lockgate.examples.deepresearch.questions import generate_questions
from lockgate.examples.deepresearch.retrieval.index import BM25Index, Hit
from lockgate.examples.deepresearch.world import World, WorldSizes, generate_world

# A world per few questions: enough people that names share words (BM25 distractors, as in the
# knowledge base), few questions each so that entities hardly repeat.
FRESH_WORLD = WorldSizes(people=60, organisations=15, cities=12, countries=4)
QUESTIONS_PER_WORLD = 6
# Apart from the knowledge base's seeds (0, 1, ...) and the SFT transcripts' (prepare.py).
_RL_WORLD_SEEDS = 2_000_000_000
WORLD_SEED = "world_seed"  # the task data key naming a task's world


def fresh_world_tasks(
    count: int, *, seed: int = 0, sizes: WorldSizes = FRESH_WORLD, two_hop_share: float = 0.5
) -> list[Task]:
    """`count` question tasks over fresh worlds of `sizes`, QUESTIONS_PER_WORLD per world, about
    `two_hop_share` of them 2-hop."""
    tasks: list[Task] = []
    n = 0
    while len(tasks) < count:
        world_seed = _RL_WORLD_SEEDS + seed * 1_000_000 + n
        world = generate_world(world_seed, "train", sizes)
        for q in generate_questions(
            world,
            QUESTIONS_PER_WORLD,
            seed=world_seed,
            two_hop_share=two_hop_share,
            id_prefix=f"fresh{world_seed}-",
        ):
            data = {"question": q.question, "golden_answers": q.golden_answers, "hops": q.hops}
            tasks.append(Task(id=q.id, data={**data, WORLD_SEED: world_seed}))
        n += 1
    return tasks[:count]


class WorldRetrieval:
    """The `Retrieval` of one fresh world: its documents, with `distractors` if given, in an
    in-process BM25 index."""

    def __init__(
        self, world: World, work: Path, name: str, distractors: Sequence[dict[str, str]] = ()
    ) -> None:
        corpus = work / f"{name}.jsonl"
        write_jsonl(corpus, [*world.documents("w"), *distractors])
        self.index = BM25Index.build(corpus, work / f"{name}.index")

    async def search(self, query: str, topk: int = 3) -> list[Hit]:
        return self.index.search_batch([query], topk)[0]

    async def document(self, doc_id: str) -> Hit | None:
        return self.index.document(doc_id)


class WorldRetrievals:
    """Each fresh world's retrieval, built once (in a thread: ~10 ms alone, ~1 s with the CPU
    knowledge base's training worlds as distractors) and kept while its group's rollouts run;
    the least recently used go when more than `keep` are held.

    Distractors make a fresh world as hard to search as the held-out one, which is searched
    among the ~9,000 documents of the knowledge base's training worlds: alone, a fresh world's
    ~90 documents let a misspelt name still find its entity, so RL learnt reading habits that
    failed on held-out 2-hop questions (EXPERIMENTS.md, run G).
    """

    def __init__(
        self,
        keep: int = 64,
        sizes: WorldSizes = FRESH_WORLD,
        distractors: Sequence[dict[str, str]] = (),
    ) -> None:
        self._dir: tempfile.TemporaryDirectory[str] | None = None  # made at the first world
        self._keep = keep
        self._sizes = sizes
        self._distractors = distractors
        self._held: OrderedDict[int, asyncio.Future[WorldRetrieval]] = OrderedDict()

    async def get(self, world_seed: int) -> WorldRetrieval:
        held = self._held.get(world_seed)
        if held is None:
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="lockgate-fresh-worlds-")
            work = Path(self._dir.name)
            held = asyncio.ensure_future(asyncio.to_thread(self._build, world_seed, work))
            self._held[world_seed] = held
            while len(self._held) > self._keep:
                self._held.popitem(last=False)
        self._held.move_to_end(world_seed)
        return await held

    def _build(self, world_seed: int, work: Path) -> WorldRetrieval:
        world = generate_world(world_seed, "train", self._sizes)
        return WorldRetrieval(world, work, str(world_seed), self._distractors)

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
