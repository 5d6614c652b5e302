"""The loop's task cursor and resume, and validation metrics, against an in-memory gateway and
trainer: no replicas, so the out-of-order completion that makes the cursor hard is driven by
random agent delays, in under a second."""

from __future__ import annotations

import asyncio
import io
import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from lockgate.agent_runtime import RolloutContext, RolloutResult, Task
from lockgate.coordinator.config import AlgorithmSection, LoopSection, RunConfig, SyncSection
from lockgate.coordinator.loop.state import (
    LoopState,
    append_state,
    load_state,
    truncate_steps,
)
from lockgate.coordinator.loop.training import TrainingLoop
from lockgate.coordinator.loop.validation import validation_metrics
from lockgate.coordinator.metrics.log import MetricsLog
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.records.metrics_file import read_metrics
from lockgate.gateway.schema import (
    CreatedSession,
    LoadReport,
    PauseReport,
    SessionInfo,
    SessionSamples,
    StageReport,
    TrajectorySample,
    WeightsLayout,
)
from lockgate.trainer.batch import StepResult, TrainBatch
from lockgate.trainer.protocol import ExportLayout


class FakeGateway:
    """Records sessions; every sampled token carries the version being served."""

    def __init__(self) -> None:
        self.version = 0
        self.loads: list[int] = []
        self.sync_calls: list[str] = []
        self.layout_calls = 0
        self.layout = WeightsLayout(transposed={"l.qkv.weight": ["l.q.weight"]}, hf_because={})
        self._ids = itertools.count()
        self._sessions: dict[str, tuple[str, float | None]] = {}
        self._token_version: dict[str, int] = {}
        self.group_sessions: Counter[str] = Counter()

    async def create_session(
        self, task_id: str, group_id: str | None = None, metadata: dict[str, Any] | None = None
    ) -> CreatedSession:
        sid = f"s{next(self._ids)}"
        self.group_sessions[group_id or ""] += 1
        self._sessions[sid] = (task_id, None)
        return CreatedSession(session_id=sid, api_key="k", base_url="/x")

    def sample_now(self, sid: str) -> None:
        self._token_version[sid] = self.version

    async def finish_session(
        self,
        sid: str,
        *,
        reward: float | None = None,
        failed: bool = False,
        error: str | None = None,
    ) -> SessionInfo:
        self._sessions[sid] = (self._sessions[sid][0], reward)
        return self._info(sid)

    def _info(self, sid: str) -> SessionInfo:
        task_id, reward = self._sessions[sid]
        return SessionInfo(
            session_id=sid, task_id=task_id, group_id=None, metadata={}, status="finished",
            reward=reward, error=None, created_at=0.0, finished_at=0.0, num_calls=1,
            rerender_splits=0,
        )  # fmt: skip

    async def samples(self, sid: str) -> SessionSamples:
        v = self._token_version[sid]
        sample = TrajectorySample(
            input_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0],
            versions=[-1, v, v], call_indices=[0],
        )  # fmt: skip
        return SessionSamples(session=self._info(sid), samples=[sample], splits=0)

    async def weights_layout(self) -> WeightsLayout:
        self.layout_calls += 1
        return self.layout

    async def stage_weights(self, path: str, slice_s: float) -> StageReport:
        self.sync_calls.append(f"stage {Path(path).name}")
        return StageReport(staged={}, not_staged={}, stage_s=0.0)

    async def pause(self, mode: str, timeout_s: float) -> PauseReport:
        self.sync_calls.append("pause")
        return PauseReport(
            mode="abort", latency_s=0.0, interrupted=0, tokens_kept=0, frozen=0, version=0
        )

    async def load_weights(self, path: str, version: int) -> LoadReport:
        self.loads.append(version)
        self.sync_calls.append(f"load {Path(path).name}")
        return LoadReport(version=version, loaded=["r"], failed={}, load_s=0.0)

    async def resume(self, version: int) -> None:
        self.version = version


