"""Everything the CPU recipe needs before training: knowledge base, model, SFT transcripts.

    python -m lockgate.examples.deepresearch.prepare --out DIR

writes `DIR/kb/` (corpus and questions, `data.build_cpu_kb`), `DIR/val_kb/` (the knowledge base of
the validation seed, `data.validation_kb_seed`: its held-out world and questions judge the SFT
model before the recipe goes on, gate.py), builds the untrained model (cached), and writes
`DIR/drill_{train,val}.jsonl` (copy drills, `copy_drills`; the val drills are over names of
other worlds, a held-out copy task) and `DIR/sft_{train,val}.jsonl` (the scripted oracle's
conversations). It prints `model=PATH` and the paths, one per line, for the recipe's shell
script to read.

The transcripts are over fresh worlds, not over the knowledge base's training world: each small
world (a few dozen people and their organisations, cities and countries, all drawn from the
training namespace) gets its own BM25 index and a handful of questions, so hardly any entity
occurs in two transcripts. A model trained on a fixed set of entities learns them by heart
and, on held-out questions, writes training names it remembers (the first recipe measured 0.5%
held-out success after three epochs that way); over fresh entities the only way to lower the
loss is to copy names from the question and facts from the search results, which is what the
held-out questions need.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lockgate.examples.deepresearch.agent import AgentConfig
from lockgate.examples.deepresearch.data import (
    KBSpec,
    build_cpu_kb,
    validation_kb_seed,
    write_jsonl,
)
from lockgate.examples.deepresearch.fresh_worlds import (
    FRESH_WORLD,
    QUESTIONS_PER_WORLD,
    WorldRetrieval,
)
from lockgate.examples.deepresearch.model import ensure_model
from lockgate.examples.deepresearch.oracle import OracleRun, oracle_transcripts, transcript_line
from lockgate.examples.deepresearch.questions import generate_questions
from lockgate.examples.deepresearch.world import World, WorldSizes, generate_world

# Seeds of transcript worlds start here, apart from the knowledge base's (its seed, 0, 1, ...),
# and those of the copy drills' worlds (names only) there.
_WORLD_SEEDS = 1_000_000
_DRILL_SEEDS = 500_000_000
DRILL_WORLD = WorldSizes(people=40, organisations=10, cities=10, countries=4)


def _world_runs(world: World, seed: int, config: AgentConfig, work: Path) -> list[OracleRun]:
    """The oracle's successful runs on a few questions over `world`, searched in its own index."""
    retrieval = WorldRetrieval(world, work, "world")
    questions = generate_questions(world, QUESTIONS_PER_WORLD, seed=seed, id_prefix=f"w{seed}-")
    return asyncio.run(oracle_transcripts(questions, retrieval.search, config))


def fresh_transcripts(
    count: int, *, seed: int, config: AgentConfig | None = None, desc: str = "transcripts"
) -> list[OracleRun]:
    """`count` oracle transcripts over fresh worlds; `seed` picks the worlds (disjoint seeds,
    disjoint worlds: give training and validation different ones)."""
    config = config or AgentConfig()
    runs: list[OracleRun] = []
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=count, desc=desc, unit="tr") as bar:
        n = 0
        while len(runs) < count:
            world_seed = _WORLD_SEEDS + seed * 100_000 + n
            world = generate_world(world_seed, "train", FRESH_WORLD)
            more = _world_runs(world, world_seed, config, Path(tmp))[: count - len(runs)]
            runs += more
            bar.update(len(more))
            n += 1
    return runs


def copy_drills(count: int, *, seed: int, names_per_line: int = 12) -> list[dict[str, Any]]:
    """`count` chat lines asking to repeat a list of fresh entity names, answered exactly.

    A randomly initialised model cannot copy: the syllable statistics of names are an easier
    loss to lower, and on the transcripts alone (a few copies each, among much else) the heads
    that copy never formed (563 steps, 14 minutes: every name token stayed at the syllables'
    entropy). On these drills every answer token is a copy, and the model learns to copy in a
    few hundred steps (the loss falls from 2.6 to 0.1 between steps 250 and 600 at batch 16);
    the transcripts then only have to teach what to copy. A real model learned this in
    pretraining.
    """
    rng = random.Random(f"drills:{seed}")
    lines: list[dict[str, Any]] = []
    n = 0
    while len(lines) < count:
        world = generate_world(_DRILL_SEEDS + seed * 100_000 + n, "train", DRILL_WORLD)
        names = [*world.people, *world.organisations, *world.cities, *world.countries]
        rng.shuffle(names)
        for i in range(0, len(names) - names_per_line + 1, names_per_line):
            listed = ", ".join(names[i : i + names_per_line])
            lines.append(
                {
                    "messages": [
                        {"role": "user", "content": f"Repeat: {listed}"},
                        {"role": "assistant", "content": listed},
                    ]
                }
            )
        n += 1
    return lines[:count]


def write_transcripts(path: Path, runs: list[OracleRun]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(transcript_line(run) + "\n" for run in runs))
    tmp.replace(path)


def arguments() -> argparse.ArgumentParser:
    """prepare.py's command line; its defaults are the recipe's (checked against its configs)."""
    parser = argparse.ArgumentParser(prog="python -m lockgate.examples.deepresearch.prepare")
    parser.add_argument("--out", type=Path, required=True, help="the recipe's data directory")
    parser.add_argument("--sft-train", type=int, default=4000, help="training transcripts")
    parser.add_argument("--sft-val", type=int, default=200, help="validation transcripts")
    parser.add_argument(
        "--drills",
        type=int,
        default=19_200,
        help="copy drill lines (enough to see each once: drill_cpu.yaml)",
    )
    parser.add_argument("--kb-seed", type=int, default=0, help="the knowledge base's seed")
    parser.add_argument(
        "--transcript-seed", type=int, default=0, help="picks the transcripts' fresh worlds"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    kb = build_cpu_kb(args.out / "kb", KBSpec(seed=args.kb_seed))
    val_kb = build_cpu_kb(args.out / "val_kb", KBSpec(seed=validation_kb_seed(args.kb_seed)))
    model = ensure_model(kb)
    # Training and validation transcripts come from worlds of different seeds.
    base = args.transcript_seed * 1000
    for name, count, seed in (("sft_train", args.sft_train, 0), ("sft_val", args.sft_val, 999)):
        runs = fresh_transcripts(count, seed=base + seed, desc=name)
        write_transcripts(args.out / f"{name}.jsonl", runs)
    for name, count, seed in (("drill_train", args.drills, 0), ("drill_val", 64, 999)):
        write_jsonl(args.out / f"{name}.jsonl", copy_drills(count, seed=base + seed))
    print(f"model={model}\nkb={kb}\nval_kb={val_kb}\nsft_train={args.out / 'sft_train.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
