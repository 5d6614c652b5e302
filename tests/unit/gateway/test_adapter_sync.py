"""Adapter mode's edge cases on fake LoRA replicas: which adapter each segment asks for, a
replica that lost the adapter (404, load, retry), unloads, refused sources and pause modes,
load failures. No engine is ever paused or relabelled. The real-vLLM side is in
tests/vllm/test_gateway_adapters.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.gateway.client import GatewayClient
from lockgate.gateway.config import AdapterServing, GatewayConfig
from tests.support.mocked_gateway import mocked_gateway
from tests.unit.gateway.test_sync_edges import _chunk

ADMIN = "admin-token-for-adapter-sync"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
WORDS = 60
ENGINE_PATHS = ("/pause", "/lockgate/pause", "/resume", "/update_weight_version")


@dataclass
class LoraReplica:
    """Streams one token every `step_s` (a chain, so a continuation goes on where it was cut);
    serves the base model and the adapters loaded through vLLM's runtime LoRA routes, and
    answers a generate request for any other `model` with vLLM's 404."""

    url: str
    tokens: list[int]
    step_s: float = 0.02
    adapters: dict[str, str] = field(default_factory=dict)  # name -> path
    fail_loads: bool = False
    models_asked: list[str | None] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)
    unloads: list[str] = field(default_factory=list)
    engine_calls: list[str] = field(default_factory=list)

    async def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        if path == "/health":
            return httpx.Response(200)
        if path in ENGINE_PATHS:
            self.engine_calls.append(path)
            return httpx.Response(200, json={})
        if path == "/inference/v1/generate":
            model = body.get("model")
            self.models_asked.append(model)
            if model is not None and model not in self.adapters:
                message = f"The model `{model}` does not exist."
                error = {"message": message, "type": "NotFoundError", "code": 404}
                return httpx.Response(404, json={"error": error})
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content=self._stream(body["token_ids"], body["sampling_params"]["max_tokens"]),
            )
        if path == "/v1/load_lora_adapter":
            if self.fail_loads:
                return httpx.Response(500, json={"error": {"message": "cannot load"}})
            self.loads.append(body["lora_name"])
            self.adapters[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="Success")
        if path == "/v1/unload_lora_adapter":
            if self.adapters.pop(body["lora_name"], None) is None:
                return httpx.Response(404, json={"error": {"message": "cannot be found"}})
            self.unloads.append(body["lora_name"])
            return httpx.Response(200, text="Success")
        if path == "/v1/models":
            names = ["base", *self.adapters]
            return httpx.Response(200, json={"data": [{"id": n} for n in names]})
        return httpx.Response(404, json={"detail": "Not Found"})

    async def _stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[bytes]:
        last = prompt[-1]
        at = self.tokens.index(last) + 1 if last in self.tokens else 0
        n = min(max_tokens, len(self.tokens) - at)
        for i in range(n):
            await asyncio.sleep(self.step_s)
            last_one = i == n - 1
            finish = ("stop" if at + n == len(self.tokens) else "length") if last_one else None
            # The engine's label is the same whatever the adapter: it must not be read.
            yield _chunk([self.tokens[at + i]], finish, ["99"] * (i + 1) if last_one else None)


