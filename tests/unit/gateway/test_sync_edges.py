"""Weight-sync edge cases on fake replicas that stream slowly and obey vLLM's pause modes:
keep, drain, partial rollouts off, a load that fails on one replica or on all, and a replica
that comes back from a restart. The real-vLLM side is in test_sync_vllm.py."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.gateway.errors import GatewayError
from lockgate.gateway.replicas.pause import PauseGate, Segment
from lockgate.gateway.replicas.pool import ReplicaPool
from lockgate.gateway.sync.controller import SyncController
from tests.support.mocked_gateway import mocked_gateway

ADMIN = "admin-token-for-sync-edges"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
WORDS = 100  # tokens per answer (2 s at step_s: calls stay in flight on a busy machine)


@dataclass
class SlowReplica:
    """Streams one token every `step_s`; `/pause?mode=abort` ends streams with finish `abort`,
    `keep` freezes them until `/resume`; tokens are labelled with the engine's version label.
    With `pause_route` it also answers lockgate's `/lockgate/pause` (else 404, as vLLM does)."""

    url: str
    tokens: list[int]
    pause_route: bool = False
    step_s: float = 0.02
    label: str | None = None
    paused: str | None = None
    fail_loads_from: set[str] = field(default_factory=set)
    loads: list[str] = field(default_factory=list)
    pause_calls: list[str] = field(default_factory=list)
    _resumed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/inference/v1/generate":
            body = json.loads(request.content)
            if self.paused:
                return httpx.Response(503, json={"error": "paused"})
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content=self._stream(body["token_ids"], body["sampling_params"]["max_tokens"]),
            )
        if path == "/lockgate/pause" and not self.pause_route:
            return httpx.Response(404, json={"detail": "Not Found"})
        if path in ("/pause", "/lockgate/pause"):
            self.pause_calls.append(path)
            self.paused = request.url.params["mode"]
            self._resumed.clear()
            if path == "/lockgate/pause":
                return httpx.Response(200, json={"status": "paused", "engine_s": 0.001})
        elif path == "/resume":
            self.paused = None
            self._resumed.set()
        elif path == "/update_weight_version":
            self.label = json.loads(request.content)["new_version"]
        elif path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        elif path == "/collective_rpc":
            rpc = json.loads(request.content)
            if rpc["method"] != "reload_weights":
                # As vLLM answers a method no worker has (no snapshot-load extension here).
                return httpx.Response(500, text="Internal Server Error")
            weights = rpc["kwargs"]["weights_path"]
            if weights in self.fail_loads_from:
                return httpx.Response(500, json={"error": f"cannot load {weights}"})
            self.loads.append(weights)
        return httpx.Response(200, json={})

    async def _stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[bytes]:
        # `tokens` is a chain: each token's successor is the next one, so a request resubmitted
        # with the tokens it already had continues where it was cut.
        last = prompt[-1]
        at = self.tokens.index(last) + 1 if last in self.tokens else 0
        versions: list[str | None] = []
        n = min(max_tokens, len(self.tokens) - at)
        for i in range(n):
            await asyncio.sleep(self.step_s)
            if self.paused == "keep":
                await self._resumed.wait()
            if self.paused == "abort":
                yield _chunk([], "abort", versions)
                return
            versions.append(self.label)
            last_one = i == n - 1
            finish = ("stop" if at + n == len(self.tokens) else "length") if last_one else None
            yield _chunk([self.tokens[at + i]], finish, versions if last_one else None)