class FakeTrainer:
    def __init__(self, metrics_path: Path) -> None:
        self.steps: list[int] = []
        self.metrics_path = metrics_path

        self.layouts: list[tuple[int, ExportLayout]] = []  # (steps trained before, layout)

    def snapshot_dir(self, step: int) -> Path:
        return Path(f"/weights/step_{step}")

    def set_export_layout(self, layout: ExportLayout) -> None:
        self.layouts.append((len(self.steps), layout))

    async def train_step(self, batch: TrainBatch) -> StepResult:
        self.steps.append(batch.step)
        await asyncio.sleep(0.01)
        return StepResult(step=batch.step, weights_dir=f"/w/{batch.step}", metrics={})

    def commit(self, step: int) -> None:
        # What makes a checkpoint of `step` safe to resume from: its record is already on disk.
        assert step == self.steps[-1], "a step is committed right after it trained"
        assert read_metrics(self.metrics_path)[-1]["step"] == step


class FakeEnv:
    def __init__(self, gateway: FakeGateway, seed: int) -> None:
        self.gateway = gateway
        self.rng = random.Random(seed)
        self.tasks = [Task(id=f"t{i}") for i in range(5)]

    def score(self, task: Task) -> float:
        return self.rng.random()

    def train_tasks(self) -> Sequence[Task]:
        return self.tasks

    @property
    def agent(self):  # type: ignore[no-untyped-def]
        async def act(task: Task, ctx: RolloutContext) -> float:
            self.gateway.sample_now(ctx.session_id)
            # Long-tailed delays: groups finish far out of dispatch order.
            await asyncio.sleep(0.002 * self.rng.lognormvariate(0, 1.2))
            return self.score(task)

        return act

    @property
    def reward(self) -> None:
        return None


class PassFailEnv(FakeEnv):
    """Tasks t0 and t1 always fail (reward 0), t2 always passes, t3 and t4 pass half the time."""

    def score(self, task: Task) -> float:
        chance = {"t0": 0.0, "t1": 0.0, "t2": 1.0}.get(task.id, 0.5)
        return float(self.rng.random() < chance)


def _loop(
    tmp_path: Path,
    steps: int,
    eta: int,
    resume: LoopState | None = None,
    seed: int = 0,
    sync: SyncSection | None = None,
    config: LoopSection | None = None,
    env: type[FakeEnv] = FakeEnv,
    algorithm: AlgorithmSection | None = None,
):  # type: ignore[no-untyped-def]
    gateway = FakeGateway()
    config = config or LoopSection(steps=steps, groups_per_step=3, group_size=2, max_staleness=eta)
    metrics = MetricsLog(tmp_path / "metrics.jsonl", steps, stream=io.StringIO())
    loop = TrainingLoop(
        config, env(gateway, seed), gateway, FakeTrainer(tmp_path / "metrics.jsonl"),
        metrics,  # type: ignore[arg-type]
        state_path=RunDir(tmp_path).loop_state, resume=resume, sync=sync, algorithm=algorithm,
    )  # fmt: skip
    return loop, gateway


def _states(tmp_path: Path) -> list[LoopState]:
    return [LoopState.model_validate_json(line) for line in RunDir(tmp_path).loop_state.open()]