class Stack:
    def __init__(self, app: Any, client: httpx.AsyncClient, replicas: list[LoraReplica]) -> None:
        self.app = app
        self.client = client
        self.replicas = replicas
        self.gateway = app.state.gateway

    async def admin(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return await self.client.post(path, json=body or {}, headers=HEADERS)

    async def gateway_status(self) -> dict[str, Any]:
        return (await self.client.get("/admin/status", headers=HEADERS)).json()

    async def call(self) -> tuple[str, asyncio.Task[httpx.Response]]:
        s = (await self.admin("/admin/sessions", {"task_id": "t"})).json()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": WORDS}
        return s["session_id"], asyncio.create_task(
            self.client.post(f"{s['base_url']}/chat/completions", json=body)
        )

    async def until_every_segment_has(self, n: int, calls: int) -> None:
        gate = self.gateway.gate
        while len(gate.segments) < calls or any(s.tokens < n for s in gate.segments.values()):  # noqa: ASYNC110
            await asyncio.sleep(0.005)

    async def record(self, sid: str) -> dict[str, Any]:
        r = await self.client.get(f"/admin/sessions/{sid}/calls", headers=HEADERS)
        (call,) = r.json()["calls"]
        return call

    async def sync(self, version: int, path: str, mode: str = "abort") -> dict[str, Any]:
        pause = await self.admin("/admin/pause", {"mode": mode})
        assert pause.status_code == 200, pause.text
        body = {"version": version, "transport": "adapter", "path": path}
        load = await self.admin("/admin/weights", body)
        assert load.status_code == 200, load.text
        resumed = await self.admin("/admin/resume", {"version": version})
        assert resumed.json()["state"] == "serving", resumed.text
        return pause.json()["pause"]


def adapter_dir(root: Path, name: str) -> str:
    """A dir that looks like an adapter to the gateway (the fake replicas read nothing)."""
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    return str(path)


@pytest.fixture
async def stack(tiny_model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    replicas = [LoraReplica(f"http://replica-{i}", list(range(300, 300 + WORDS))) for i in (0, 1)]
    fakes = {r.url: r.handler for r in replicas}
    db, overrides = (
        tmp_path / "store.sqlite",
        dict(getattr(request, "param", {"adapter": AdapterServing(name="run")})),
    )
    if overrides.get("initial_weights") == "ZERO":
        overrides["initial_weights"] = adapter_dir(tmp_path, "zero")
    async with mocked_gateway(
        fakes, model_dir=tiny_model_dir, db_path=db, admin_token=ADMIN, **overrides
    ) as (app, client):
        yield Stack(app, client, replicas)


async def test_an_abort_sync_cuts_the_calls_and_they_finish_under_the_new_adapter(
    stack: Stack, tmp_path: Path
) -> None:
    calls = [await stack.call() for _ in range(3)]
    await stack.until_every_segment_has(3, len(calls))
    pause = await stack.sync(1, adapter_dir(tmp_path, "a1"))
    assert pause["interrupted"] == 3 and pause["tokens_kept"] >= 9
    for sid, call in calls:
        assert (await call).status_code == 200
        rec = await stack.record(sid)
        assert rec["completion_ids"] == stack.replicas[0].tokens  # every token, once
        # Versions from the adapter each segment asked for, not the engine's label ("99").
        assert [sp["version"] for sp in rec["versions"]] == [0, 1]
        assert rec["versions"][0]["end"] >= 3 and rec["interruptions"] == 1
    asked = [m for r in stack.replicas for m in r.models_asked]
    assert set(asked) == {None, "run@v1"}  # the base model first, then the adapter
    assert [r.engine_calls for r in stack.replicas] == [[], []]  # no engine paused or labelled
    status = (await stack.client.get("/admin/status", headers=HEADERS)).json()
    assert [r["adapter"] for r in status["replicas"]] == ["run@v1", "run@v1"]
    metrics = (await stack.client.get("/metrics")).text
    assert 'lockgate_gateway_replica_version{adapter="run@v1",replica="http://replica-0"} 1.0' in (
        metrics
    )


async def test_the_previous_adapter_is_unloaded_after_the_resume_not_before(
    stack: Stack, tmp_path: Path
) -> None:
    await stack.sync(1, adapter_dir(tmp_path, "a1"))
    # Through the coordinator's typed client this time.
    transport = httpx.ASGITransport(app=stack.app)
    async with GatewayClient("http://gw", ADMIN, transport=transport) as client:
        await client.pause("abort")
        report = await client.load_adapter(adapter_dir(tmp_path, "a2"), 2)
        assert report.version == 2 and sorted(report.loaded) == [r.url for r in stack.replicas]
        # Until the resume the old adapter may still be needed (a load that failed everywhere).
        assert [sorted(r.adapters) for r in stack.replicas] == [["run@v1", "run@v2"]] * 2
        status = await client.resume(2)
        assert [r.adapter for r in status.replicas] == ["run@v2", "run@v2"]
    await stack.gateway.sync.unloads_done()
    assert [r.unloads for r in stack.replicas] == [["run@v1"], ["run@v1"]]
    assert [sorted(r.adapters) for r in stack.replicas] == [["run@v2"]] * 2
    assert stack.gateway.adapters.versions() == [2]
    sid, call = await stack.call()
    assert (await call).status_code == 200
    assert (await stack.record(sid))["versions"] == [{"version": 2, "start": 0, "end": WORDS}]


async def test_a_replica_that_lost_the_adapter_loads_it_and_the_call_goes_on(
    stack: Stack, tmp_path: Path
) -> None:
    path = adapter_dir(tmp_path, "a1")
    await stack.sync(1, path)
    for replica in stack.replicas:
        replica.adapters.clear()  # restarted: it serves the base model only
    calls = [await stack.call() for _ in range(4)]
    for sid, call in calls:
        assert (await call).status_code == 200, (await call).text
        assert (await stack.record(sid))["versions"] == [{"version": 1, "start": 0, "end": WORDS}]
    for replica in stack.replicas:
        if "run@v1" in replica.models_asked:
            # One 404, one reload for all the calls that met it, then served with it.
            assert replica.adapters == {"run@v1": path}
            assert replica.loads == ["run@v1", "run@v1"]
            assert replica.models_asked.count("run@v1") >= 2


async def test_a_replica_still_without_the_adapter_after_its_reload_fails_over(
    stack: Stack, tmp_path: Path
) -> None:
    await stack.sync(1, adapter_dir(tmp_path, "a1"))
    broken, good = stack.replicas
    broken.adapters.clear()
    broken.fail_loads = True
    pool = stack.gateway.pool
    for _ in range(4):  # until a session sticks to the broken replica
        sid, call = await stack.call()
        assert (await call).status_code == 200
        if broken.models_asked[-1:] == ["run@v1"]:
            break
    else:
        pytest.fail("no call went to the replica that lost its adapter")
    rec = await stack.record(sid)
    # It failed its reload: the call went on on the other replica, with every token.
    assert rec["replica"] == good.url and rec["completion_ids"] == good.tokens
    assert not {r.url: r.healthy for r in pool.status()}[broken.url]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"version": 1, "path": "/snapshot"}, "a 'disk' source would replace the base model"),
        ({"version": 0, "transport": "adapter", "path": "/a"}, "adapter versions only grow"),
    ],
)
async def test_a_source_that_is_not_a_newer_adapter_is_refused(
    stack: Stack, body: dict[str, Any], message: str
) -> None:
    assert (await stack.admin("/admin/pause", {"mode": "abort"})).status_code == 200
    resp = await stack.admin("/admin/weights", body)
    assert resp.status_code in (400, 409), resp.text
    assert message in resp.json()["error"]["message"]
    assert [r.loads for r in stack.replicas] == [[], []]


