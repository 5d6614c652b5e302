"""A client-driven run killed and resumed (`lockgate train --resume`, `loop.rollouts: client`):
the real gateway app in process (standing for a gateway that outlives the coordinator: the
hardest case, since it still holds every group it completed), the real TrainingLoop with its
ClientSource and the launcher's resume point (`_resume_point`), a trainer that never finishes
the step the kill interrupts, and clients enrolling with the key over HTTP.

Held here: the enrolment key stays valid across the resume (the same key, in the same
owner-only file, opens the new enrolment, and a client that read it before the kill goes on
with it); no group trained before the kill is trained again; the group trained in the step the
kill cut (never checkpointed) is abandoned, as documented; the run's steps stay contiguous."""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass, field
from typing import Any

from lockgate.coordinator.config import LoopSection, SyncSection
from lockgate.coordinator.launch.local import _resume_point
from lockgate.coordinator.loop.client_rollouts import EnrolmentFile, enrol_clients
from lockgate.coordinator.loop.state import LoopState
from lockgate.coordinator.loop.training import TrainingLoop
from lockgate.coordinator.metrics.log import MetricsLog
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.records.metrics_file import read_metrics
from lockgate.trainer.batch import StepResult, TrainBatch
from tests.unit.coordinator.test_client_rollouts import (
    Client,
    RecordingTrainer,
    Stack,
    _eventually,
)

# The fixture of the client-driven tests: the gateway app in process and its admin client.
from tests.unit.coordinator.test_client_rollouts import stack as stack

# η = 1, one group per step, pairs: two groups may run ahead of the trainer.
CONFIG = LoopSection(steps=3, groups_per_step=1, group_size=2, max_staleness=1)


@dataclass
class KilledTrainer(RecordingTrainer):
    """Never finishes step `killed_at` (the kill comes during it); checkpoints what is
    committed, as the real trainer does only once the loop commits a step."""

    killed_at: int = 0
    committed: list[int] = field(default_factory=list)

    async def train_step(self, batch: TrainBatch) -> StepResult:
        if batch.step == self.killed_at:
            self.batches.append(batch)
            await asyncio.Event().wait()
        return await super().train_step(batch)

    def commit(self, step: int) -> None:
        self.committed.append(step)


def _loop(
    stack: Stack, trainer: RecordingTrainer, resume: LoopState | None
) -> tuple[TrainingLoop, EnrolmentFile]:
    run = RunDir(stack.tmp_path)
    source, enrolment = enrol_clients(
        stack.admin, stack.tmp_path, CONFIG.group_size, resume=resume is not None
    )
    source.wait_s = 0.2
    metrics = MetricsLog(run.metrics, CONFIG.steps, stream=io.StringIO())
    loop = TrainingLoop(
        CONFIG, None, stack.admin, trainer, metrics,  # type: ignore[arg-type]
        sync=SyncSection(snapshot_layout="hf"), source=source, state_path=run.loop_state,
        resume=resume,
    )  # fmt: skip
    return loop, enrolment


async def _group(client: Client, task: str, rewards: tuple[float, float]) -> None:
    """A pair of sessions of `task` in one group, run and finished with `rewards`."""
    sessions = [await client.session(task, f"g-{task}") for _ in rewards]
    for created, reward in zip(sessions, rewards, strict=True):
        await client.finish(created, reward)


def _tasks_trained(tokenizer: Any, batch: TrainBatch) -> set[str]:
    """The tasks of a batch's samples (each task's prompt names it; see Client.session)."""
    tasks = set()
    for sample in batch.samples:
        text = tokenizer.decode(sample.input_ids)
        tasks |= {t for t in ("alpha", "bravo", "charlie", "delta") if t in text}
    return tasks


async def test_a_resumed_client_driven_run_keeps_its_key_and_trains_no_group_twice(
    stack: Stack,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(stack.model_dir))
    run = RunDir(stack.tmp_path)

    # Before the kill: alpha trains at step 1 (checkpointed), bravo is taken by step 2, which
    # the kill interrupts (its state line written, its batch never trained).
    before = KilledTrainer(str(stack.model_dir), killed_at=2)
    loop, enrolment = _loop(stack, before, None)
    running = asyncio.create_task(loop.run())
    client = Client(stack.http, enrolment.key)
    await _group(client, "alpha", (1.0, 0.0))
    await _eventually(lambda: before.committed == [1])
    await _group(client, "bravo", (0.0, 1.0))
    await _eventually(lambda: len(before.batches) == 2)
    running.cancel()  # the kill
    await asyncio.gather(running, return_exceptions=True)
    assert [_tasks_trained(tokenizer, b) for b in before.batches] == [{"alpha"}, {"bravo"}]

    # While no coordinator runs, the clients go on: the gateway (which outlived it) keeps
    # taking their sessions under the key, and charlie completes.
    await _group(client, "charlie", (1.0, 0.0))

    # The resume, from the trainer's checkpoint (step 1), as `lockgate train --resume` does.
    state, rewards = _resume_point(stack.tmp_path, before.committed[-1], True)
    assert state is not None and state.step == 1 and len(rewards) == 1
    after = RecordingTrainer(str(stack.model_dir))
    loop, resumed = _loop(stack, after, state)
    assert resumed.key == enrolment.key
    assert EnrolmentFile.model_validate_json(run.enrolment.read_text()).key == enrolment.key
    assert run.enrolment.stat().st_mode & 0o777 == 0o600
    running = asyncio.create_task(loop.run())
    # The client that read the key before the kill goes on with it.
    await _group(client, "delta", (0.0, 1.0))
    summary = await asyncio.wait_for(running, 10.0)

    assert summary.version == 3  # the resync to step 1's weights, then steps 2 and 3
    trained = [_tasks_trained(tokenizer, b) for b in after.batches]
    # Charlie, completed while no coordinator ran, is trained; neither alpha (trained before
    # the kill) nor bravo (handed to the step the kill cut, so abandoned) is trained again.
    assert trained == [{"charlie"}, {"delta"}]
    assert [b.step for b in after.batches] == [2, 3]
    assert [r["step"] for r in read_metrics(run.metrics)] == [1, 2, 3]
    assert [r["step"] for r in read_metrics(run.loop_state)] == [1, 2, 3]
