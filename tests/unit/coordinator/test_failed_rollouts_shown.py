"""A failed rollout shows where the operator looks: the step records count it
(`count/rollouts_failed`) and the per-step status line says it, once there is one (issue 43:
a service agent's failures "counted and shown").

The loop is the real TrainingLoop dispatching to an agent service (`environment.url`, an httpx
MockTransport that refuses some rollouts with a 503) over the real gateway app in process."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.agent_runtime import ServiceEnvironment, ServiceOptions, Task
from lockgate.coordinator.config import LoopSection, SyncSection
from lockgate.coordinator.loop.training import TrainingLoop
from lockgate.coordinator.metrics.log import MetricsLog
from lockgate.gateway.client import GatewayClient
from lockgate.gateway.records.metrics_file import read_metrics
from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica, serve_gateway
from tests.unit.coordinator.test_client_rollouts import RecordingTrainer


def _record(step: int, failed: int | None) -> dict[str, Any]:
    record: dict[str, Any] = {
        "step": step,
        "reward/mean": 0.5,
        "perf/gen_tokens_per_s": 10.0,
        "staleness/mean": 0.0,
        "staleness/max": 0,
        "time/step_s": 1.0,
        "time/train_s": 0.5,
        "time/sync_s": 0.0,
    }
    if failed is not None:
        record["count/rollouts_failed"] = failed
    return record


def test_the_status_line_shows_failed_rollouts_once_there_are_any(tmp_path: Path) -> None:
    out = io.StringIO()
    log = MetricsLog(tmp_path / "m.jsonl", total_steps=4, stream=out)
    for step, failed in enumerate([None, 2, 2, 5], start=1):
        log.write(_record(step, failed))
    log.close()
    lines = out.getvalue().splitlines()
    assert "failed" not in lines[0]
    assert "| failed rollouts 2 (+2) |" in lines[1]
    assert "| failed rollouts 2 |" in lines[2]  # none new this step: the total stays in view
    assert "| failed rollouts 5 (+3) |" in lines[3]


def test_a_resumed_runs_first_line_claims_no_failures_for_its_step(tmp_path: Path) -> None:
    out = io.StringIO()
    log = MetricsLog(tmp_path / "m.jsonl", total_steps=9, stream=out)
    log.write(_record(7, 4))  # 4 failures before the checkpoint, restored with the counters
    log.write(_record(8, 5))
    log.close()
    first, second = out.getvalue().splitlines()
    assert "| failed rollouts 4 |" in first
    assert "| failed rollouts 5 (+1) |" in second


class FlakyService:
    """An agent service that answers 503 to the requests numbered in `fails` (1-based) and
    otherwise calls the model once and answers a reward."""

    def __init__(self, app: Any, fails: set[int]) -> None:
        self.app = app
        self.fails = fails
        self.requests = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if self.requests in self.fails:
            return httpx.Response(503, content=b"service restarting")
        body = json.loads(request.content)
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport) as http:
            chat = await http.post(
                body["base_url"] + "/chat/completions",
                headers={"Authorization": f"Bearer {body['api_key']}"},
                json={"model": body["model"], "messages": [{"role": "user", "content": "hi"}]},
            )
        assert chat.status_code == 200, chat.text
        return httpx.Response(200, json={"reward": float(self.requests % 2)})


@pytest.fixture
async def gateway_app(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Any]:
    replica = FakeReplica(completion=[5, 6, 7])
    async with serve_gateway(tiny_model_dir, tmp_path, {REPLICA: replica}) as (_, app):
        yield app


async def test_a_service_agents_failed_rollouts_are_counted_and_shown(
    gateway_app: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # η = 0, one group of three per step: request 1 fails in step 1's group (two left: trained);
    # requests 4 and 5 fail in the next group (one left: dropped), and a third group trains.
    service = FlakyService(gateway_app, fails={1, 4, 5})
    env = ServiceEnvironment(
        "http://agent-service:8765/rollout",
        [Task(id="t0", data={})],
        ServiceOptions(retries=0),
        transport=httpx.MockTransport(service.handle),
    )
    config = LoopSection(steps=2, groups_per_step=1, group_size=3, max_staleness=0)
    out = io.StringIO()
    metrics = MetricsLog(tmp_path / "metrics.jsonl", config.steps, stream=out)
    transport = httpx.ASGITransport(app=gateway_app)
    async with GatewayClient("http://gw", ADMIN, transport=transport) as admin:
        loop = TrainingLoop(
            config,
            env,
            admin,
            RecordingTrainer(str(tiny_model_dir)),
            metrics,
            sync=SyncSection(snapshot_layout="hf"),
        )
        summary = await loop.run()
    metrics.close()

    assert summary.counters["rollouts_failed"] == 3
    assert summary.counters["groups_dropped/too_few_rollouts"] == 1
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["count/rollouts_failed"] for r in records] == [1, 3]
    first, second = out.getvalue().splitlines()
    assert "| failed rollouts 1 (+1) |" in first
    assert "| failed rollouts 3 (+2) |" in second
