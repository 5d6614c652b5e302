"""Fast, deterministic gateway edge cases against a fake replica (in addition to the real-vLLM
tests in test_gateway_vllm.py, never instead of them)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.fake_gateway import REPLICA, Harness, _admin, _assert_openai_error, harness

__all__ = ["harness"]  # the fixtures, used by name


def _chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def test_a_call_is_recorded_and_answered_in_openai_shape(harness: Harness) -> None:
    s = await harness.session()
    r = await harness.client.post(f"{s['base_url']}/chat/completions", json=_chat())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "hello there"
    assert body["choices"][0]["finish_reason"] == "stop"
    (call,) = await harness.calls(s["session_id"])
    assert call["completion_ids"] == harness.replica.completion
    assert call["logprobs"] == [-0.25 * (i + 1) for i in range(len(harness.replica.completion))]
    assert call["prompt_ids"] == harness.replica.requests[0]["token_ids"]
    assert call["sampling"]["temperature"] == 1.0
    assert body["usage"]["completion_tokens"] == len(harness.replica.completion)


async def test_the_session_key_works_on_plain_v1_and_cannot_reach_another_session(
    harness: Harness,
) -> None:
    a, b = await harness.session(), await harness.session()
    ok = await harness.client.post(
        "/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {a['api_key']}"}
    )
    assert ok.status_code == 200
    assert len(await harness.calls(a["session_id"])) == 1
    cross = await harness.client.post(
        f"{b['base_url']}/chat/completions",
        json=_chat(),
        headers={"Authorization": f"Bearer {a['api_key']}"},
    )
    _assert_openai_error(cross, 401, "different session")
    assert await harness.calls(b["session_id"]) == []


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "needle"),
    [
        ("/sessions/nope/v1/chat/completions", _chat(), {}, 404, "unknown session"),
        ("/v1/chat/completions", _chat(), {}, 401, "missing API key"),
        (
            "/v1/chat/completions",
            _chat(),
            {"Authorization": "Bearer lg-sk-wrong"},
            401,
            "invalid API key",
        ),
        ("/admin/sessions", {"task_id": "t"}, {"Authorization": "Bearer nope"}, 401, "admin"),
        ("/admin/sessions", {"task_id": "t"}, {}, 401, "admin"),
        # A token with non-ASCII characters is compared, not crashed on.
        (
            "/admin/sessions",
            {"task_id": "t"},
            {"Authorization": "Bearer t\u00f6ken".encode()},
            401,
            "admin",
        ),
    ],
)
async def test_unknown_sessions_and_wrong_keys_are_refused(
    harness: Harness,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str | bytes],
    status: int,
    needle: str,
) -> None:
    r = await harness.client.post(path, json=body, headers=headers)
    _assert_openai_error(r, status, needle)


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 1}',
            "unsupported parameter 'frequency_penalty'",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "n > 1"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}', "temperature"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "bad name!"}}]}',
            "tools.0.function.name",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
            "tool_choice requires 'tools'",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a"}}], "tool_choice": {"type": "function", "function": {"name": "b"}}}',
            "names 'b', which is not among the tools",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}',
            "tool_choice",
        ),
    ],
)
async def test_bad_requests_get_a_400_and_record_nothing(
    harness: Harness, payload: bytes, needle: str
) -> None:
    s = await harness.session()
    r = await harness.client.post(
        f"{s['base_url']}/chat/completions",
        content=payload,
        headers={"content-type": "application/json"},
    )
    _assert_openai_error(r, 400, needle)
    assert await harness.calls(s["session_id"]) == []
    # and the gateway keeps serving
    ok = await harness.client.post(f"{s['base_url']}/chat/completions", json=_chat())
    assert ok.status_code == 200


async def test_a_prompt_longer_than_the_context_is_refused(harness: Harness) -> None:
    s = await harness.session()
    r = await harness.client.post(f"{s['base_url']}/chat/completions", json=_chat("word " * 400))
    _assert_openai_error(r, 400, "context")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert await harness.calls(s["session_id"]) == []


async def test_a_replica_that_is_down_gives_503_and_the_gateway_recovers(harness: Harness) -> None:
    s = await harness.session()
    harness.replica.down = True
    r = await harness.client.post(f"{s['base_url']}/chat/completions", json=_chat())
    _assert_openai_error(r, 503, "no healthy replica")
    assert await harness.calls(s["session_id"]) == []
    harness.replica.down = False
    status = (await harness.client.get("/admin/status", headers=_admin())).json()
    assert status["replicas"][0]["healthy"] is False
    # the health loop (every 2 s) puts it back in rotation
    for _ in range(30):
        await asyncio.sleep(0.2)
        status = (await harness.client.get("/admin/status", headers=_admin())).json()
        if status["replicas"][0]["healthy"]:
            break
    assert status["replicas"][0]["healthy"] is True
    ok = await harness.client.post(f"{s['base_url']}/chat/completions", json=_chat())
    assert ok.status_code == 200


async def test_a_finished_session_takes_no_more_calls(harness: Harness) -> None:
    s = await harness.session()
    r = await harness.client.post(
        f"/admin/sessions/{s['session_id']}/finish", json={"reward": 0.5}, headers=_admin()
    )
    assert r.json()["status"] == "finished" and r.json()["reward"] == 0.5
    r = await harness.client.post(f"{s['base_url']}/chat/completions", json=_chat())
    _assert_openai_error(r, 409, "finished")


_ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


async def test_a_tool_turn_extends_the_exact_tokens_and_merges_into_one_sample(
    harness: Harness, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    harness.replica.completion = tok.encode(
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
        add_special_tokens=False,
    )
    s = await harness.session()
    url = f"{s['base_url']}/chat/completions"
    first_messages = [{"role": "user", "content": "add 1 and 2"}]
    first = await harness.client.post(url, json={"messages": first_messages, "tools": [_ADD_TOOL]})
    message = first.json()["choices"][0]["message"]
    assert first.json()["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}

    history = [
        *first_messages,
        {"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]},
        {"role": "tool", "tool_call_id": call["id"], "content": "3"},
    ]
    second = await harness.client.post(url, json={"messages": history, "tools": [_ADD_TOOL]})
    assert second.status_code == 200, second.text
    calls = await harness.calls(s["session_id"])
    assert calls[1]["extends_previous"] is True
    prefix = calls[0]["prompt_ids"] + calls[0]["completion_ids"]
    assert calls[1]["prompt_ids"][: len(prefix)] == prefix

    samples = (
        await harness.client.get(f"/admin/sessions/{s['session_id']}/samples", headers=_admin())
    ).json()
    assert samples["splits"] == 0
    (merged,) = samples["samples"]
    assert merged["call_indices"] == [0, 1]
    assert merged["input_ids"] == calls[1]["prompt_ids"] + calls[1]["completion_ids"]
    sampled = [t for t, m in zip(merged["input_ids"], merged["loss_mask"], strict=True) if m]
    assert sampled == calls[0]["completion_ids"] + calls[1]["completion_ids"]


async def test_a_new_user_turn_or_edited_history_is_re_rendered_and_counted(
    harness: Harness,
) -> None:
    # Qwen3's template drops earlier turns' reasoning once a new user query arrives, so the
    # renderer cannot prove the old tokens still stand: a full re-render, counted as a split.
    s = await harness.session()
    url = f"{s['base_url']}/chat/completions"
    first = (await harness.client.post(url, json=_chat("hi"))).json()
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and then?"},
    ]
    assert (await harness.client.post(url, json={"messages": history})).status_code == 200
    edited = [{"role": "user", "content": "something else"}, *history[1:]]
    assert (await harness.client.post(url, json={"messages": edited})).status_code == 200
    calls = await harness.calls(s["session_id"])
    assert [c["extends_previous"] for c in calls] == [False, False, False]
    samples = (
        await harness.client.get(f"/admin/sessions/{s['session_id']}/samples", headers=_admin())
    ).json()
    assert samples["session"]["rerender_splits"] == 2
    # Samples merge on tokens, not on how the prompt was made: this re-render reproduced the
    # first call's exact tokens (no reasoning to drop), so calls 0 and 1 still form one
    # sample; the edited history cannot, and starts a second one.
    first_sample, second_sample = samples["samples"]
    assert samples["splits"] == 1
    assert first_sample["call_indices"] == [0, 1]
    assert first_sample["input_ids"] == calls[1]["prompt_ids"] + calls[1]["completion_ids"]
    assert second_sample["input_ids"] == calls[2]["prompt_ids"] + calls[2]["completion_ids"]


async def test_calls_wait_while_paused_and_proceed_after_resume(
    harness: Harness, tiny_model_dir: Path
) -> None:
    model_dir = tiny_model_dir
    s = await harness.session()
    r = await harness.client.post("/admin/pause", json={}, headers=_admin())
    assert r.json()["state"] == "paused"
    pending = asyncio.create_task(
        harness.client.post(f"{s['base_url']}/chat/completions", json=_chat())
    )
    await asyncio.sleep(0.3)
    assert not pending.done()
    assert (await harness.client.get("/admin/status", headers=_admin())).json()["waiting"] == 1
    # A version no replica holds cannot be served.
    r = await harness.client.post("/admin/resume", json={"version": 3}, headers=_admin())
    _assert_openai_error(r, 409, "no healthy replica holds version 3")
    r = await harness.client.post(
        "/admin/weights", json={"version": 3, "path": str(model_dir)}, headers=_admin()
    )
    assert r.status_code == 200, r.text
    assert r.json()["loaded"] == [REPLICA]
    assert harness.replica.label == "3"
    r = await harness.client.post("/admin/resume", json={"version": 3}, headers=_admin())
    assert r.json()["state"] == "serving"
    resp = await pending
    assert resp.status_code == 200
    (call,) = await harness.calls(s["session_id"])
    assert call["versions"] == [{"version": 3, "start": 0, "end": len(call["completion_ids"])}]


async def test_a_pause_that_outlasts_the_wait_limit_fails_calls_with_503(harness: Harness) -> None:
    s = await harness.session()
    await harness.client.post("/admin/pause", json={}, headers=_admin())
    r = await harness.client.post(f"{s['base_url']}/chat/completions", json=_chat())
    _assert_openai_error(r, 503, "paused")
    assert await harness.calls(s["session_id"]) == []


async def test_a_forced_tool_call_is_constrained_by_the_formats_structural_tag(
    harness: Harness,
) -> None:
    s = await harness.session()
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]
    forced = {"type": "function", "function": {"name": "look"}}
    for choice, constrained in ((forced, True), ("required", True), ("auto", False)):
        r = await harness.client.post(
            f"{s['base_url']}/chat/completions",
            json=_chat(tools=tools, tool_choice=choice, max_tokens=48),
        )
        assert r.status_code == 200, r.text
        sent = harness.replica.requests[-1]["sampling_params"]
        assert ("structured_outputs" in sent) is constrained
        if constrained:
            tag = json.loads(sent["structured_outputs"]["structural_tag"])
            assert tag["type"] == "structural_tag"
            # The markers are matched as the special tokens, by id, not as spellable text;
            # the call's head is held to the tokens the model's tokenizer writes for it.
            renderer = harness.app.state.gateway.renderer
            opener = renderer.special_tokens["<tool_call>"]
            head = renderer.tokenizer.encode('\n{"name": "look", "arguments":', False)
            held = [opener, *head]
            tokens = [n["token"] for n in _nodes(tag["format"]) if n.get("type") == "token"]
            assert any(tokens[i : i + len(held)] == held for i in range(len(tokens)))
            assert " " in _strings(tag["format"])  # the space before the arguments: text
            # The budget bounds the thinking, leaving room for the call.
            (think,) = [n for n in _nodes(tag["format"]) if n.get("type") == "any_text"]
            assert 0 < think["max_tokens"] < 48 - 10
    calls = await harness.calls(s["session_id"])
    assert [c["constrained"] for c in calls] == [True, True, False]


async def test_a_forced_call_that_cannot_fit_max_tokens_is_a_400(harness: Harness) -> None:
    s = await harness.session()
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]
    r = await harness.client.post(
        f"{s['base_url']}/chat/completions",
        json=_chat(tools=tools, tool_choice="required", max_tokens=3),
    )
    _assert_openai_error(r, 400, "too small for a forced call to 'look'")
    assert r.json()["error"]["param"] == "max_tokens"
    assert await harness.calls(s["session_id"]) == []


def _strings(node: Any) -> str:
    """Every string inside a JSON value, concatenated (to find text in nested specs)."""
    if isinstance(node, str):
        return node
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list):
        return "\n".join(_strings(v) for v in node)
    return ""


async def test_completions_continue_a_raw_prompt_and_record_it(
    harness: Harness, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    s = await harness.session()
    url = f"{s['base_url']}/completions"
    r = await harness.client.post(url, json={"prompt": "Once upon", "logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert choice["text"] == "hello there" and choice["finish_reason"] == "stop"
    assert len(choice["logprobs"]["token_logprobs"]) == len(harness.replica.completion)
    (first,) = await harness.calls(s["session_id"])
    assert first["prompt_ids"] == tok.encode("Once upon", add_special_tokens=False)
    assert first["completion_ids"] == harness.replica.completion
    # Token ids that continue the previous prompt + completion extend it: one sample.
    ids = first["prompt_ids"] + first["completion_ids"] + tok.encode(" more")
    r = await harness.client.post(url, json={"prompt": ids, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    second = (await harness.calls(s["session_id"]))[1]
    assert second["extends_previous"] and second["prompt_ids"] == ids
    samples = await harness.client.get(
        f"/admin/sessions/{s['session_id']}/samples", headers=_admin()
    )
    assert len(samples.json()["samples"]) == 1


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": [1, 99999999]}, "outside the vocabulary"),
        ({"prompt": "x", "stream": True}, "stream is not supported"),
        ({"prompt": "x", "n": 3}, "n > 1"),
        ({"prompt": "x", "best_of": 3}, "unsupported parameter 'best_of'"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "word " * 400}, "context"),
    ],
)
async def test_bad_completions_get_a_400_and_record_nothing(
    harness: Harness, body: dict[str, Any], needle: str
) -> None:
    s = await harness.session()
    r = await harness.client.post(f"{s['base_url']}/completions", json=body)
    _assert_openai_error(r, 400, needle)
    assert await harness.calls(s["session_id"]) == []


def _nodes(node: Any) -> list[Any]:
    """Every JSON object inside a JSON value."""
    if isinstance(node, dict):
        return [node, *(n for v in node.values() for n in _nodes(v))]
    if isinstance(node, list):
        return [n for v in node for n in _nodes(v)]
    return []


async def test_a_stop_string_ends_the_answer_before_it_streamed_or_not(harness: Harness) -> None:
    s = await harness.session()
    url = f"{s['base_url']}/chat/completions"
    r = await harness.client.post(url, json=_chat(stop=[" the", "zzz"]))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "hello" and choice["finish_reason"] == "stop"
    streamed = await harness.client.post(url, json=_chat(stop=" the", stream=True))
    events = [json.loads(x[6:]) for x in streamed.text.splitlines() if x.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == "hello"
    first, second = await harness.calls(s["session_id"])
    # The tokens up to the one that completed the stop string were sampled: they stay recorded.
    assert first["completion_ids"] == second["completion_ids"]
    assert len(first["completion_ids"]) < len(harness.replica.completion)
    assert first["finish_reason"] == "stop"
    r = await harness.client.post(
        f"{s['base_url']}/completions", json={"prompt": "x", "stop": "there"}
    )
    assert r.json()["choices"][0]["text"] == "hello "