def test_a_resumed_loop_trains_every_dispatched_task_once_and_skips_none(tmp_path: Path) -> None:
    loop, _ = _loop(tmp_path, steps=4, eta=2, seed=1)
    asyncio.run(loop.run())
    assert [s.step for s in _states(tmp_path)] == [1, 2, 3, 4]
    # As if killed after the trainer checkpointed step 2: later records are cut off.
    truncate_steps(RunDir(tmp_path).loop_state, 2)
    at_checkpoint = load_state(RunDir(tmp_path).loop_state, 2)
    assert at_checkpoint.pending, "the test needs groups in flight at the checkpoint"
    resumed, gateway = _loop(tmp_path, steps=5, eta=2, resume=at_checkpoint, seed=2)
    summary = asyncio.run(resumed.run())
    assert summary.steps == 3 and summary.version == 5
    assert gateway.loads[0] == 2  # replicas synced to the checkpoint's weights before dispatch
    assert "pause" in gateway.sync_calls
    assert not [c for c in gateway.sync_calls if c.startswith("stage")]  # sync.stage is opt-in

    states = _states(tmp_path)
    assert [s.step for s in states] == [1, 2, 3, 4, 5]
    trained = [serial for s in states for serial in s.trained]
    dropped = [serial for s in states for serial in s.dropped]
    assert len(trained) == 5 * 3 and len(set(trained)) == len(trained)  # none twice
    # Every serial below the cursor is trained, dropped or still pending: none skipped.
    last = states[-1]
    assert sorted([*trained, *dropped, *last.pending]) == list(range(last.next_serial))


def test_screening_drops_a_group_none_of_whose_first_k_pass_before_generating_the_rest(
    tmp_path: Path,
) -> None:
    config = LoopSection(steps=6, groups_per_step=3, group_size=4, max_staleness=1)
    algorithm = AlgorithmSection(screen_size=2, drop_zero_variance=True)
    loop, gateway = _loop(
        tmp_path, steps=6, eta=1, seed=3, config=config, env=PassFailEnv, algorithm=algorithm
    )
    asyncio.run(loop.run())
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]
    states = _states(tmp_path)
    trained = {serial for s in states for serial in s.trained}
    dropped = {serial for s in states for serial in s.dropped}
    assert sorted([*trained, *dropped, *states[-1].pending]) == list(range(states[-1].next_serial))
    # Sessions per group id (g<serial>-<task>) of the groups that ended before the last record;
    # those still running when the run ended may have stopped anywhere.
    ended: dict[str, list[int]] = {}
    trained_tasks = set()
    for group_id, sessions in gateway.group_sessions.items():
        serial, task = group_id[1:].split("-", 1)
        if int(serial) in trained | dropped:
            ended.setdefault(task, []).append(sessions)
        if int(serial) in trained:
            trained_tasks.add(task)
    # Hopeless tasks stop at the screen; t2 passes it and runs whole (then has no variance).
    assert set(ended["t0"]) == {2} and set(ended["t1"]) == {2} and set(ended["t2"]) == {4}
    # A half-chance task is screened out when both its first two fail, else it runs whole.
    assert set(ended["t3"] + ended["t4"]) == {2, 4}
    # The last record also counts groups screened out after the last state was saved; none
    # that did not stop at two.
    stopped = sum(n == 2 for sizes in ended.values() for n in sizes)
    at_two = sum(n == 2 for n in gateway.group_sessions.values())
    assert 0 < stopped <= last["count/groups_dropped/screened_out"] <= at_two
    assert last["batch/groups"] == 3
    assert trained_tasks <= {"t3", "t4"}  # t0-t2 never vary


def test_a_screen_as_large_as_the_group_is_refused() -> None:
    with pytest.raises(ValidationError, match="screen_size=4 must be below group_size=4"):
        RunConfig.model_validate({"loop": {"group_size": 4}, "algorithm": {"screen_size": 4}})


def test_eta_zero_trains_only_tokens_of_the_version_the_step_starts_from(tmp_path: Path) -> None:
    loop, gateway = _loop(tmp_path, steps=4, eta=0, sync=SyncSection(stage=True))
    asyncio.run(loop.run())
    # Each sync has the replicas stage its snapshot while serving, then pauses and loads it.
    calls = gateway.sync_calls
    syncs = [calls[i : i + 3] for i in range(0, len(calls), 3)]
    assert len(syncs) == 4
    assert all(s[0].startswith("stage ") and s[1:] == ["pause", "load" + s[0][5:]] for s in syncs)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["staleness/hist"] == {"0": r["batch/loss_tokens"]}


