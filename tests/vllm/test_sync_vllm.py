"""Weight sync against real vLLM-CPU replicas: exactness across cuts, per-token versions, many sessions."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from safetensors.torch import load_file

from lockgate.gateway.api.app import create_app
from lockgate.gateway.config import GatewayConfig, SamplingPolicy
from lockgate.gateway.errors import GatewayError
from lockgate.gateway.schema import DiskWeights
from lockgate.trainer.export import write_snapshot
from lockgate.trainer.logprobs import logprobs_from_dir
from lockgate.trainer.protocol import ExportLayout
from tests.support.replicas import tiny_replica_set

pytestmark = pytest.mark.vllm

ADMIN = "admin-token-for-sync-tests"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}


class Gw:
    def __init__(self, app: Any, client: httpx.AsyncClient) -> None:
        self.app = app
        self.client = client
        self.gateway = app.state.gateway

    async def session(self) -> dict[str, Any]:
        r = await self.client.post("/admin/sessions", json={"task_id": "t"}, headers=HEADERS)
        assert r.status_code == 201, r.text
        return r.json()

    async def calls(self, sid: str) -> list[dict[str, Any]]:
        r = await self.client.get(f"/admin/sessions/{sid}/calls", headers=HEADERS)
        return r.json()["calls"]

    async def sync(self, path: Path, version: int, mode: str = "abort") -> dict[str, Any]:
        # The controller directly (the HTTP admin routes are covered by test_gateway_edges):
        # these tests time cuts to the token, and a request through the in-process ASGI
        # transport can reach the app hundreds of ms late while generation streams.
        sync = self.gateway.sync
        pause = await sync.pause(mode, 60.0)  # type: ignore[arg-type]
        await sync.load(DiskWeights(path=str(path)), version)
        await sync.resume(version)
        assert self.gateway.gate.state == "serving"
        return pause.model_dump()

    def tokens_in_flight(self) -> int:
        """Tokens held by the calls in flight (what they had plus what their segment made)."""
        return sum(s.offset + s.tokens for s in self.gateway.gate.segments.values())

    async def wait_tokens(self, n: int, call: asyncio.Task[httpx.Response]) -> bool:
        """Wait until the call in flight holds n tokens, some from its current segment (a cut
        before a resumed segment's first token would leave that version no span); False if
        the call finished first."""
        segments = self.gateway.gate.segments.values
        while self.tokens_in_flight() < n or not all(s.tokens for s in segments()):
            if call.done():
                return False
            await asyncio.sleep(0.002)
        return True


@contextlib.asynccontextmanager
async def open_gateway(
    model_dir: Path, urls: list[str], db: Path, **config: Any
) -> AsyncIterator[Gw]:
    app = create_app(
        GatewayConfig(
            model_dir=model_dir,
            replicas=urls,
            db_path=db,
            admin_token=ADMIN,
            max_model_len=2048,
            sampling=SamplingPolicy(mode="honor"),
            **config,
        )
    )
    await app.state.gateway.start()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=300
    )
    try:
        yield Gw(app, client)
    finally:
        await client.aclose()
        await app.state.gateway.close()


@pytest.fixture
async def gw(tiny_model_dir: Path, replicas: Any, tmp_path: Path) -> AsyncIterator[Gw]:
    async with open_gateway(tiny_model_dir, replicas.urls, tmp_path / "sync.sqlite") as g:
        yield g


def _greedy(content: str, max_tokens: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


async def _interrupt_at(
    gw: Gw, call: asyncio.Task[httpx.Response], marks: list[int], model_dir: Path, version: int
) -> int:
    """Sync (same weights) each time the call in flight passes the next mark; returns the cuts.

    A sync can find nothing to cut: the gateway reads the replica's stream a little behind the
    replica, so the call may already have finished upstream when the test sees a mark.
    """
    cuts = 0
    for mark in marks:
        if not await gw.wait_tokens(mark, call):
            break
        pause = await gw.sync(model_dir, version)
        version += 1
        cuts += pause["interrupted"]
    return cuts


async def test_a_greedy_generation_interrupted_k_times_equals_an_uninterrupted_one(
    gw: Gw, tiny_model_dir: Path
) -> None:
    rng = random.Random(0)
    # A prompt whose greedy answer is long enough to be cut five times.
    for attempt in range(8):
        body = _greedy(f"Tell a long story about the river, number {attempt}.", 240)
        s = await gw.session()
        ref = await gw.client.post(f"{s['base_url']}/chat/completions", json=body)
        assert ref.status_code == 200, ref.text
        (ref_call,) = await gw.calls(s["session_id"])
        if len(ref_call["completion_ids"]) >= 160:
            break
    else:
        pytest.fail("no prompt gave a greedy answer of 160+ tokens")
    n = len(ref_call["completion_ids"])
    version = 1
    achieved: set[int] = set()
    for k in range(1, 6):
        # Every run, whatever number of cuts it got, must equal the reference; each k must be
        # reached at least once (a run can miss a cut when the answer finished upstream first).
        for _ in range(4):
            marks = sorted(rng.sample(range(2, n * 2 // 3), k))
            s = await gw.session()
            call = asyncio.create_task(
                gw.client.post(f"{s['base_url']}/chat/completions", json=body)
            )
            cuts = await _interrupt_at(gw, call, marks, tiny_model_dir, version)
            version += k
            resp = await call
            assert resp.status_code == 200, resp.text
            (rec,) = await gw.calls(s["session_id"])
            spans = rec["versions"]
            print(f"\nk={k}: marks {marks}, cut at {[sp['start'] for sp in spans[1:]]}")
            assert rec["interruptions"] == cuts
            assert rec["completion_ids"] == ref_call["completion_ids"]
            assert resp.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]
            assert rec["logprobs"] == pytest.approx(ref_call["logprobs"], abs=1e-3)
            # Every token carries the version that produced it: cuts+1 spans in order.
            assert len(spans) == cuts + 1
            assert spans[0]["start"] == 0 and spans[-1]["end"] == n
            assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans))
            assert all(a["version"] < b["version"] for a, b in itertools.pairwise(spans))
            achieved.add(cuts)
            if cuts == k:
                break
    assert achieved >= {1, 2, 3, 4, 5}, achieved


async def test_tokens_before_a_sync_carry_the_old_version_and_after_it_the_new(
    gw: Gw, tiny_model_dir: Path, perturbed_model_dir: Path
) -> None:
    new_dir = perturbed_model_dir
    body = _greedy("Tell a long story about the river, number 0.", 200)
    version = 0
    try:
        # Until the sync finds the call in flight (see _interrupt_at); a sync that found it
        # finished upstream is undone (old weights back) before the next attempt.
        for _ in range(4):
            s = await gw.session()
            call = asyncio.create_task(
                gw.client.post(f"{s['base_url']}/chat/completions", json=body)
            )
            if not await gw.wait_tokens(12, call):
                await call
                continue
            version += 1
            if (await gw.sync(new_dir, version))["interrupted"] == 1:
                break
            await call
            version += 1
            await gw.sync(tiny_model_dir, version)
        else:
            pytest.fail("the call finished upstream each time before the test could cut it")
        resp = await call
        assert resp.status_code == 200, resp.text
        (rec,) = await gw.calls(s["session_id"])
        spans = rec["versions"]
        assert [sp["version"] for sp in spans] == [version - 1, version], spans
        cut = spans[0]["end"]
        n = len(rec["completion_ids"])
        assert 12 <= cut < n
        seq = rec["prompt_ids"] + rec["completion_ids"]
        old_lp = logprobs_from_dir(tiny_model_dir, [seq])[0][-n:]
        new_lp = logprobs_from_dir(new_dir, [seq])[0][-n:]
        got = rec["logprobs"]
        before_old = max(abs(a - b) for a, b in zip(old_lp[:cut], got[:cut], strict=True))
        after_new = max(abs(a - b) for a, b in zip(new_lp[cut:], got[cut:], strict=True))
        after_old = max(abs(a - b) for a, b in zip(old_lp[cut:], got[cut:], strict=True))
        print(
            f"\ncut at {cut}/{n}: before vs v0 {before_old:.1e}, after vs v1 {after_new:.1e},"
            f" after vs v0 {after_old:.1e}"
        )
        assert before_old < 1e-2
        assert after_new < 1e-2
        assert after_old > 0.1
    finally:
        await gw.sync(tiny_model_dir, version + 1)  # later tests expect the original weights


async def _assert_every_replica_serves(gw: Gw, new_dir: Path, old_dir: Path) -> None:
    """Every replica's greedy tokens and logprobs are the trainer's forward pass on `new_dir`."""
    prompt = [5, 17, 300, 42, 7, 99, 100, 3, 250, 11]
    n = 24
    for client in gw.gateway.pool.clients:
        tokens: list[int] = []
        got: list[float] = []
        sampling = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}
        async for chunk in client.generate_stream(prompt, sampling, f"direct-{client.url}"):
            tokens += chunk.token_ids
            got += chunk.logprobs
        assert len(tokens) == n
        seq = prompt + tokens
        new_lp = logprobs_from_dir(new_dir, [seq])[0][-n:]
        old_lp = logprobs_from_dir(old_dir, [seq])[0][-n:]
        to_new = max(abs(a - b) for a, b in zip(new_lp, got, strict=True))
        to_old = max(abs(a - b) for a, b in zip(old_lp, got, strict=True))
        print(f"\n{client.url}: vs new weights {to_new:.1e}, vs old {to_old:.1e}")
        assert to_new < 1e-3
        assert to_old > 0.1


async def test_a_direct_load_serves_exactly_the_trainers_new_weights_on_every_replica(
    gw: Gw, tiny_model_dir: Path, perturbed_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The disk transport's direct load (gateway/vllm_ext/snapshot_load.py), not reload_weights: after
    it every replica's greedy tokens and logprobs are the trainer's forward pass on the new
    weights."""
    version = gw.gateway.gate.version
    caplog.set_level(logging.INFO, logger="lockgate.gateway.sync.weights")
    try:
        await gw.sync(perturbed_model_dir, version + 1)
        assert all(c.snapshot_load is True for c in gw.gateway.pool.clients)
        assert not [r.message for r in caplog.records if "reload_weights" in r.message]
        await _assert_every_replica_serves(gw, perturbed_model_dir, tiny_model_dir)
    finally:
        await gw.sync(tiny_model_dir, version + 2)  # later tests expect the original weights


async def test_a_snapshot_in_the_replicas_kernel_layout_serves_the_trainers_weights(
    gw: Gw,
    tiny_model_dir: Path,
    perturbed_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The real replicas name every linear layer of every decoder layer, with its checkpoint
    tensors in vLLM's order; a snapshot the trainer writes in that layout loads directly
    (never through reload_weights) and every replica then serves exactly the new weights."""
    layout = await gw.gateway.sync.layout()
    assert layout.hf_because == {}
    assert {n.rsplit(".", 2)[-2] for n in layout.transposed} >= {
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    }
    qkv = layout.transposed["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    new_weights = load_file(str(perturbed_model_dir / "model.safetensors"))
    snapshot = write_snapshot(
        new_weights,
        perturbed_model_dir,
        tmp_path / "kernel",
        ExportLayout(transposed=layout.transposed),
    )
    stored = load_file(str(snapshot / "model.safetensors"))
    assert set(layout.transposed) <= set(stored)  # every named layer stored [in, out]
    version = gw.gateway.gate.version
    caplog.set_level(logging.INFO, logger="lockgate.gateway.sync.weights")
    try:
        await gw.sync(snapshot, version + 1)
        assert not [r.message for r in caplog.records if "reload_weights" in r.message]
        await _assert_every_replica_serves(gw, perturbed_model_dir, tiny_model_dir)
    finally:
        await gw.sync(tiny_model_dir, version + 2)  # later tests expect the original weights


async def test_a_staged_load_swaps_in_handles_built_while_serving(
    gw: Gw, tiny_model_dir: Path, perturbed_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Staging builds the new kernel handles while a call streams on the old weights; the load
    in the pause then only swaps them in, and every replica serves exactly the new weights."""
    version = gw.gateway.gate.version
    caplog.set_level(logging.INFO, logger="lockgate.gateway.sync.weights")
    sid = (await gw.session())["session_id"]
    call = asyncio.create_task(
        gw.client.post(f"/sessions/{sid}/v1/chat/completions", json=_greedy("Count on.", 64))
    )
    try:
        assert await gw.wait_tokens(2, call), "the call must still be in flight when staging"
        report = await gw.gateway.sync.stage(DiskWeights(path=str(perturbed_model_dir)))
        assert sorted(report.staged) == sorted(c.url for c in gw.gateway.pool.clients)
        assert all(s.slices >= 1 and s.build_s > 0 for s in report.staged.values())
        assert report.not_staged == {}
        assert gw.gateway.gate.state == "serving"
        response = await call
        assert response.status_code == 200
        (record,) = await gw.calls(sid)
        assert [span["version"] for span in record["versions"]] == [version]  # old weights

        await gw.sync(perturbed_model_dir, version + 1)
        loads = [r.message for r in caplog.records if "directly" in r.message]
        assert len(loads) == len(gw.gateway.pool.clients)
        assert all("'staged': 0" not in m and "'staged': " in m for m in loads), loads
        await _assert_every_replica_serves(gw, perturbed_model_dir, tiny_model_dir)
    finally:
        await gw.sync(tiny_model_dir, version + 2)  # later tests expect the original weights


async def _agent(
    gw: Gw, session: dict[str, Any], stream: bool, turns: int, log: list[dict[str, Any]]
) -> None:
    async with AsyncOpenAI(
        base_url=f"http://gw{session['base_url']}",
        api_key="unused",
        http_client=httpx.AsyncClient(
            transport=httpx.ASGITransport(app=gw.app), base_url="http://gw", timeout=300
        ),
        max_retries=0,
    ) as client:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Talk about light."}]
        for _ in range(turns):
            if stream:
                parts, finish = [], None
                async for chunk in await client.chat.completions.create(
                    model="m",
                    messages=messages,
                    max_tokens=48,
                    stream=True,  # type: ignore[arg-type]
                ):
                    if chunk.choices:
                        parts.append(chunk.choices[0].delta.content or "")
                        finish = chunk.choices[0].finish_reason or finish
                content = "".join(parts)
            else:
                out = await client.chat.completions.create(
                    model="m",
                    messages=messages,
                    max_tokens=48,  # type: ignore[arg-type]
                )
                content, finish = out.choices[0].message.content or "", out.choices[0].finish_reason
            log.append({"session": session["session_id"], "content": content, "finish": finish})
            messages += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": "go on"},
            ]


async def test_32_sessions_streaming_and_not_through_10_syncs(gw: Gw, tiny_model_dir: Path) -> None:
    received: list[dict[str, Any]] = []
    sessions = [await gw.session() for _ in range(32)]
    agents = asyncio.gather(
        *(_agent(gw, s, stream=i % 2 == 0, turns=3, log=received) for i, s in enumerate(sessions))
    )
    pauses = []
    for version in range(1, 11):
        await asyncio.sleep(0.3)
        pauses.append(await gw.sync(tiny_model_dir, version))
    await agents
    cut = sum(p["interrupted"] for p in pauses)
    print(
        f"\n10 syncs: {cut} segments interrupted, {sum(p['tokens_kept'] for p in pauses)} tokens kept"
    )
    assert cut > 0
    assert len(received) == 32 * 3
    assert {r["finish"] for r in received} <= {"stop", "length"}

    renderer = gw.gateway.renderer
    for s in sessions:
        calls = await gw.calls(s["session_id"])
        mine = [r for r in received if r["session"] == s["session_id"]]
        assert len(calls) == len(mine) == 3
        for call, got in zip(calls, mine, strict=True):
            n = len(call["completion_ids"])
            assert len(call["logprobs"]) == n
            assert sum(sp["end"] - sp["start"] for sp in call["versions"]) == n
            parsed = renderer.parse_completion(call["completion_ids"], call["prompt_ids"], None)
            assert got["content"] == (parsed.message.content or "")
            assert got["finish"] == call["finish_reason"]


# -- failures -----------------------------------------------------------------------------------


def _long_call(gw: Gw, session: dict[str, Any], tokens: int = 200) -> asyncio.Task[httpx.Response]:
    body = _greedy("Tell a long story about the river, number 0.", tokens)
    return asyncio.create_task(gw.client.post(f"{session['base_url']}/chat/completions", json=body))


async def test_a_snapshot_that_fails_to_load_leaves_the_old_weights_serving(
    gw: Gw, tiny_model_dir: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad-snapshot"
    bad.mkdir()
    (bad / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    (bad / "model.safetensors").write_bytes(b"this is not a safetensors file")
    s0 = await gw.session()
    ref = await gw.client.post(f"{s0['base_url']}/chat/completions", json=_greedy("Hi.", 32))
    s = await gw.session()
    call = _long_call(gw, s, tokens=1500)
    assert await gw.wait_tokens(10, call)

    sync = gw.gateway.sync
    version = gw.gateway.gate.version
    pause = await sync.pause("abort", 60.0)
    assert pause.interrupted == 1
    with pytest.raises(GatewayError) as failed:
        await sync.load(DiskWeights(path=str(bad)), version + 1)
    print(f"\n{failed.value.message}")
    assert failed.value.status_code == 502 and failed.value.code == "load_failed"
    assert f"still paused at version {version}, 2 replica(s) restored" in failed.value.message
    # Every replica holds the old version again, verified, and serves it.
    status = gw.gateway.pool.status()
    assert all(r.version == version and not r.stale and r.healthy for r in status), status
    await sync.resume(version)
    resp = await call
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")
    (rec,) = await gw.calls(s["session_id"])
    assert [sp["version"] for sp in rec["versions"]] == [version]
    assert rec["interruptions"] == 1
    again = await gw.client.post(f"{s0['base_url']}/chat/completions", json=_greedy("Hi.", 32))
    assert again.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]


async def test_a_resume_that_never_comes_fails_waiting_calls_with_503_and_keeps_their_tokens(
    tiny_model_dir: Path, replicas: Any, tmp_path: Path
) -> None:
    async with open_gateway(
        tiny_model_dir, replicas.urls, tmp_path / "paused.sqlite", max_pause_wait_s=1.5
    ) as gw:
        s = await gw.session()
        call = _long_call(gw, s, tokens=1500)
        assert await gw.wait_tokens(10, call)
        assert (await gw.gateway.sync.pause("abort", 60.0)).interrupted == 1
        late = await gw.session()
        new_call = _long_call(gw, late)
        resp, new_resp = await call, await new_call
        for r in (resp, new_resp):
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "paused" and "longer than" in err["message"]
        # The cut call's tokens are on record, marked interrupted (never trained on); the call
        # that never started left nothing half-recorded.
        (rec,) = await gw.calls(s["session_id"])
        assert rec["finish_reason"] == "interrupted"
        assert len(rec["completion_ids"]) == len(rec["logprobs"]) >= 10
        assert await gw.calls(late["session_id"]) == []
        await gw.gateway.sync.resume(gw.gateway.gate.version)
        ok = await gw.client.post(f"{late['base_url']}/chat/completions", json=_greedy("Hi.", 8))
        assert ok.status_code == 200, ok.text


@pytest.fixture
def spare_replica(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One more replica, for a test that kills it."""
    spare = tiny_replica_set(tiny_model_dir, 1, tmp_path_factory.mktemp("spare-replica-log"))
    with spare:
        yield spare


async def test_a_hung_replica_leaves_the_rotation_its_calls_go_on_and_it_comes_back(
    tiny_model_dir: Path, replicas: Any, spare_replica: Any, tmp_path: Path
) -> None:
    """A replica that hangs (SIGSTOP on its whole process group: server, engine, worker)
    rather than dies: its calls go on elsewhere, token for token, within the stall bound and
    its health check; it leaves the rotation and comes back after SIGCONT."""
    urls = [replicas.urls[0], spare_replica.urls[0]]
    hung = spare_replica.urls[0]
    group = os.getpgid(spare_replica.replicas[0].proc.pid)
    stall_s = 2.0
    async with open_gateway(
        tiny_model_dir, urls, tmp_path / "hang.sqlite", replica_stall_s=stall_s
    ) as gw:
        bodies = [_greedy(f"Tell a long story about the hill, number {i}.", 300) for i in range(4)]

        async def chat(body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
            s = await gw.session()
            r = await gw.client.post(f"{s['base_url']}/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return s, r.json()["choices"][0]["message"]

        refs = [m for _, m in await asyncio.gather(*(chat(b) for b in bodies))]
        calls = asyncio.gather(*(chat(b) for b in bodies))
        segments = gw.gateway.gate.segments.values
        while {seg.replica for seg in segments() if seg.tokens} != set(urls):
            assert not calls.done(), "the calls ended before both replicas made tokens"
            await asyncio.sleep(0.005)
        os.killpg(group, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            results = await calls
            recovered_s = time.monotonic() - stopped
            assert [m for _, m in results] == refs  # nothing lost, nothing doubled
            moved = 0
            for s, _ in results:
                (call,) = await gw.calls(s["session_id"])
                path = call["replica"].split(",")
                moved += path == [hung, replicas.urls[0]]
                assert path in ([hung, replicas.urls[0]], [replicas.urls[0]]), path
            assert moved > 0
            assert [c.url for c in gw.gateway.pool.healthy_clients()] == [replicas.urls[0]]
            # While it hangs, new calls are served by the other replica at once.
            _, message = await chat(bodies[0])
            assert message == refs[0]
        finally:
            os.killpg(group, signal.SIGCONT)
        continued = time.monotonic()
        while hung not in [c.url for c in gw.gateway.pool.healthy_clients()]:
            assert time.monotonic() - continued < 30, "the replica did not come back"
            await asyncio.sleep(0.1)
        back_s = time.monotonic() - continued
        # Back in the rotation: new sessions go to it (it holds the fewest sessions) and are
        # served there.
        sessions = [await chat(_greedy("Hello.", 4)) for _ in range(2)]
        served = {(await gw.calls(s["session_id"]))[0]["replica"] for s, _ in sessions}
        assert hung in served
        print(
            f"\nhung replica: {moved}/{len(bodies)} calls moved, all answered "
            f"{recovered_s:.1f}s after SIGSTOP (stall bound {stall_s:.0f}s + health check); "
            f"back in rotation {back_s:.1f}s after SIGCONT; tokens lost: 0"
        )


async def test_a_replica_killed_during_a_sync_leaves_the_rotation_and_no_call_loses_a_token(
    tiny_model_dir: Path, replicas: Any, spare_replica: Any, tmp_path: Path
) -> None:
    urls = [replicas.urls[0], spare_replica.urls[0]]
    async with open_gateway(tiny_model_dir, urls, tmp_path / "kill.sqlite") as gw:
        bodies = [_greedy(f"Tell a long story about the river, number {i}.", 400) for i in range(4)]

        async def reference(body: dict[str, Any]) -> Any:
            s = await gw.session()
            r = await gw.client.post(f"{s['base_url']}/chat/completions", json=body)
            return r.json()["choices"][0]["message"]

        refs = await asyncio.gather(*(reference(b) for b in bodies))
        sessions = [await gw.session() for _ in bodies]
        calls = [
            asyncio.create_task(gw.client.post(f"{s['base_url']}/chat/completions", json=b))
            for s, b in zip(sessions, bodies, strict=True)
        ]
        while {seg.replica for seg in gw.gateway.gate.segments.values()} != set(urls):
            assert not all(c.done() for c in calls), "the calls ended before both replicas ran"
            await asyncio.sleep(0.005)

        sync = gw.gateway.sync
        pause = await sync.pause("abort", 60.0)
        assert pause.interrupted >= 2
        spare_replica.kill(0)
        load = await sync.load(DiskWeights(path=str(tiny_model_dir)), 1)
        assert load.loaded == [replicas.urls[0]]
        assert list(load.failed) == [spare_replica.urls[0]]
        await sync.resume(1)

        for call, session, ref in zip(calls, sessions, refs, strict=True):
            resp = await call
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"] == ref
            (rec,) = await gw.calls(session["session_id"])
            assert rec["finish_reason"] in ("stop", "length")
            assert sum(sp["end"] - sp["start"] for sp in rec["versions"]) == len(
                rec["completion_ids"]
            )
        dead = next(r for r in gw.gateway.pool.status() if r.url == spare_replica.urls[0])
        assert dead.stale


async def test_sessions_stay_on_their_replica_and_one_killed_mid_run_loses_no_token(
    tiny_model_dir: Path, replicas: Any, spare_replica: Any, tmp_path: Path
) -> None:
    urls = [replicas.urls[0], spare_replica.urls[0]]
    async with open_gateway(tiny_model_dir, urls, tmp_path / "midrun.sqlite") as gw:
        sessions = [await gw.session() for _ in range(6)]
        history = {
            s["session_id"]: [{"role": "user", "content": "Describe the sea."}] for s in sessions
        }

        async def turn(s: dict[str, Any], max_tokens: int) -> str:
            messages = history[s["session_id"]]
            r = await gw.client.post(
                f"{s['base_url']}/chat/completions",
                json={"messages": messages, "max_tokens": max_tokens, "temperature": 0.0},
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] in ("stop", "length")
            content = choice["message"]["content"]
            messages += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": "More."},
            ]
            return content

        await asyncio.gather(*(turn(s, 16) for s in sessions))
        first = {s["session_id"]: (await gw.calls(s["session_id"]))[0]["replica"] for s in sessions}
        assert set(first.values()) == set(urls)  # the sessions were spread over both

        long_turns = asyncio.gather(*(turn(s, 400) for s in sessions))
        while {seg.replica for seg in gw.gateway.gate.segments.values()} != set(urls):
            assert not long_turns.done(), "the calls ended before both replicas ran"
            await asyncio.sleep(0.005)
        spare_replica.kill(0)
        contents = await long_turns
        await asyncio.gather(*(turn(s, 16) for s in sessions))

        renderer = gw.gateway.renderer
        moved = 0
        for s, content in zip(sessions, contents, strict=True):
            calls = await gw.calls(s["session_id"])
            assert len(calls) == 3
            killed_call = calls[1]
            # Every token once: the agent's answer is exactly the recorded tokens' parse.
            parsed = renderer.parse_completion(
                killed_call["completion_ids"], killed_call["prompt_ids"], None
            )
            assert parsed.message.content == content
            assert len(killed_call["logprobs"]) == len(killed_call["completion_ids"])
            path = killed_call["replica"].split(",")
            if first[s["session_id"]] == spare_replica.urls[0]:
                moved += 1
                assert path == [spare_replica.urls[0], replicas.urls[0]] or path == [
                    replicas.urls[0]
                ]
            else:
                assert path == [replicas.urls[0]]  # sticky: never moved
            assert calls[2]["replica"] == replicas.urls[0]
        assert moved > 0
