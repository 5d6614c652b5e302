"""The loop's side of a collective weight sync (coordinator/loop/training.py `_load`): the
gateway's receive and the trainer's send run at the same time over one group (one rank per
replica the gateway has), the first failure of either fails the load and cancels the other, and
a group whose port or backend launch never chose is refused, and the group is formed again (the
new id, sized to the replicas) when the gateway's replicas change or a load failed."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest

from lockgate.coordinator.config import LoopSection, SyncSection
from lockgate.coordinator.errors import RunFailed
from lockgate.coordinator.loop import training
from lockgate.coordinator.loop.training import TrainingLoop
from lockgate.coordinator.metrics.log import MetricsLog
from lockgate.gateway.schema import CollectiveWeights, LoadReport
from lockgate.trainer.protocol import SendWeights, WeightsSent


class Replica:
    def __init__(self, url: str) -> None:
        self.url = url
        self.healthy = url != "down"
        self.stale = False


class Status:
    def __init__(self, urls: list[str]) -> None:
        self.replicas = [Replica(url) for url in urls]


class Gateway:
    def __init__(self, both_started: asyncio.Event) -> None:
        self.both_started = both_started
        self.broken = asyncio.Event()  # the trainer's side failed: the group never forms
        self.sources: list[CollectiveWeights] = []
        self.cancelled = False
        self.replicas = ["r1", "r2"]

    async def status(self) -> Status:
        return Status(self.replicas)

    async def load_collective(self, source: CollectiveWeights, version: int) -> LoadReport:
        self.sources.append(source)
        try:
            # A receive completes only while the trainer sends, as over a real group, and
            # fails (after a while) when the trainer's side does.
            formed = asyncio.ensure_future(self.both_started.wait())
            broken = asyncio.ensure_future(self.broken.wait())
            await asyncio.wait({formed, broken}, return_when=asyncio.FIRST_COMPLETED)
            formed.cancel(), broken.cancel()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if not self.both_started.is_set():
            await asyncio.sleep(0.05)  # the replicas' join timeout, after the trainer's
            raise RunFailed("replica r1: the group never formed")
        return LoadReport(version=version, loaded=["r1", "r2"], failed={}, load_s=0.1)


class Trainer:
    def __init__(self, both_started: asyncio.Event, fail: int = 0) -> None:
        self.both_started = both_started
        self.requests: list[SendWeights] = []
        self.fail = fail  # how many sends fail from now on
        self.gateway: Gateway | None = None

    async def send_weights(self, request: SendWeights) -> WeightsSent:
        self.requests.append(request)
        if self.fail:
            self.fail -= 1
            if self.gateway is not None:
                self.gateway.broken.set()
            raise RunFailed("rank 0: the group broke")
        if self.gateway is not None:
            self.gateway.broken.clear()
        self.both_started.set()
        return WeightsSent(step=request.step, bytes=10, join_s=0.0, send_s=0.1)


@pytest.fixture(autouse=True)
def _no_retry_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(training, "_COLLECTIVE_RETRY_WAIT_S", 0.0)


def _loop(tmp_path: Path, gateway: Gateway, trainer: Trainer, **collective: Any) -> TrainingLoop:
    trainer.gateway = gateway
    sync = SyncSection.model_validate(
        {"transport": "collective", "collective": {"port": 29555, "backend": "gloo", **collective}}
    )
    metrics = MetricsLog(tmp_path / "metrics.jsonl", 1, stream=io.StringIO())
    env: Any = type("Env", (), {"train_tasks": lambda self: [object()]})()
    return TrainingLoop(LoopSection(steps=1), env, gateway, trainer, metrics, sync=sync)  # type: ignore[arg-type]


async def test_the_receive_and_the_send_run_together_over_one_group(tmp_path: Path) -> None:
    both = asyncio.Event()
    gateway, trainer = Gateway(both), Trainer(both)
    loop = _loop(tmp_path, gateway, trainer)
    report = await asyncio.wait_for(loop._load("", 4), 5)
    assert report.loaded == ["r1", "r2"]
    (source,) = gateway.sources
    assert (source.world_size, source.port, source.backend) == (3, 29555, "gloo")
    (request,) = trainer.requests
    assert request.step == 4
    assert request.group.model_dump() == source.model_dump(exclude={"transport"})
    await asyncio.wait_for(loop._load("", 5), 5)
    assert gateway.sources[1] == source  # the same group at the next sync


async def test_a_change_of_replicas_or_a_failed_load_forms_the_group_again(
    tmp_path: Path,
) -> None:
    """A replacement (a new URL where a dead one was), one more replica, or a load that failed
    (whose members dropped the group): every member joins a new group, named by a new id on
    the same store, since a formed group takes no new member."""
    both = asyncio.Event()
    gateway, trainer = Gateway(both), Trainer(both)
    loop = _loop(tmp_path, gateway, trainer)
    await asyncio.wait_for(loop._load("", 1), 5)
    gateway.replicas = ["r1", "r3"]  # r2 replaced
    await asyncio.wait_for(loop._load("", 2), 5)
    gateway.replicas = ["r1", "r3", "r4"]  # one added
    await asyncio.wait_for(loop._load("", 3), 5)
    gateway.replicas = ["r1", "r3", "r4", "down"]  # unhealthy: no load goes to it
    await asyncio.wait_for(loop._load("", 4), 5)
    trainer.fail = 1  # a failed try: the second, on a new group, succeeds
    await asyncio.wait_for(loop._load("", 5), 5)
    await asyncio.wait_for(loop._load("", 6), 5)
    ids = [s.group_id for s in gateway.sources]
    assert [s.world_size for s in gateway.sources] == [3, 3, 4, 4, 4, 4, 4]
    assert ids[2] == ids[3] == ids[4]  # kept while nothing changed, up to the failure
    assert ids[5] == ids[6] and len({ids[0], ids[1], ids[2], ids[5]}) == 4
    assert [r.group.group_id for r in trainer.requests] == ids
    assert len({(s.address, s.port) for s in gateway.sources}) == 1  # one store for the run


async def test_a_sync_that_fails_twice_fails_and_its_last_try_cancels_the_receive(
    tmp_path: Path,
) -> None:
    """The first try waits for both sides (the trainer must be free to send again), then a
    second on a new group; its first failure fails the load and cancels the other side."""
    both = asyncio.Event()
    gateway, trainer = Gateway(both), Trainer(both, fail=2)
    loop = _loop(tmp_path, gateway, trainer)
    with pytest.raises(RunFailed, match="rank 0: the group broke"):
        await asyncio.wait_for(loop._load("", 4), 5)
    assert len({r.group.group_id for r in trainer.requests}) == len(trainer.requests) == 2
    assert gateway.cancelled


async def test_a_group_launch_did_not_resolve_is_refused(tmp_path: Path) -> None:
    both = asyncio.Event()
    loop = _loop(tmp_path, Gateway(both), Trainer(both), port=0)
    with pytest.raises(RunFailed, match="chosen at launch"):
        await loop._load("", 1)