def test_the_trainer_writes_each_snapshot_in_the_layout_the_replicas_ask_for_then(
    tmp_path: Path,
) -> None:
    loop, gateway = _loop(tmp_path, steps=3, eta=1)
    first = gateway.layout
    second = WeightsLayout(transposed={}, hf_because={"http://new-replica": "no direct load"})

    async def run() -> None:
        # A replica without the direct load joins after step 1 trained: HF from step 2 on.
        trained = loop.trainer.train_step  # type: ignore[attr-defined]

        async def train_step(batch: TrainBatch) -> StepResult:
            result = await trained(batch)
            gateway.layout = second
            return result

        loop.trainer.train_step = train_step  # type: ignore[method-assign]
        await loop.run()

    asyncio.run(run())
    assert gateway.layout_calls == 3  # before every batch
    assert loop.trainer.layouts == [  # type: ignore[attr-defined]
        (0, ExportLayout(transposed=first.transposed)),  # told before step 1's batch
        (1, ExportLayout()),  # and again only when it changed
    ]
    # snapshot_layout = "hf": the trainer is never told, so it writes HF layout.
    loop, gateway = _loop(tmp_path / "hf", steps=2, eta=1, sync=SyncSection(snapshot_layout="hf"))
    asyncio.run(loop.run())
    assert gateway.layout_calls == 0
    assert loop.trainer.layouts == []  # type: ignore[attr-defined]


def test_state_lines_load_by_step_and_truncate_ignoring_a_half_written_line(tmp_path: Path) -> None:
    path = RunDir(tmp_path).loop_state
    for step in (1, 2, 3):
        append_state(
            path,
            LoopState(step=step, version=step - 1, next_serial=3 * step, pending=[step],
                      trained=[0], dropped=[]),
        )  # fmt: skip
    with path.open("a") as f:
        f.write('{"step": 4, "vers')  # killed mid-write
    assert load_state(path, 2).next_serial == 6
    assert truncate_steps(path, 2) == 2
    assert [LoopState.model_validate_json(x).step for x in path.read_text().splitlines()] == [1, 2]
    try:
        load_state(path, 3)
    except ValueError as exc:
        assert "no state for step 3" in str(exc)
    else:
        raise AssertionError("expected a ValueError")
    assert truncate_steps(tmp_path / "missing.jsonl", 0) == 0


def test_validation_metrics_leave_failed_rollouts_out_of_the_mean() -> None:
    def result(status: str, reward: float | None) -> RolloutResult:
        return RolloutResult(
            session_id="s", task_id="t", group_id="g", status=status,  # type: ignore[arg-type]
            reward=reward, duration_s=0.1,
        )  # fmt: skip

    m = validation_metrics(
        [result("finished", 1.0), result("finished", 0.0), result("failed", None)], 3, 2.0
    )
    assert m["val/reward_mean"] == 0.5 and m["val/reward_std"] == 0.5
    assert m["val/tasks"] == 3 and m["val/failed"] == 1 and m["val/version"] == 3
    assert math.isnan(validation_metrics([result("failed", None)], 0, 0.0)["val/reward_mean"])


def test_the_entropy_term_is_set_in_the_algorithm_section_not_the_trainers() -> None:
    """`trainer.entropy_coef` is refused with a message naming where it moved; the value of
    `algorithm.entropy_coef` is kept for the launch to hand to the trainer."""
    with pytest.raises(ValidationError, match=r"algorithm\.entropy_coef"):
        RunConfig.model_validate({"trainer": {"entropy_coef": -1.0}})
    config = RunConfig.model_validate({"algorithm": {"entropy_coef": -1.0}})
    assert "entropy_coef" not in config.trainer.model_dump()
    assert config.algorithm.entropy_coef == -1.0