async def test_keep_stage_and_layout_are_refused_in_adapter_mode(stack: Stack) -> None:
    _, call = await stack.call()
    resp = await stack.admin("/admin/pause", {"mode": "keep"})
    assert resp.status_code == 400
    assert "would freeze every run sharing the replicas" in resp.json()["error"]["message"]
    assert stack.gateway.gate.state == "serving"  # nothing was paused
    assert (await call).status_code == 200
    resp = await stack.admin("/admin/weights/stage", {"path": "/a"})
    assert resp.status_code == 400 and "stages nothing" in resp.json()["error"]["message"]
    layout = await stack.client.get("/admin/weights/layout", headers=HEADERS)
    assert layout.status_code == 400 and "no snapshot layout" in layout.json()["error"]["message"]


async def test_drain_lets_the_calls_finish_under_the_old_adapter(
    stack: Stack, tmp_path: Path
) -> None:
    calls = [await stack.call() for _ in range(2)]
    await stack.until_every_segment_has(3, len(calls))
    pause = await stack.sync(1, adapter_dir(tmp_path, "a1"), mode="drain")
    assert pause["interrupted"] == 0
    for sid, call in calls:
        assert (await call).status_code == 200
        assert (await stack.record(sid))["versions"] == [{"version": 0, "start": 0, "end": WORDS}]


