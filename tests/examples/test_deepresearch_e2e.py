"""The DeepResearch example end to end, tiny everything: transcripts -> `lockgate sft` ->
held-out evaluation -> `lockgate train` (retrieval service, real vLLM replica, gateway, trainer)
-> held-out evaluation of the weights RL left in the replica, as run_cpu.sh chains them.

What it checks is the plumbing the CPU recipe relies on, not learning (that is the recipe's job,
reported in examples/deepresearch/README.md): each stage's command succeeds on the previous
stage's output, every rollout is one training sample (no re-render split), the agent's episode
outcome lands in its session's metadata, the replica the run was given ends at the run's last
weight version and is evaluated there, and nothing is left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockgate.examples.deepresearch.data import KBSpec, build_cpu_kb
from lockgate.examples.deepresearch.prepare import fresh_transcripts, write_transcripts
from lockgate.examples.deepresearch.serving import weights_versions
from lockgate.examples.deepresearch.world import WorldSizes
from tests.support.marked_processes import processes_with_marker

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples/deepresearch/configs"
SMALL = KBSpec(
    train_world=WorldSizes(people=40, organisations=8, cities=8, countries=3),
    train_worlds=1,
    heldout_world=WorldSizes(people=20, organisations=6, cities=5, countries=2),
    train_questions=60,
    heldout_questions=8,
)


def _lockgate(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "lockgate.coordinator.cli", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    print(result.stderr[-3000:])
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _evaluate(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lockgate.examples.deepresearch.evaluate", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)


@contextlib.contextmanager
def _replica(model: Path, run_dir: Path, env: dict[str, str]) -> Iterator[str]:
    """One `lockgate replicas` replica of `model`, as run_cpu.sh starts its pair; its URL."""
    command = [
        sys.executable, "-m", "lockgate.coordinator.cli", "replicas", "--run-dir", str(run_dir),
        "--set", f"model.path={model}", "--set", "replicas.count=1",
        "--set", "replicas.max_model_len=2048",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the replica serves
        assert line.startswith("replica_url="), line
        yield line.strip().removeprefix("replica_url=")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def test_sft_then_async_grpo_then_evaluation(tmp_path: Path, tiny_model_dir: Path) -> None:
    marker = f"LOCKGATE_TEST_RUN={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    kb = build_cpu_kb(tmp_path / "kb", SMALL)
    write_transcripts(tmp_path / "sft.jsonl", fresh_transcripts(40, seed=0))

    _lockgate(
        "sft", str(CONFIGS / "sft_cpu.yaml"),
        "--set", f"model.path={tiny_model_dir}", "--set", f"data.path={tmp_path / 'sft.jsonl'}",
        "--set", "data.val_path=null", "--set", f"out_dir={tmp_path / 'sft'}",
        "--set", "loop.max_steps=3", "--set", "loop.batch_size=8", "--set", "trainer.num_threads=1",
        env=env,
    )  # fmt: skip
    sft_model = tmp_path / "sft" / "final"
    assert (sft_model / "config.json").is_file()

    # The start's evaluation starts a replica of its own.
    out = tmp_path / "eval.json"
    eval_args = ["--kb-dir", str(kb), "--n", "4", "--agent", '{"max_tokens": 24}']
    started = _evaluate(
        "run", "--model", str(sft_model), "--out", str(out), *eval_args, "--replicas", "1",
        "--oracle", "--no-search", "--samples", "2",
        env=env,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["weights_version"] is None
    names = [s["name"] for s in report["summaries"]]
    assert names == ["oracle", "model T=1", "model T=0", "no-search T=1", "no-search T=0"]
    assert all(s["n"] == 4 for s in report["summaries"])
    # Two episodes per question for the model at T=1; one greedy, and one for the no-search
    # baseline at any temperature (made-up entities leave it at 0 whatever it samples).
    assert [len(report["outcomes"][n]) for n in names] == [4, 8, 4, 4, 4]
    assert report["summaries"][0]["success"] >= 0.75  # the oracle finds what it needs
    oracle_calls = report["summaries"][0]["tool_calls_by_hops"]
    # One search for a 1-hop question; a 2-hop one stops early only where a search failed.
    assert oracle_calls.get("1", 1.0) == 1.0
    assert all(1.0 <= v <= 2.0 for v in oracle_calls.values())
    compared = subprocess.run(
        [sys.executable, "-m", "lockgate.examples.deepresearch.evaluate", "compare", str(out), str(out)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert compared.stdout.splitlines()[0].startswith("held-out success (T=1): ")
    assert processes_with_marker(marker) == []

    # RL on a replica it is given, then the evaluation of what RL left in it.
    run_dir = tmp_path / "rl"
    with _replica(sft_model, tmp_path / "replica", env) as url:
        assert weights_versions([url]) == [0]  # vLLM's label until a gateway sets one
        # No screening: a model of 3 SFT steps would fail nearly every screen, and groups of 2
        # leave nothing to screen (tests/unit/coordinator/test_loop_resume_logic.py covers it).
        result = _lockgate(
            "train", str(CONFIGS / "rl_cpu.yaml"), "--run-dir", str(run_dir),
            "--set", f"model.path={sft_model}", "--set", f"environment.args.kb_dir={kb}",
            "--set", "environment.args.num_val=4", "--set", "environment.args.agent.max_tokens=24",
            "--set", "gateway.sampling.max_tokens=24", "--set", f"replicas.urls=[{url}]",
            "--set", "trainer_first=true",
            "--set", "loop.steps=2", "--set", "loop.groups_per_step=2", "--set", "loop.group_size=2",
            "--set", "algorithm.drop_zero_variance=false", "--set", "algorithm.screen_size=0",
            "--set", "loop.val_every=2",
            "--set", "trainer.checkpoint_every=0",
            env=env,
        )  # fmt: skip
        assert "mean reward: first steps" in result.stdout
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2]
        assert records[-1]["count/rerender_splits"] == 0
        assert records[0]["val/tasks"] == 4 and records[0]["val/failed"] == 0
        assert (run_dir / "logs" / "agents" / "retrieval.log").is_file()
        with sqlite3.connect(run_dir / "trajectories.sqlite") as db:
            metadata = [json.loads(m) for (m,) in db.execute("SELECT metadata FROM sessions")]
        recorded = [m for m in metadata if "ended" in m]
        assert len(recorded) >= 8  # every finished rollout said how it ended
        assert all({"turns", "tool_calls", "tool_errors", "f1", "em"} <= set(m) for m in recorded)

        rl_out = tmp_path / "eval_rl.json"
        given = ["--replica-urls", url, "--samples", "2"]
        wrong = _evaluate("run", "--model", str(sft_model), "--out", str(rl_out), *eval_args,
                          *given, "--expect-weight-version", "3", env=env)  # fmt: skip
        assert wrong.returncode != 0 and not rl_out.exists()
        assert "hold weight version 2, not 3" in wrong.stderr.strip().splitlines()[-1]
        right = _evaluate("run", "--model", str(sft_model), "--out", str(rl_out), *eval_args,
                          *given, "--expect-weight-version", "2", env=env)  # fmt: skip
        assert right.returncode == 0, right.stderr[-3000:]
        rl_report = json.loads(rl_out.read_text())
        assert rl_report["weights_version"] == 2
        assert [s["name"] for s in rl_report["summaries"]] == ["model T=1", "model T=0"]
        assert [len(v) for v in rl_report["outcomes"].values()] == [8, 4]
        # Its gateway recorded the episodes under the version the replica holds.
        with sqlite3.connect(rl_out.with_suffix("") / "trajectories.sqlite") as db:
            spans = [json.loads(v) for (v,) in db.execute("SELECT versions FROM calls")]
        assert spans and {span["version"] for call in spans for span in call} == {2}
    # The run stopped its own parts and left the replica it was given; that one went with
    # `lockgate replicas`.
    assert processes_with_marker(marker) == []