def _chunk(ids: list[int], finish: str | None, versions: list[str | None] | None) -> bytes:
    choice: dict[str, Any] = {
        "index": 0,
        "token_ids": ids,
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in ids]},
        "finish_reason": finish,
    }
    payload: dict[str, Any] = {"request_id": "x", "choices": [choice]}
    if finish is not None and versions:
        spans: list[dict[str, Any]] = []
        for i, v in enumerate(versions):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": v, "start": i, "end": i + 1})
        choice["weight_versions"] = spans
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class Stack:
    def __init__(self, app: Any, client: httpx.AsyncClient, replicas: list[SlowReplica]) -> None:
        self.app = app
        self.client = client
        self.replicas = replicas

    async def admin(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return await self.client.post(path, json=body or {}, headers=HEADERS)

    async def start_calls(self, n: int) -> list[tuple[str, asyncio.Task[httpx.Response]]]:
        out = []
        for _ in range(n):
            s = (await self.admin("/admin/sessions", {"task_id": "t"})).json()
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": WORDS}
            call = self.client.post(f"{s['base_url']}/chat/completions", json=body)
            out.append((s["session_id"], asyncio.create_task(call)))
        gate = self.app.state.gateway.gate

        def every_call_has_3_tokens() -> bool:
            segments = list(gate.segments.values())
            return len(segments) == n and all(seg.tokens >= 3 for seg in segments)

        while not every_call_has_3_tokens():  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        return out

    async def record(self, sid: str) -> dict[str, Any]:
        r = await self.client.get(f"/admin/sessions/{sid}/calls", headers=HEADERS)
        (call,) = r.json()["calls"]
        return call


@pytest.fixture
async def stack(tiny_model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    # One replica with lockgate's pause route, one without (the gateway falls back to /pause).
    replicas = [
        SlowReplica(f"http://replica-{i}", list(range(300, 300 + WORDS)), pause_route=i == 0)
        for i in range(2)
    ]
    fakes = {r.url: r.handler for r in replicas}
    db, overrides = tmp_path / "store.sqlite", getattr(request, "param", {})
    async with mocked_gateway(
        fakes, model_dir=tiny_model_dir, db_path=db, admin_token=ADMIN, **overrides
    ) as (app, client):
        yield Stack(app, client, replicas)


async def _sync(stack: Stack, mode: str, path: str, version: int) -> dict[str, Any]:
    pause = await stack.admin("/admin/pause", {"mode": mode})
    assert pause.status_code == 200, pause.text
    load = await stack.admin("/admin/weights", {"version": version, "path": path})
    assert load.status_code == 200, load.text
    resumed = await stack.admin("/admin/resume", {"version": version})
    assert resumed.json()["state"] == "serving"
    return pause.json()["pause"]


async def test_keep_freezes_calls_in_the_replica_and_labels_tokens_by_version(
    stack: Stack, tiny_model_dir: Path
) -> None:
    calls = await stack.start_calls(4)
    pause = await _sync(stack, "keep", str(tiny_model_dir), 1)
    assert pause["frozen"] == 4 and pause["interrupted"] == 0
    assert pause["engines_paused_s"] == 0.001  # as the replica with lockgate's route said
    for sid, call in calls:
        resp = await call
        assert resp.status_code == 200
        rec = await stack.record(sid)
        spans = rec["versions"]
        # One segment, continued inside vLLM: old tokens v0, the rest v1, all of them once.
        assert [sp["version"] for sp in spans] == [0, 1], spans
        assert spans[0]["end"] == spans[1]["start"] >= 3
        assert spans[1]["end"] == len(rec["completion_ids"]) == WORDS
        assert rec["interruptions"] == 0
    # Paused through lockgate's route where the replica has it, through vLLM's /pause otherwise.
    assert [r.pause_calls for r in stack.replicas] == [["/lockgate/pause"], ["/pause"]]


async def test_drain_lets_calls_finish_under_the_old_weights_before_pausing(
    stack: Stack, tiny_model_dir: Path
) -> None:
    calls = await stack.start_calls(4)
    pause = await stack.admin("/admin/pause", {"mode": "drain"})
    assert pause.json()["state"] == "paused"
    # Paused means drained: nothing in flight, every call generated to its end under v0.
    assert stack.app.state.gateway.gate.in_flight == 0
    for sid, call in calls:
        assert (await call).status_code == 200
        rec = await stack.record(sid)
        assert rec["versions"] == [{"version": 0, "start": 0, "end": WORDS}]
    assert [r.paused for r in stack.replicas] == [None, None]  # vLLM itself never paused
    await stack.admin("/admin/weights", {"version": 1, "path": str(tiny_model_dir)})
    assert (await stack.admin("/admin/resume", {"version": 1})).json()["state"] == "serving"


@pytest.mark.parametrize("stack", [{"partial_rollout": False}], indirect=True)
async def test_with_partial_rollouts_off_a_cut_call_fails_and_is_never_mixed(
    stack: Stack, tiny_model_dir: Path
) -> None:
    calls = await stack.start_calls(2)
    pause = await _sync(stack, "abort", str(tiny_model_dir), 1)
    assert pause["interrupted"] == 2
    for sid, call in calls:
        resp = await call
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "interrupted"
        rec = await stack.record(sid)
        assert rec["finish_reason"] == "interrupted"
        assert [sp["version"] for sp in rec["versions"]] == [0]
        samples = await stack.client.get(f"/admin/sessions/{sid}/samples", headers=HEADERS)
        assert samples.json()["samples"] == []


async def test_abort_cuts_and_resumes_every_call_with_all_its_tokens(
    stack: Stack, tiny_model_dir: Path
) -> None:
    calls = await stack.start_calls(4)
    pause = await _sync(stack, "abort", str(tiny_model_dir), 1)
    assert pause["interrupted"] == 4 and pause["tokens_kept"] >= 12
    for sid, call in calls:
        resp = await call
        assert resp.status_code == 200
        rec = await stack.record(sid)
        assert rec["completion_ids"] == stack.replicas[0].tokens
        assert [sp["version"] for sp in rec["versions"]] == [0, 1]
        assert rec["interruptions"] == 1
    # A second sync asks the replica without the route for /pause straight away.
    await _sync(stack, "abort", str(tiny_model_dir), 2)
    assert [r.pause_calls for r in stack.replicas] == [["/lockgate/pause"] * 2, ["/pause"] * 2]
    assert [c.pause_route for c in stack.app.state.gateway.pool.clients] == [True, False]


async def test_a_replica_that_fails_to_load_leaves_the_rotation(
    stack: Stack, tiny_model_dir: Path
) -> None:
    good, bad = stack.replicas
    bad.fail_loads_from.add(str(tiny_model_dir))
    load = await _load_after_pause(stack, str(tiny_model_dir), 1)
    assert load.status_code == 200
    assert load.json()["loaded"] == [good.url] and list(load.json()["failed"]) == [bad.url]
    await stack.admin("/admin/resume", {"version": 1})
    status = {
        r["url"]: r
        for r in (await stack.client.get("/admin/status", headers=HEADERS)).json()["replicas"]
    }
    assert status[bad.url]["stale"] and not status[good.url]["stale"]
    # Only the replica holding the new weights serves.
    for sid, call in await stack.start_calls(3):
        assert (await call).status_code == 200
        assert (await stack.record(sid))["replica"] == good.url


async def test_a_load_that_fails_everywhere_restores_the_old_snapshot(
    stack: Stack, tiny_model_dir: Path
) -> None:
    for r in stack.replicas:
        r.fail_loads_from.add("/snapshots/broken")
    load = await _load_after_pause(stack, "/snapshots/broken", 1)
    assert load.status_code == 502
    err = load.json()["error"]
    assert err["code"] == "load_failed"
    assert "still paused at version 0, 2 replica(s) restored" in err["message"]
    assert [r.loads for r in stack.replicas] == [[str(tiny_model_dir)]] * 2
    assert [r.label for r in stack.replicas] == ["0", "0"]
    assert (await stack.admin("/admin/resume", {"version": 0})).json()["state"] == "serving"
    ((_, call),) = await stack.start_calls(1)
    assert (await call).status_code == 200


async def test_staging_goes_on_while_serving_and_says_why_a_replica_did_not_stage(
    stack: Stack, tiny_model_dir: Path
) -> None:
    calls = await stack.start_calls(2)
    # These replicas have no snapshot-load extension: nothing to stage, their load does it all.
    staged = await stack.admin("/admin/weights/stage", {"path": str(tiny_model_dir)})
    assert staged.status_code == 200, staged.text
    report = staged.json()
    assert report["staged"] == {}
    assert report["not_staged"] == {
        r.url: "no snapshot-load extension on this replica" for r in stack.replicas
    }
    missing = await stack.admin("/admin/weights/stage", {"path": "/no/such/snapshot"})
    assert all("no snapshot at" in why for why in missing.json()["not_staged"].values())
    assert stack.app.state.gateway.gate.state == "serving"
    assert all(r.loads == [] and r.paused is None for r in stack.replicas)
    for _, call in calls:
        assert (await call).status_code == 200

    bad = await stack.admin("/admin/weights/stage", {"path": 3})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    unauthorized = await stack.client.post(
        "/admin/weights/stage", json={"path": str(tiny_model_dir)}
    )
    assert unauthorized.status_code == 401 and "error" in unauthorized.json()


async def test_replicas_without_the_direct_load_ask_for_snapshots_in_hf_layout(
    stack: Stack,
) -> None:
    layout = await stack.client.get("/admin/weights/layout", headers=HEADERS)
    assert layout.status_code == 200, layout.text
    assert layout.json() == {
        "transposed": {},
        "hf_because": {
            r.url: "no direct snapshot load (or nothing packed)" for r in stack.replicas
        },
    }
    unauthorized = await stack.client.get("/admin/weights/layout")
    assert unauthorized.status_code == 401 and "error" in unauthorized.json()


async def test_a_replica_back_from_a_restart_waits_for_the_next_load(tmp_path: Path) -> None:
    replica = SlowReplica("http://replica-0", [1, 2, 3], label="0")
    async with httpx.AsyncClient(transport=httpx.MockTransport(replica.handler)) as http:
        pool = ReplicaPool([replica.url], http, health_interval_s=0.01)
        (client,) = pool.clients
        pool.mark_unhealthy(client)
        replica.label = None  # restarted: it serves its launch weights, unlabelled
        pool.start()
        try:
            while not pool.status()[0].healthy:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        finally:
            await pool.stop()
        assert pool.status()[0].stale
        assert pool.pick("s", 0) is None


async def _load_after_pause(stack: Stack, path: str, version: int) -> httpx.Response:
    assert (await stack.admin("/admin/pause", {"mode": "abort"})).status_code == 200
    return await stack.admin("/admin/weights", {"version": version, "path": path})


class _Replica:
    def __init__(self, url: str, order: list[str], answer_after_s: float = 0.0) -> None:
        self.url = url
        self._order = order
        self._answer_after_s = answer_after_s

    async def pause(self, mode: str) -> float | None:
        self._order.append(f"{self.url} pause {mode}")
        await asyncio.sleep(self._answer_after_s)
        return 0.001

    async def resume(self) -> None:
        self._order.append(f"{self.url} resume")


class _Pool:
    def __init__(self, clients: list[_Replica]) -> None:
        self._clients = clients
        self.clients = clients

    def healthy_clients(self) -> list[_Replica]:
        return self._clients

    def mark_unhealthy(self, client: _Replica) -> None:
        raise AssertionError(f"{client.url} was taken out of rotation")


async def test_no_garbage_collection_starts_inside_an_abort_pause() -> None:
    # A full collection at 2,000 sessions stops the loop for 0.1-0.4 s (benchmarks/README.md,
    # "Scale simulation"): inside a pause, with every replica still generating.
    order: list[str] = []
    collecting: list[bool] = []
    gate = PauseGate()

    async def call(segment: Segment) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            order.append("cut")
            collecting.append(gc.isenabled())
            gate.end(segment)
            raise

    for _ in range(3):
        segment, _version = await gate.admit()
        segment.task = asyncio.create_task(call(segment))
    await asyncio.sleep(0)  # the calls are running
    pool = _Pool([_Replica("http://a", order), _Replica("http://b", order)])
    report = await SyncController(gate, pool).pause("abort", timeout_s=5)  # type: ignore[arg-type]
    # The calls are cut before the replicas are asked: an engine paused with its streams still
    # running waits out a longer step.
    assert order == ["cut"] * 3 + ["http://a pause abort", "http://b pause abort"]
    assert report.interrupted == 0 and report.engines_paused_s == 0.001
    assert collecting == [False] * 3 and gc.isenabled()
    assert gate.state == "paused"


async def test_a_failed_abort_pause_resumes_every_replica_it_reached() -> None:
    # The cut call never winds down, so the idle wait fails while both replicas are still
    # answering their pause: both took it, neither had answered, and both must run again.
    gate = PauseGate()
    segment, _version = await gate.admit()

    released = asyncio.Event()

    async def stuck_call() -> None:
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await released.wait()

    segment.task = asyncio.create_task(stuck_call())
    await asyncio.sleep(0)
    order: list[str] = []
    pool = _Pool([_Replica(u, order, answer_after_s=0.3) for u in ("http://a", "http://b")])
    controller = SyncController(gate, pool)  # type: ignore[arg-type]
    with pytest.raises(GatewayError, match="still in flight"):
        await controller.pause("abort", timeout_s=0.05)
    assert order == [
        "http://a pause abort",
        "http://b pause abort",
        "http://a resume",
        "http://b resume",
    ]
    assert gate.state == "serving"
    released.set()
    await segment.task
    gate.end(segment)