async def test_a_load_that_fails_on_one_replica_leaves_it_out_and_everywhere_keeps_the_old(
    stack: Stack, tmp_path: Path
) -> None:
    await stack.sync(1, adapter_dir(tmp_path, "a1"))
    bad, good = stack.replicas
    bad.fail_loads = True
    await stack.sync(2, adapter_dir(tmp_path, "a2"))
    status = {
        r["url"]: r
        for r in (await stack.client.get("/admin/status", headers=HEADERS)).json()["replicas"]
    }
    assert status[bad.url]["stale"] and status[good.url]["adapter"] == "run@v2"
    good.fail_loads = True
    assert (await stack.admin("/admin/pause", {"mode": "abort"})).status_code == 200
    body = {"version": 3, "transport": "adapter", "path": adapter_dir(tmp_path, "a3")}
    resp = await stack.admin("/admin/weights", body)
    assert resp.status_code == 502
    assert "still paused at version 2, which every replica serving it still holds" in resp.text
    assert (await stack.admin("/admin/resume", {"version": 2})).json()["state"] == "serving"
    status = {r["url"]: r for r in (await stack.gateway_status())["replicas"]}
    # The replica that had missed version 2 does not hold it now either: still out.
    assert status[bad.url]["stale"] and not status[good.url]["stale"]
    sid, call = await stack.call()
    assert (await call).status_code == 200
    assert (await stack.record(sid))["replica"] == good.url


@pytest.mark.parametrize("stack", [{}], indirect=True)
async def test_a_full_weights_gateway_refuses_an_adapter_source(stack: Stack) -> None:
    assert (await stack.admin("/admin/pause", {"mode": "drain"})).status_code == 200
    resp = await stack.admin("/admin/weights", {"version": 1, "transport": "adapter", "path": "/a"})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "transport"
    assert "needs a gateway started in adapter mode" in resp.json()["error"]["message"]


def test_adapter_mode_at_a_later_version_needs_that_versions_adapter(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs initial_weights"):
        GatewayConfig(
            model_dir=tmp_path,
            db_path=tmp_path / "db",
            admin_token=ADMIN,
            adapter=AdapterServing(name="run"),
            initial_version=3,
        )


@pytest.mark.parametrize(
    "stack",
    [{"adapter": AdapterServing(name="run"), "initial_weights": "ZERO"}],
    indirect=True,
)
async def test_with_a_zero_adapter_version_0_is_served_under_its_name_and_unloaded_later(
    stack: Stack, tmp_path: Path
) -> None:
    """vLLM-CPU applies an adapter to a request without one once every LoRA slot is taken, so a
    LoRA run gives its gateway a zero adapter for version 0 and no call goes without a name."""
    for replica in stack.replicas:
        assert replica.loads == ["run@v0"]
    sid, task = await stack.call()
    assert (await task).status_code == 200
    assert {m for r in stack.replicas for m in r.models_asked} == {"run@v0"}
    assert {span["version"] for span in (await stack.record(sid))["versions"]} == {0}
    await stack.sync(1, adapter_dir(tmp_path, "v1"))
    await stack.gateway.sync.unloads_done()
    for replica in stack.replicas:
        assert replica.unloads == ["run@v0"] and "run@v1" in replica.adapters
