"""The DeepResearch example's pure parts: the reward, the fictional world, questions, loaders,
the scripted oracle and its SFT transcripts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lockgate.examples.deepresearch.agent import AgentConfig
from lockgate.examples.deepresearch.data import (
    KBSpec,
    build_cpu_kb,
    iter_corpus,
    load_questions,
    training_world_documents,
)
from lockgate.examples.deepresearch.env import DeepResearchEnvironment
from lockgate.examples.deepresearch.fresh_worlds import (
    FRESH_WORLD,
    WORLD_SEED,
    WorldRetrievals,
    fresh_world_tasks,
)
from lockgate.examples.deepresearch.oracle import OracleRun, run_oracle, transcript_line
from lockgate.examples.deepresearch.prepare import copy_drills, fresh_transcripts, write_transcripts
from lockgate.examples.deepresearch.questions import TEMPLATES, generate_questions
from lockgate.examples.deepresearch.retrieval.index import BM25Index, Hit
from lockgate.examples.deepresearch.retrieval.server import create_app
from lockgate.examples.deepresearch.reward import (
    exact_match,
    extract_answer,
    f1_score,
    normalize_answer,
    score,
    shows_answer,
)
from lockgate.examples.deepresearch.world import WorldSizes, generate_world, name_split
from tests.support.threaded_server import serve_in_thread

SMALL = KBSpec(
    train_world=WorldSizes(people=60, organisations=12, cities=10, countries=4),
    train_worlds=1,
    heldout_world=WorldSizes(people=30, organisations=8, cities=6, countries=3),
    train_questions=80,
    heldout_questions=40,
)


# -- reward ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prediction", "gold", "em", "f1"),
    [
        ("The Quel Group", ["Quel Group"], 1.0, 1.0),  # articles dropped
        ("quel group.", ["Quel Group"], 1.0, 1.0),  # case and punctuation
        ("  Tar-port ", ["Tarport"], 1.0, 1.0),  # punctuation inside a word
        ("1948", ["1948"], 1.0, 1.0),
        ("1948", ["1949"], 0.0, 0.0),  # numbers are all or nothing
        ("in 1948", ["1948"], 0.0, 2 / 3),
        ("yes", ["no"], 0.0, 0.0),
        ("yes", ["Yes."], 1.0, 1.0),
        ("no way", ["no"], 0.0, 0.0),  # yes/no gold needs an exact match
        ("Quel Group", ["Tarport", "quel group"], 1.0, 1.0),  # best of the gold answers
        ("Group Quel Tarport", ["Quel Group"], 0.0, 0.8),
        ("", ["Quel Group"], 0.0, 0.0),
    ],
)
def test_em_and_f1_with_squad_normalisation(
    prediction: str, gold: list[str], em: float, f1: float
) -> None:
    assert exact_match(prediction, gold) == em
    assert f1_score(prediction, gold) == pytest.approx(f1)


def test_normalisation_and_answer_extraction() -> None:
    assert normalize_answer("An  Apple, the PEAR!") == "apple pear"
    assert extract_answer("I think <answer> Tarport </answer>") == "Tarport"
    assert extract_answer("<answer>a</answer> then <answer>b</answer>") == "b"
    assert extract_answer("Tarport") is None and extract_answer(None) is None


def test_the_score_is_f1_with_an_optional_format_term() -> None:
    assert score(None, ["x"]).reward == 0.0
    assert score("Quel", ["Quel Group"]).reward == pytest.approx(2 / 3)
    wrong = score("nothing", ["Quel Group"], format_weight=0.1)
    assert wrong.reward == pytest.approx(0.1) and wrong.answered and wrong.em == 0.0
    assert score("Quel Group", ["Quel Group"], format_weight=0.1).reward == pytest.approx(1.0)


def test_the_evidence_term_pays_for_a_gold_answer_seen_in_a_tool_result() -> None:
    text = "[d7] Kaven Lomos: Kaven Lomos was born in 1952 in Sasaholt. He works for Quel Group."
    assert shows_answer(text, ["Sasaholt"]) and shows_answer(text, ["the Quel group"])
    assert not shows_answer(text, ["Sasa"])  # whole words only
    assert not shows_answer(text, ["Tarport", ""])
    found = {"evidence_weight": 0.2, "evidence": True}
    assert score("Tarport", ["Sasaholt"], **found).reward == pytest.approx(0.2)
    assert score(None, ["Sasaholt"], **found).reward == pytest.approx(0.2)
    assert score("Sasaholt", ["Sasaholt"], **found).reward == pytest.approx(1.0)
    assert score("Sasaholt", ["Sasaholt"], evidence_weight=0.2).reward == pytest.approx(0.8)
    with pytest.raises(ValueError, match="more than 1"):
        score("x", ["x"], format_weight=0.6, evidence_weight=0.6)


# -- world and questions -----------------------------------------------------------------------


def test_train_and_heldout_worlds_share_no_entity() -> None:
    used: set[str] = set()
    train = generate_world(0, "train", WorldSizes(people=300), used)
    heldout = generate_world(0, "heldout", WorldSizes(people=100), used)
    other_seed = generate_world(1, "train", WorldSizes(people=300))
    for world, split in ((train, "train"), (heldout, "heldout"), (other_seed, "train")):
        names = [*world.people, *world.organisations, *world.cities, *world.countries]
        assert {name_split(n) for n in names} == {split}
    held = {*heldout.people, *heldout.organisations, *heldout.cities, *heldout.countries}
    assert not held & {*train.people, *train.organisations, *train.cities, *other_seed.people}


def test_a_world_is_the_same_for_the_same_seed() -> None:
    a, b = generate_world(3, "train"), generate_world(3, "train")
    assert list(a.documents("t")) == list(b.documents("t"))
    assert list(a.documents("t")) != list(generate_world(4, "train").documents("t"))


def test_questions_are_answered_by_their_chain_in_the_world() -> None:
    world = generate_world(0, "train")
    questions = generate_questions(world, 200, seed=0)
    assert len({q.question for q in questions}) == 200
    assert {q.source.rsplit("/", 1)[-1] for q in questions} == set(TEMPLATES)
    assert 0.35 < sum(q.hops == 2 for q in questions) / 200 < 0.65
    docs = {d["contents"].split("\n")[0].strip('"'): d["contents"] for d in world.documents("t")}
    for q in questions:
        assert len(q.chain) == q.hops
        assert q.chain[0].entity in q.question
        # Every hop's entity has its own document, and the last hop's fact states the answer.
        assert all(hop.entity in docs for hop in q.chain)
        assert q.golden_answers[0] in q.chain[-1].fact
        if q.hops == 2:
            assert q.chain[1].entity in q.chain[0].fact


# -- files -------------------------------------------------------------------------------------


def test_the_knowledge_base_files_and_loaders(tmp_path: Path) -> None:
    kb = build_cpu_kb(tmp_path / "kb", SMALL)
    docs = list(iter_corpus(kb / "corpus.jsonl"))
    assert len(docs) == 60 + 12 + 10 + 4 + 30 + 8 + 6 + 3
    assert all(d["contents"].startswith('"') for d in docs)
    train, heldout = load_questions(kb / "train.jsonl"), load_questions(kb / "heldout.jsonl")
    assert (len(train), len(heldout)) == (80, 40)
    assert not {q.chain[0].entity for q in train} & {q.chain[0].entity for q in heldout}
    mtime = (kb / "corpus.jsonl").stat().st_mtime_ns
    build_cpu_kb(tmp_path / "kb", SMALL)  # same spec: kept, not rewritten
    assert (kb / "corpus.jsonl").stat().st_mtime_ns == mtime


def test_the_training_split_spans_many_small_worlds_with_distinct_names(tmp_path: Path) -> None:
    spec = SMALL.model_copy(update={"train_worlds": 4, "train_questions": 40})
    kb = build_cpu_kb(tmp_path / "kb", spec)
    docs = list(iter_corpus(kb / "corpus.jsonl"))
    assert len(docs) == 4 * (60 + 12 + 10 + 4) + 30 + 8 + 6 + 3
    assert len({d["id"] for d in docs}) == len(docs)
    titles = [d["contents"].split("\n", 1)[0] for d in docs]
    assert len(set(titles)) == len(titles)  # no name means two things across worlds
    train = load_questions(kb / "train.jsonl")
    assert len(train) == 40
    # Interleaved: any 4 consecutive questions come from the 4 worlds, one each.
    assert {q.id.rsplit("-", 1)[0] for q in train[:4]} == {"train", "train-1", "train-2", "train-3"}
    # World 0 is the one-world knowledge base's world.
    one = build_cpu_kb(tmp_path / "one", SMALL)
    first_world = {d["contents"] for d in iter_corpus(one / "corpus.jsonl")}
    assert {d["contents"] for d in docs[: 60 + 12 + 10 + 4]} <= first_world


def test_real_data_loaders_read_nq_and_hotpotqa_lines(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"id": "nq1", "question": "who wrote it?", "golden_answers": ["A", "B"]}\n'
        "\n"
        '{"question": "hotpot?", "answer": "yes", "type": "comparison"}\n'
    )
    nq, hotpot = load_questions(path)
    assert (nq.id, nq.golden_answers) == ("nq1", ["A", "B"])
    assert (hotpot.id, hotpot.golden_answers, hotpot.source) == ("q-3", ["yes"], "q")
    path.write_text('{"question": "no answer"}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:1: needs `question` and `golden_answers`"):
        load_questions(path)
    path.write_text('{"id": 1, "contents": "x"}\nnot json\n')
    with pytest.raises(ValueError, match=r"q.jsonl:2: not JSON"):
        list(iter_corpus(path))


# -- oracle and transcripts --------------------------------------------------------------------


def test_the_oracle_answers_through_search_and_writes_a_chat_transcript(tmp_path: Path) -> None:
    kb = build_cpu_kb(tmp_path / "kb", SMALL)
    index = BM25Index.build(kb / "corpus.jsonl", tmp_path / "index")
    searched: list[str] = []

    async def search(query: str, k: int) -> list[Hit]:
        searched.append(query)
        return index.search_batch([query], k)[0]

    questions = load_questions(kb / "heldout.jsonl")
    runs = [asyncio.run(run_oracle(q, search, AgentConfig())) for q in questions]
    right = [r for r, q in zip(runs, questions, strict=True) if r.answer in q.golden_answers]
    assert len(right) >= 0.8 * len(questions)
    two_hop = next(r for r, q in zip(runs, questions, strict=True) if q.hops == 2 and r.answer)
    assert two_hop.searches == 2
    roles = [m["role"] for m in two_hop.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    # The second search is what the first document said, not the question's gold chain.
    second = json.loads(two_hop.messages[4]["tool_calls"][0]["function"]["arguments"])["query"]
    assert second in two_hop.messages[3]["content"]
    # The first reasoning says how many searches the question needs.
    assert two_hop.messages[2]["reasoning_content"].startswith("I need two searches.")
    one_hop = next(r for r, q in zip(runs, questions, strict=True) if q.hops == 1 and r.answer)
    assert one_hop.messages[2]["reasoning_content"].startswith("I need one search.")
    line = json.loads(transcript_line(two_hop))
    assert line["tools"][0]["function"]["name"] == "search"
    assert line["messages"][-1]["content"] == f"<answer>{two_hop.answer}</answer>"


def test_sft_transcripts_come_from_fresh_worlds_apart_from_the_held_out_one(tmp_path: Path) -> None:
    """Transcripts over fresh worlds: subjects hardly repeat, none is a held-out name, and the
    validation worlds (another seed) share no transcript with the training ones."""
    train = fresh_transcripts(120, seed=0)
    val = fresh_transcripts(30, seed=99)
    assert len(train) == 120 and len(val) == 30
    subjects = [_subject(run) for run in train]
    assert len(set(subjects)) >= 0.95 * len(subjects)
    assert all(name_split(s) == "train" for s in subjects)
    assert not {r.messages[1]["content"] for r in train} & {r.messages[1]["content"] for r in val}
    assert fresh_transcripts(10, seed=0)[5].messages == train[5].messages  # seeded
    for run in train[:20]:  # every answer was read off a search result
        assert run.answer is not None
        assert run.answer in "".join(m["content"] for m in run.messages if m["role"] == "tool")
    write_transcripts(tmp_path / "sft.jsonl", train)
    assert len((tmp_path / "sft.jsonl").read_text().splitlines()) == 120


def _subject(run: OracleRun) -> str:
    return json.loads(run.messages[2]["tool_calls"][0]["function"]["arguments"])["query"]


def test_copy_drills_ask_to_repeat_fresh_names_and_answer_them_exactly() -> None:
    drills = copy_drills(50, seed=0)
    assert len(drills) == 50 and drills == copy_drills(50, seed=0)
    names: list[str] = []
    for line in drills:
        user, assistant = line["messages"]
        assert user["content"] == f"Repeat: {assistant['content']}"
        listed = assistant["content"].split(", ")
        assert len(listed) == 12 and len(set(listed)) == 12
        names += listed
    assert all(name_split(n) == "train" for n in names)  # never a held-out name
    assert len(set(names)) >= 0.95 * len(names)  # fresh names, hardly any twice
    assert copy_drills(5, seed=999) != drills[:5]  # another seed, other worlds


async def test_fresh_world_tasks_are_answered_by_searching_their_own_world_only() -> None:
    tasks = fresh_world_tasks(12, seed=0)
    seeds = [t.data[WORLD_SEED] for t in tasks]
    assert len(tasks) == 12 and len(set(seeds)) == 2  # six questions a world
    assert len({t.id for t in tasks}) == 12
    assert fresh_world_tasks(12, seed=1)[0].data[WORLD_SEED] not in seeds  # seeds pick worlds
    assert {t.data["hops"] for t in tasks} == {1, 2}
    mostly_two = fresh_world_tasks(300, seed=0, two_hop_share=0.75)
    assert 0.65 < sum(t.data["hops"] == 2 for t in mostly_two) / 300 < 0.85
    worlds = WorldRetrievals(keep=1)
    try:
        answered = 0
        for task in tasks:
            retrieval = await worlds.get(task.data[WORLD_SEED])
            seed = task.data[WORLD_SEED]
            world = generate_world(seed, "train", FRESH_WORLD)
            by_id = {
                q.id: q for q in generate_questions(world, 6, seed=seed, id_prefix=f"fresh{seed}-")
            }
            question = by_id[task.id]  # the chain the oracle follows; the task carries the text
            assert question.question == task.data["question"]
            run = await run_oracle(question, retrieval.search, AgentConfig())
            answered += run.answer in task.data["golden_answers"]
        assert answered >= 10
        # A world's index holds that world alone: the last question's entity (second world)
        # is found in its own world's index and nowhere in the first's.
        first, second = [await worlds.get(s) for s in sorted(set(seeds))]
        entity = question.chain[0].entity
        assert entity in [h.title for h in await second.search(entity, 3)]
        assert entity not in [h.title for h in await first.search(entity, 10)]
    finally:
        worlds.close()


@contextmanager
def _environment(
    tmp_path: Path, spec: KBSpec = SMALL, **args: Any
) -> Iterator[DeepResearchEnvironment]:
    """The environment on a small knowledge base, its retrieval service served in a thread."""
    kb = build_cpu_kb(tmp_path / "kb", spec)
    index = BM25Index.build(kb / "corpus.jsonl", tmp_path / "index")
    with serve_in_thread(create_app(index)) as port:
        env = DeepResearchEnvironment(
            tmp_path, kb_dir=kb, retrieval_url=f"http://127.0.0.1:{port}", **args
        )
        try:
            yield env
        finally:
            env.close()


def test_the_environment_trains_on_fresh_worlds_when_asked(tmp_path: Path) -> None:
    with _environment(tmp_path, fresh_train_worlds=13, fresh_two_hop_share=1.0) as env:
        train = env.train_tasks()
        assert len(train) == 13 and all(WORLD_SEED in t.data for t in train)
        assert all(t.data["hops"] == 2 for t in train)
        assert all(WORLD_SEED not in t.data for t in env.val_tasks())  # held-out world kept


async def test_fresh_worlds_can_be_as_large_as_the_held_out_one(tmp_path: Path) -> None:
    big = {"people": 300, "organisations": 60, "cities": 40, "countries": 8}
    with _environment(tmp_path, fresh_train_worlds=6, fresh_world=big) as env:
        seed = env.train_tasks()[0].data[WORLD_SEED]
        world = generate_world(seed, "train", WorldSizes(**big))
        assert len(world.people) == 300 and len(world.countries) == 8
        retrieval = await env.worlds.get(seed)
        person = next(iter(world.people))
        assert person in [h.title for h in await retrieval.search(person, 3)]


async def test_fresh_worlds_can_be_searched_among_the_training_worlds(tmp_path: Path) -> None:
    spec = SMALL.model_copy(update={"train_worlds": 3})
    with _environment(tmp_path, spec, fresh_train_worlds=12, fresh_distractors=True) as env:
        distractors = training_world_documents(tmp_path / "kb")
        all_ids = {d["id"] for d in iter_corpus(tmp_path / "kb" / "corpus.jsonl")}
        heldout_ids = all_ids - {d["id"] for d in distractors}
        assert distractors and heldout_ids  # the held-out world's documents are no distractors
        assert all(i.startswith("h") for i in heldout_ids)
        seed = env.train_tasks()[0].data[WORLD_SEED]
        retrieval = await env.worlds.get(seed)
        world = generate_world(seed, "train", FRESH_WORLD)
        assert len(retrieval.index) == len(list(world.documents("w"))) + len(distractors)
        answered = 0
        for question in generate_questions(world, 6, seed=seed, id_prefix=f"fresh{seed}-"):
            run = await run_oracle(question, retrieval.search, AgentConfig())
            answered += run.answer in question.golden_answers
        assert answered >= 5  # the world's own entities are still found among the distractors
        title = distractors[0]["contents"].split("\n")[0].strip('"')
        assert title in [h.title for h in await retrieval.search(title, 3)]  # and they are there
