"""The example's data on disk: the CPU knowledge base it generates, and loaders for real data.

`build_cpu_kb` writes one directory: `corpus.jsonl` (the training world and the held-out world,
one wiki-style document per entity), `train.jsonl` and `heldout.jsonl` (questions over the two
worlds, whose entities are disjoint) and `manifest.json` (what built it). The loaders read the
same formats from files a user brings for GPU runs: a wiki-18 style corpus
(`{"id", "contents"}`) and NQ / HotpotQA style questions (`question` plus `golden_answers`, or
`answer` / `answers`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from lockgate.examples.deepresearch.questions import Question, generate_questions
from lockgate.examples.deepresearch.world import WorldSizes, generate_world

CORPUS, TRAIN, HELDOUT, MANIFEST = "corpus.jsonl", "train.jsonl", "heldout.jsonl", "manifest.json"
HELDOUT_DOC_PREFIX = "h"  # the held-out world's document ids; the training worlds' start with t
# The validation knowledge base's seed is the recipe's plus this: the warm start is judged on a
# held-out world of its own (gate.py), never on the evaluation's.
VALIDATION_SEED_OFFSET = 1000


def validation_kb_seed(kb_seed: int) -> int:
    """The seed of the knowledge base whose held-out questions validate the SFT model."""
    return kb_seed + VALIDATION_SEED_OFFSET


def kb_seed(kb_dir: Path) -> int | None:
    """The seed a CPU knowledge base was built with (its manifest), None for another kind."""
    manifest = Path(kb_dir) / MANIFEST
    if not manifest.is_file():
        return None
    seed = json.loads(manifest.read_text()).get("seed")
    return seed if isinstance(seed, int) else None


class KBSpec(BaseModel):
    """The CPU knowledge base: `train_worlds` small worlds for training, one held-out world.

    Many small training worlds rather than one big one: RL on one world of 3,000 people raised
    the training reward on its 1-hop questions from 0.44 to 0.61 in 16 steps while held-out
    1-hop success fell (0.29 -> 0.26 at T=1), i.e. it learnt that world's names and facts (200
    cities, each the answer of many questions) instead of reading. With 100 worlds of 60
    people, a run of a few hundred questions rarely meets an entity twice.
    """

    seed: int = 0
    train_world: WorldSizes = WorldSizes(people=60, organisations=15, cities=12, countries=4)
    train_worlds: int = Field(default=100, ge=1)
    heldout_world: WorldSizes = WorldSizes(people=300, organisations=60, cities=40, countries=8)
    train_questions: int = 6000
    heldout_questions: int = 200
    two_hop_share: float = 0.5


def build_cpu_kb(out_dir: Path, spec: KBSpec | None = None) -> Path:
    """Write the knowledge base into `out_dir` (kept when it was built from the same spec)."""
    spec = spec or KBSpec()
    out_dir = Path(out_dir)
    manifest = out_dir / MANIFEST
    if manifest.is_file() and json.loads(manifest.read_text()) == spec.model_dump(mode="json"):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    used: set[str] = set()
    # World k's seed; world 0 keeps the KB's seed, so a one-world spec builds what it always did.
    trains = [
        generate_world(spec.seed + k * 100_003, "train", spec.train_world, used)
        for k in range(spec.train_worlds)
    ]
    heldout = generate_world(spec.seed, "heldout", spec.heldout_world, used)
    docs = [d for k, w in enumerate(trains) for d in w.documents(f"t{k}-" if k else "t")]
    write_jsonl(out_dir / CORPUS, [*docs, *heldout.documents(HELDOUT_DOC_PREFIX)])
    per_world = _split_evenly(spec.train_questions, spec.train_worlds)
    train_questions = [
        q.model_dump(mode="json")
        for k, (world, count) in enumerate(zip(trains, per_world, strict=True))
        for q in generate_questions(
            world,
            count,
            seed=spec.seed + k,
            two_hop_share=spec.two_hop_share,
            id_prefix=f"train-{k}-" if k else "train-",
        )
    ]
    # Interleaved, so that the first N questions (`num_train`) span many worlds.
    train_questions.sort(key=lambda q: int(str(q["id"]).rsplit("-", 1)[1]))
    write_jsonl(out_dir / TRAIN, train_questions)
    heldout_questions = generate_questions(
        heldout,
        spec.heldout_questions,
        seed=spec.seed,
        two_hop_share=spec.two_hop_share,
        id_prefix="heldout-",
    )
    write_jsonl(out_dir / HELDOUT, [q.model_dump(mode="json") for q in heldout_questions])
    manifest.write_text(json.dumps(spec.model_dump(mode="json"), indent=2))
    return out_dir


def training_world_documents(kb_dir: Path) -> list[dict[str, str]]:
    """The documents of a CPU knowledge base's training worlds: the held-out world's left out."""
    return [d for d in iter_corpus(kb_dir / CORPUS) if not d["id"].startswith(HELDOUT_DOC_PREFIX)]


def _split_evenly(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if k < total % parts else 0) for k in range(parts)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Rows as JSON lines, written whole or not at all."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: each line must be a JSON object")
            yield n, row


def load_questions(path: Path, limit: int | None = None) -> list[Question]:
    """Questions from a JSONL file: ours, or NQ / HotpotQA style lines."""
    out: list[Question] = []
    for n, row in _lines(path):
        if limit is not None and len(out) >= limit:
            break
        gold = row.get("golden_answers", row.get("answers", row.get("answer")))
        if isinstance(gold, str):
            gold = [gold]
        if not isinstance(row.get("question"), str) or not isinstance(gold, list) or not gold:
            raise ValueError(f"{path}:{n}: needs `question` and `golden_answers` (or `answer`)")
        fields = {k: v for k, v in row.items() if k in Question.model_fields}
        fields.update(id=str(row.get("id", f"{Path(path).stem}-{n}")), golden_answers=gold)
        fields.setdefault("source", Path(path).stem)
        out.append(Question.model_validate(fields))
    return out


def iter_corpus(path: Path) -> Iterator[dict[str, str]]:
    """Documents of a wiki-18 style corpus, checked line by line."""
    for n, row in _lines(path):
        if not isinstance(row.get("id"), str | int) or not isinstance(row.get("contents"), str):
            raise ValueError(f'{path}:{n}: needs "id" and "contents"')
        yield {"id": str(row["id"]), "contents": row["contents"]}
