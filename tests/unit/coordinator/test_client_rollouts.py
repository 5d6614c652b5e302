"""Client-driven rollouts through the loop: the real gateway app (in process, over a fake
replica) and the real TrainingLoop with its ClientSource, a fake trainer, and a client that
enrols sessions over HTTP with the enrolment key as any client would.

Held here: groups are formed from finished client sessions and trained on, an incomplete group
waits, a new group past the capacity rule is refused (429) until a sync admits it, and a
dropped group frees its slot. tests/vllm/test_client_driven.py runs it all for real."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from lockgate.coordinator.config import LoopSection, RunConfig, SyncSection
from lockgate.coordinator.loop.client_rollouts import ClientSource, enrol_clients
from lockgate.coordinator.loop.training import TrainingLoop
from lockgate.coordinator.metrics.log import MetricsLog
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.client import GatewayClient
from lockgate.gateway.records.metrics_file import read_metrics
from lockgate.trainer.batch import StepResult, TrainBatch
from lockgate.trainer.protocol import ExportLayout
from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica, serve_gateway


@dataclass
class RecordingTrainer:
    weights: str  # a real model dir: the fake replica's "load" is verified by its label
    batches: list[TrainBatch] = field(default_factory=list)
    trained: asyncio.Event = field(default_factory=asyncio.Event)

    def snapshot_dir(self, step: int) -> Path:
        return Path(self.weights)

    def set_export_layout(self, layout: ExportLayout) -> None:
        pass

    async def train_step(self, batch: TrainBatch) -> StepResult:
        self.batches.append(batch)
        self.trained.set()
        return StepResult(step=batch.step, weights_dir=self.weights, metrics={})

    def commit(self, step: int) -> None:
        pass


@dataclass
class Stack:
    http: httpx.AsyncClient  # to the gateway, as a client of the run would reach it
    admin: GatewayClient  # the coordinator's
    tmp_path: Path
    model_dir: Path

    def loop(self, config: LoopSection, key_path: Path) -> tuple[TrainingLoop, RecordingTrainer]:
        source, enrolment = enrol_clients(self.admin, self.tmp_path, config.group_size)
        source.wait_s = 0.2
        key_path.write_text(enrolment.key)
        trainer = RecordingTrainer(str(self.model_dir))
        metrics = MetricsLog(RunDir(self.tmp_path).metrics, config.steps, stream=io.StringIO())
        loop = TrainingLoop(
            config, None, self.admin, trainer, metrics,  # type: ignore[arg-type]
            sync=SyncSection(snapshot_layout="hf"), source=source,
        )  # fmt: skip
        return loop, trainer


@pytest.fixture
async def stack(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Stack]:
    replica = FakeReplica(completion=[5, 6, 7])
    async with serve_gateway(tiny_model_dir, tmp_path, {REPLICA: replica}) as (http, app):
        admin = GatewayClient("http://gw", ADMIN, transport=httpx.ASGITransport(app=app))
        yield Stack(http, admin, tmp_path, tiny_model_dir)
        await admin.aclose()


class Client:
    """One client of the run: enrols sessions with the key, calls the model, finishes them."""

    def __init__(self, http: httpx.AsyncClient, key: str) -> None:
        self.http = http
        self.headers = {"Authorization": f"Bearer {key}"}

    async def enrol(self, task_id: str, group_id: str) -> httpx.Response:
        body = {"task_id": task_id, "group_id": group_id}
        return await self.http.post("/v1/sessions", json=body, headers=self.headers)

    async def session(self, task_id: str, group_id: str) -> dict[str, Any]:
        """A session in the group that made one model call, retrying while the gateway says
        429 (or 503: the enrolment is not open yet) as a client honouring Retry-After would."""
        async with asyncio.timeout(10.0):
            while (r := await self.enrol(task_id, group_id)).status_code in (429, 503):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert r.status_code == 201, r.text
        created: dict[str, Any] = r.json()
        chat = await self.http.post(
            created["base_url"] + "/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": task_id}]},
        )
        assert chat.status_code == 200, chat.text
        return created

    async def finish(self, created: dict[str, Any], reward: float) -> None:
        r = await self.http.post(
            created["base_url"].removesuffix("/v1") + "/finish", json={"reward": reward}
        )
        assert r.status_code == 200, r.text


async def _eventually(check: Any, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_finished_client_groups_are_trained_an_incomplete_one_waits_and_the_gate_holds(
    stack: Stack,
) -> None:
    # η = 0, one group per step: a second group may start only once step 1's weights serve.
    config = LoopSection(steps=2, groups_per_step=1, group_size=2, max_staleness=0)
    loop, trainer = stack.loop(config, stack.tmp_path / "key")
    run = asyncio.create_task(loop.run())
    client = Client(stack.http, (stack.tmp_path / "key").read_text())
    # The enrolment opens when the loop starts (until then: 503, retried).
    a1 = await client.session("t0", "gA")
    a2 = await client.session("t0", "gA")
    refused = await client.enrol("t1", "gB")
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1

    await client.finish(a1, 1.0)
    await asyncio.sleep(0.5)  # several collect rounds: one member still runs
    assert trainer.batches == []
    await client.finish(a2, 0.0)
    await _eventually(lambda: len(trainer.batches) == 1)

    # After step 1's sync the gate admits the next group.
    await _eventually(lambda: loop.version == 1)
    b = [await client.session("t1", "gB"), await client.session("t1", "gB")]
    for created, reward in zip(b, (0.0, 1.0), strict=True):
        await client.finish(created, reward)
    summary = await asyncio.wait_for(run, 10.0)

    assert summary.steps == 2 and summary.version == 2
    first, second = trainer.batches
    # Each batch holds its group's two sessions, with GRPO advantages of opposite signs.
    for batch in (first, second):
        signs = sorted(max(s.advantages, key=abs) > 0 for s in batch.samples)
        assert signs == [False, True]
    records = read_metrics(RunDir(stack.tmp_path).metrics)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["batch/groups"] == 1 and r["batch/rollouts"] == 2 for r in records)
    assert records[-1]["count/syncs"] == 2 and records[-1]["staleness/max"] == 0
    assert RunDir(stack.tmp_path).enrolment.stat().st_mode & 0o777 == 0o600


async def test_a_dropped_group_frees_its_slot_for_another(stack: Stack) -> None:
    # Two groups per step with η = 0: two may start; one whose rewards are all equal is
    # dropped (drop_zero_variance via min_group_size here: both failed) and its slot comes back.
    config = LoopSection(steps=1, groups_per_step=2, group_size=2, max_staleness=0)
    loop, trainer = stack.loop(config, stack.tmp_path / "key")
    run = asyncio.create_task(loop.run())
    client = Client(stack.http, (stack.tmp_path / "key").read_text())
    g1 = [await client.session("t0", "g1"), await client.session("t0", "g1")]
    g2 = [await client.session("t1", "g2"), await client.session("t1", "g2")]
    assert (await client.enrol("t2", "g3")).status_code == 429  # (0 + 0 + 1) * 2 started
    for created in g2:  # failed rollouts: fewer than min_group_size usable, dropped
        r = await client.http.post(
            created["base_url"].removesuffix("/v1") + "/finish",
            json={"status": "failed", "error": "tool_crashed"},
        )
        assert r.status_code == 200
    g3 = [await client.session("t2", "g3"), await client.session("t2", "g3")]
    for created, reward in zip(g1 + g3, (1.0, 0.0, 0.5, 0.0), strict=True):
        await client.finish(created, reward)
    summary = await asyncio.wait_for(run, 10.0)
    assert summary.counters["groups_dropped/too_few_rollouts"] == 1
    assert summary.counters["rollouts_failed"] == 2
    (batch,) = trainer.batches
    assert len(batch.samples) == 4  # g1 and g3, two sessions each


def test_the_gateway_may_start_groups_up_to_the_capacity_less_the_slots_held() -> None:
    class Sink:
        def __init__(self, version: int, started: int) -> None:
            from lockgate.coordinator.loop.staleness import StalenessController

            self.version = version
            self.controller = StalenessController(4, 1, groups_started=started)

    # Fresh run at version 0, η = 1, B = 4: 8 groups; resumed after step 3 (12 slots held) at
    # version 3: (3 + 2) * 4 - 12 = 8 more; a dropped group (one slot freed) makes it 9.
    assert ClientSource.admitted(Sink(0, 0)) == 8  # type: ignore[arg-type]
    assert ClientSource.admitted(Sink(3, 12)) == 8  # type: ignore[arg-type]
    assert ClientSource.admitted(Sink(3, 11)) == 9  # type: ignore[arg-type]


def test_client_mode_is_chosen_in_the_loop_section_and_refuses_screening() -> None:
    assert RunConfig().loop.rollouts == "dispatch"
    assert RunConfig.model_validate({"loop": {"rollouts": "client"}}).loop.rollouts == "client"
    with pytest.raises(ValidationError, match="screen_size"):
        RunConfig.model_validate({"loop": {"rollouts": "client"}, "algorithm": {"screen_size": 2}})
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"loop": {"rollouts": "clients"}})
