"""The CPU recipe stops at a warm-start gate it misses (issue 45, must-show 2): run_cpu.sh at toy
size, with a gate no model can pass, exits 1 after that stage with one line naming the stage and
the reason, and starts nothing after it.

The drills' gate: held-out exact match 1.0 within 2 steps (`lockgate sft`'s loop.require). The
SFT gate: validation success above 1 (gate.py), so it validates, continues SFT one chunk (a
resumed `lockgate sft`), validates again and stops at its cap.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.support.marked_processes import processes_with_marker

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
TOY_DATA = "--sft-train 8 --sft-val 4 --drills 64"


def _recipe(tmp_path: Path, **stages: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """run_cpu.sh on toy data in tmp_path, with `stages` as its *_ARGS; the result and the
    marker its processes carry."""
    marker = uuid.uuid4().hex
    env = {
        **os.environ,
        "LOCKGATE_TEST_RUN": marker,
        "SKIP_SETUP": "1",
        "DATA": str(tmp_path / "data"),
        "RUN": str(tmp_path / "run"),
        "PREPARE_ARGS": TOY_DATA,
        **{f"{name.upper()}_ARGS": value for name, value in stages.items()},
    }
    result = subprocess.run(
        ["bash", str(ROOT / "examples/deepresearch/run_cpu.sh")],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    print(result.stderr[-4000:])
    return result, f"LOCKGATE_TEST_RUN={marker}"


def test_drills_that_never_copy_stop_the_recipe_at_stage_2(tmp_path: Path) -> None:
    result, marker = _recipe(
        tmp_path,
        drill="--set loop.max_steps=2 --set loop.val_every=1 "
        "--set loop.stop_at_val_exact_match=1.0",
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "[deepresearch] stage 2 (copy drills): held-out exact match 0.000 when the run ended at "
        "step 2, short of loop.stop_at_val_exact_match 1.0 (loop.require: val_exact_match)"
    )
    run = tmp_path / "run"
    assert (run / "drill" / "final").is_dir()  # the drilled model is there to look at
    assert not (run / "sft").exists()  # nothing after the gate ran
    assert processes_with_marker(marker) == []


def test_an_sft_model_that_never_answers_stops_the_recipe_at_stage_2(tmp_path: Path) -> None:
    evaluate = "--replicas 1 --n 4 --agent '{\"max_tokens\": 24}'"
    result, marker = _recipe(
        tmp_path,
        drill="--set loop.max_steps=1 --set loop.require=null",
        sft="--set loop.max_steps=1",
        gate=f"--threshold 1.01 --extra-chunks 1 --chunk-steps 1 -- {evaluate}",
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    prefix = "[deepresearch] stage 2 (SFT): the SFT model's validation success (T=1) "
    assert last.startswith(prefix), last
    assert last.endswith(
        " is below 1.01 after 1 extra chunk of 1 steps (the cap); the warm start does not answer"
    ), last
    assert "SFT chunk 1 of 1 (1 more steps)" in result.stderr  # it continued SFT once
    run = tmp_path / "run"
    records = [json.loads(x) for x in (run / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # the chunk resumed the run for one step
    for k in (0, 1):  # each check on the validation knowledge base, 4 questions at T=1
        report = json.loads((run / "gate" / f"val_{k}.json").read_text())
        assert report["kb_seed"] == 1000
        assert [s["name"] for s in report["summaries"]] == ["model T=1"]
        assert report["summaries"][0]["n"] == 4
    assert not (run / "replicas").exists() and not (run / "rl").exists()
    assert processes_with_marker(marker) == []
