"""`lockgate train` on the toy task with every chat family's tiny model (issue 42): the run's
chat format is detected from the model, 3 steps train with a weight sync after each, the command
exits 0 and leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec
from lockgate.trainer.tiny_models.families import FAMILIES
from tests.support.marked_processes import processes_with_marker

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
# The default model's run is tests/vllm/test_train_e2e.py's.
NEW_FAMILIES = sorted(set(FAMILIES) - {"qwen3"})


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_the_toy_task_trains_on_each_familys_tiny_model(tmp_path: Path, family: str) -> None:
    model_dir = ensure_tiny_model(spec=family_spec(family))
    marker = f"LOCKGATE_TEST_RUN={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable, "-m", "lockgate.coordinator.cli", "train", str(ROOT / "examples/toy/config.yaml"),
            "--run-dir", str(run_dir), "--set", f"model.path={model_dir}",
            "--set", "loop.steps=3", "--set", "loop.val_every=0",
            "--set", "loop.groups_per_step=2", "--set", "loop.group_size=4",
        ],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"chat format: {FAMILIES[family].format}" in result.stderr + result.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["version"] == 3 and records[-1]["count/syncs"] == 3
    assert all(r["batch/loss_tokens"] > 0 for r in records)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    assert processes_with_marker(marker) == []
