"""The DeepResearch GPU recipe's smoke run: the GPU config itself, shrunk (the example's CPU
knowledge base, the tiny model, two steps): vLLM replicas and the FSDP2 trainer on the GPU, the
same env, agent and retrieval service as the CPU recipe. CI has no GPU, so it is skipped there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lockgate.examples.deepresearch.data import KBSpec, build_cpu_kb
from lockgate.examples.deepresearch.world import WorldSizes
from tests.examples.test_deepresearch_gpu import GPU_CONFIG
from tests.support.trainer_runs import needs_gpu


@needs_gpu
def test_the_gpu_recipe_trains_two_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    kb = build_cpu_kb(
        tmp_path / "kb",
        KBSpec(
            train_world=WorldSizes(people=40),
            train_worlds=1,
            heldout_world=WorldSizes(people=20),
        ),
    )
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable, "-m", "lockgate.coordinator.cli", "train", str(GPU_CONFIG),
            "--run-dir", str(run_dir), "--set", f"model.path={tiny_model_dir}",
            "--set", f"environment.args.corpus={kb / 'corpus.jsonl'}",
            "--set", f"environment.args.train_questions={kb / 'train.jsonl'}",
            "--set", f"environment.args.heldout_questions={kb / 'heldout.jsonl'}",
            "--set", "environment.args.num_val=4", "--set", "environment.args.agent.max_tokens=32",
            "--set", "replicas.count=1", "--set", "replicas.max_model_len=2048",
            "--set", "gateway.sampling.max_tokens=32", "--set", "trainer.world_size=1",
            "--set", "loop.steps=2", "--set", "loop.groups_per_step=2", "--set", "loop.group_size=2",
            "--set", "loop.val_every=2", "--set", "trainer.checkpoint_every=0",
        ],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[-1]["count/syncs"] == 2
