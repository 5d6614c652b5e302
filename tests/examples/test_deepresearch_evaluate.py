"""The evaluation's summary: success over every episode, its standard error over questions."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lockgate.examples.deepresearch.evaluate import (
    Outcome,
    Report,
    main,
    merge_reports,
    seed_rows,
    summarize,
)


def _outcome(qid: str, em: float, hops: int = 1) -> Outcome:
    return Outcome(question_id=qid, hops=hops, em=em, f1=em, ended="answered", tool_calls=hops)


def test_one_episode_per_question_is_the_binomial_standard_error() -> None:
    s = summarize("m", [_outcome("a", 1.0), _outcome("b", 0.0), _outcome("c", 0.0)])
    assert s.n == 3
    assert s.success == pytest.approx(1 / 3)
    assert s.success_se == pytest.approx(math.sqrt((1 / 3) * (2 / 3) / 2))


def test_several_episodes_of_a_question_count_as_one_question() -> None:
    # a: 2 of 2, b: 0 of 2, c: 1 of 2 -> per-question means 1, 0, 0.5.
    ems = {"a": [1.0, 1.0], "b": [0.0, 0.0], "c": [1.0, 0.0]}
    s = summarize(
        "m", [_outcome(q, e, hops=2 if q == "c" else 1) for q, v in ems.items() for e in v]
    )
    assert s.n == 3
    assert s.success == pytest.approx(0.5)
    assert s.success_se == pytest.approx(math.sqrt(0.25 / 3))  # var of (1, 0, 0.5) is 0.25
    assert s.by_hops == {"1": 0.5, "2": 0.5}
    assert s.tool_calls_by_hops == {"1": 1.0, "2": 2.0}


def _report(**success: float) -> Report:
    """A report whose policy `name` (underscores for spaces) succeeds on a share `v` of two
    questions' episodes (each question answered with exact match v)."""
    return Report(
        model="m",
        questions="q",
        elapsed_s=0.0,
        summaries=[
            summarize(name.replace("_", " "), [_outcome("a", v), _outcome("b", v)])
            for name, v in success.items()
        ],
        outcomes={},
    )


def test_the_seed_table_pairs_each_rl_model_with_its_own_start() -> None:
    seeds = [
        {"sft": _report(oracle=0.9, model_T_1=0.3), "rl": _report(model_T_1=0.4)},
        {"sft": _report(oracle=0.9, model_T_1=0.5), "rl": _report(model_T_1=0.5)},
        {"sft": _report(oracle=0.9, model_T_1=0.2)},  # RL did not run: no gain for this seed
    ]
    rows = seed_rows(seeds)
    assert rows["oracle"] == [0.9, 0.9, 0.9]
    assert rows["SFT model T 1"] == [0.3, 0.5, 0.2]
    assert rows["RL model T 1"] == [0.4, 0.5]
    assert rows["gain RL - SFT, model T 1"] == pytest.approx([0.1, 0.0])
    assert "RL oracle" not in rows


def _episodes(model: str, **outcomes: list[Outcome]) -> Report:
    return Report(
        model=model,
        questions="q",
        elapsed_s=1.0,
        summaries=[summarize(k.replace("_", " "), v) for k, v in outcomes.items()],
        outcomes={k.replace("_", " "): v for k, v in outcomes.items()},
    )


def test_merging_pools_the_episodes_of_each_policy_and_recomputes_its_summary() -> None:
    a = _episodes(
        "m",
        model_T_1=[_outcome("a", 1.0), _outcome("b", 0.0)],
        model_T_0=[_outcome("a", 1.0), _outcome("b", 1.0)],
    )
    # The same model named by its absolute path (one run given a relative one) pools too.
    b = _episodes(str(Path("m").resolve()), model_T_1=[_outcome("a", 0.0), _outcome("b", 0.0)])
    merged = merge_reports([a, b])
    t1 = merged.summary("model T 1")
    assert t1 is not None
    assert len(merged.outcomes["model T 1"]) == 4
    assert t1.n == 2  # still two questions, now two episodes each
    assert t1.success == pytest.approx(0.25)
    assert t1.success_se == pytest.approx(math.sqrt(0.125 / 2))  # per-question 0.5 and 0
    greedy = merged.summary("model T 0")
    assert greedy is not None and greedy.success == pytest.approx(1.0)  # from `a` alone
    assert merged.elapsed_s == pytest.approx(2.0)


def test_evaluations_of_different_models_are_not_merged() -> None:
    with pytest.raises(ValueError, match="different runs"):
        merge_reports([_episodes("m1", model_T_1=[]), _episodes("m2", model_T_1=[])])


def test_the_table_adds_rows_for_each_knowledge_base_of_another_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for seed, (start, end) in enumerate([(0.2, 0.3), (0.4, 0.4)]):
        run = tmp_path / f"seed{seed}"
        run.mkdir()
        for name, value in (("sft", start), ("rl", end)):
            (run / f"eval_{name}.json").write_text(_report(model_T_1=value).model_dump_json())
            fresh = _report(model_T_1=value / 2).model_dump_json()
            (run / f"eval_{name}_kb101.json").write_text(fresh)
    assert main(["table", str(tmp_path / "seed0"), str(tmp_path / "seed1")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert "| gain RL - SFT, model T 1 | +0.050 ± 0.050 | 2 |" in rows
    assert "| KB seed 101: SFT model T 1 | 0.150 ± 0.050 | 2 |" in rows
    assert "| KB seed 101: gain RL - SFT, model T 1 | +0.025 ± 0.025 | 2 |" in rows
