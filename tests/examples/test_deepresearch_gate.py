"""The warm start's gates and the evaluation on fresh knowledge bases (issue 45), their pure
parts: the SFT gate's decision and how it continues SFT (gate.py), the validation and
`--kb-seed` knowledge bases (data.py, evaluate.py), and the drills' held-out copy task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockgate.examples.deepresearch.data import (
    HELDOUT,
    KBSpec,
    build_cpu_kb,
    iter_corpus,
    kb_seed,
    validation_kb_seed,
)
from lockgate.examples.deepresearch.evaluate import RECIPE_KB_SEEDS, knowledge_base
from lockgate.examples.deepresearch.gate import (
    GateRule,
    Validation,
    continued_loop,
    decide,
    main,
)
from lockgate.examples.deepresearch.prepare import copy_drills

RULE = GateRule(threshold=0.10, min_two_hop_searches=1.8, extra_chunks=2, chunk_steps=250)
SEARCHES_AGAIN = 1.9  # 2-hop validation questions searched this many times: enough


def _at(success: float, two_hop_searches: float = SEARCHES_AGAIN) -> Validation:
    return Validation(success=success, two_hop_searches=two_hop_searches)


def test_a_model_that_answers_and_searches_again_passes_at_once() -> None:
    verdict = decide(_at(0.10), 0, RULE)
    assert verdict.action == "pass"
    assert verdict.line == (
        "validation success (T=1) 0.100, at or above 0.1; 2-hop questions searched 1.90 times, "
        "at least 1.8"
    )
    assert decide(_at(0.25, 1.8), 2, RULE).action == "pass"  # after chunks, and at the least
    unchecked = RULE.model_copy(update={"min_two_hop_searches": 0.0})
    assert decide(_at(0.25, 0.0), 0, unchecked).line == (
        "validation success (T=1) 0.250, at or above 0.1"
    )


def test_a_model_below_continues_sft_until_the_cap_then_stops_in_one_line() -> None:
    assert decide(_at(0.003), 0, RULE).line == (
        "validation success (T=1) 0.003, below 0.1: SFT chunk 1 of 2 (250 more steps)"
    )
    assert decide(_at(0.05), 1, RULE).action == "continue"
    stop = decide(_at(0.05), 2, RULE)
    assert stop.action == "stop"
    assert stop.line == (
        "the SFT model's validation success (T=1) 0.050 is below 0.1 after 2 extra chunks of "
        "250 steps (the cap); the warm start does not answer"
    )
    # Not answering is the reason given, whatever the searches.
    assert decide(_at(0.05, 0.0), 2, RULE).line == stop.line
    assert decide(_at(0.0), 0, RULE.model_copy(update={"extra_chunks": 0})).action == "stop"
    # A threshold above 1 is one no model passes (the recipe's gate test uses it).
    assert decide(_at(1.0), 0, RULE.model_copy(update={"threshold": 1.01})).action == "continue"


def test_a_model_that_answers_after_one_search_continues_sft_then_stops_on_it() -> None:
    # Seed 2's SFT model of 2026-11-29: it answered, but searched 2-hop questions ~1.6 times.
    verdict = decide(_at(0.33, 1.57), 0, RULE)
    assert verdict.action == "continue"
    assert verdict.line == (
        "2-hop questions searched 1.57 times, under 1.8: SFT chunk 1 of 2 (250 more steps)"
    )
    stop = decide(_at(0.33, 1.7), 2, RULE)
    assert stop.action == "stop"
    assert stop.line == (
        "the SFT model searched 2-hop validation questions 1.70 times, under 1.8, after 2 extra "
        "chunks of 250 steps (the cap); the warm start answers them without their second search"
    )


def test_a_chunk_resumes_the_run_for_more_steps_within_one_more_epoch() -> None:
    config = json.dumps({"loop": {"epochs": 1, "max_steps": None}})
    assert continued_loop(config, 500, 250) == ["loop.epochs=2", "loop.max_steps=750"]
    config = json.dumps({"loop": {"epochs": 2, "max_steps": 750}})
    assert continued_loop(config, 750, 250) == ["loop.epochs=3", "loop.max_steps=1000"]


def test_the_gate_refuses_a_rule_out_of_range() -> None:
    with pytest.raises(ValueError):
        GateRule(chunk_steps=0)
    with pytest.raises(ValueError):
        GateRule(threshold=-0.1)
    with pytest.raises(ValueError):
        GateRule(min_two_hop_searches=-1)


def test_the_gate_stops_in_one_line_when_its_validation_cannot_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # evaluate.py refuses its arguments (a seed the recipe uses) before it starts anything;
    # the gate says which command failed, on stdout alone, and passes nothing.
    code = main(
        ["--sft-out", str(tmp_path / "sft"), "--kb-dir", str(tmp_path / "kb")]
        + ["--work", str(tmp_path / "gate"), "--", "--kb-seed", "0"]
    )
    assert code == 1
    captured = capfd.readouterr()
    assert captured.out.strip().splitlines() == [
        "the validation (evaluate.py run) failed (exit code 1)"
    ]
    assert "--kb-seed 0 is a knowledge base the recipe uses" in captured.err


def _heldout_questions(kb: Path) -> set[tuple[str, str]]:
    """Each held-out question with its answer."""
    lines = [json.loads(line) for line in (kb / HELDOUT).read_text().splitlines()]
    return {(q["question"], q["golden_answers"][0]) for q in lines}


def _heldout_documents(kb: Path) -> set[str]:
    return {d["contents"] for d in iter_corpus(kb / "corpus.jsonl") if d["id"][0] == "h"}


def test_kb_seed_builds_a_new_held_out_world_its_questions_and_documents(tmp_path: Path) -> None:
    recipe = build_cpu_kb(tmp_path / "recipe")
    fresh = knowledge_base(tmp_path / "fresh", 7)
    assert kb_seed(recipe) == 0 and kb_seed(fresh) == 7
    # Names are made of a few syllables, so a short one may recur; no fact does.
    assert not _heldout_questions(recipe) & _heldout_questions(fresh)
    new = _heldout_documents(fresh)
    assert len(new) > 300 and not _heldout_documents(recipe) & new
    assert knowledge_base(tmp_path / "fresh", 7) == fresh  # kept as it is


def test_kb_seed_refuses_the_recipes_own_seeds_and_a_dir_of_another_seed(tmp_path: Path) -> None:
    assert RECIPE_KB_SEEDS == (0, validation_kb_seed(0))
    for seed in RECIPE_KB_SEEDS:
        with pytest.raises(ValueError, match="the recipe uses"):
            knowledge_base(tmp_path / "kb", seed)
    build_cpu_kb(tmp_path / "kb", KBSpec(seed=3))
    with pytest.raises(ValueError, match="holds the knowledge base of seed 3, not 4"):
        knowledge_base(tmp_path / "kb", 4)
    assert kb_seed(tmp_path / "kb") == 3  # left as it was
    # Without a seed, a prepared dir is used as it is, whatever its seed.
    assert knowledge_base(tmp_path / "kb", None) == tmp_path / "kb"


def test_the_validation_knowledge_base_is_apart_from_the_evaluations(tmp_path: Path) -> None:
    assert validation_kb_seed(0) not in (0, 1, 2)
    recipe = build_cpu_kb(tmp_path / "kb")
    val = build_cpu_kb(tmp_path / "val", KBSpec(seed=validation_kb_seed(0)))
    assert not _heldout_questions(recipe) & _heldout_questions(val)
    assert not _heldout_documents(recipe) & _heldout_documents(val)


def test_the_drills_are_judged_on_a_held_out_copy_task() -> None:
    # prepare.py's drill_train and drill_val: other seeds, so other worlds and other names.
    train, val = copy_drills(1600, seed=0), copy_drills(64, seed=999)
    answers = [line["messages"][1]["content"] for line in train]
    held_out = [line["messages"][1]["content"] for line in val]
    assert not set(answers) & set(held_out)  # no held-out drill was trained on
    names = {n for a in answers for n in a.split(", ")}
    fresh = [n for a in held_out for n in a.split(", ") if n not in names]
    assert len(fresh) >= 0.8 * 12 * len(val)  # and most of their names are new
