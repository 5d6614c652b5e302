"""An agent adds to its session's metadata (`POST /sessions/<sid>/metadata`, `/v1/metadata`)."""

from __future__ import annotations

from tests.support.fake_gateway import Harness, _admin, _assert_openai_error, harness

__all__ = ["harness"]  # the fixture, used by name


async def test_an_agent_merges_keys_into_its_session_metadata(harness: Harness) -> None:
    r = await harness.client.post(
        "/admin/sessions", json={"task_id": "t", "metadata": {"kept": 1}}, headers=_admin()
    )
    s = r.json()
    key = {"Authorization": f"Bearer {s['api_key']}"}
    by_path = f"/sessions/{s['session_id']}/metadata"
    r = await harness.client.post(by_path, json={"metadata": {"ended": "answered"}}, headers=key)
    assert r.status_code == 200, r.text
    r = await harness.client.post(
        "/v1/metadata", json={"metadata": {"tool_errors": ["search: x"], "kept": 2}}, headers=key
    )
    assert r.status_code == 200, r.text
    info = await harness.client.get(f"/admin/sessions/{s['session_id']}", headers=_admin())
    assert info.json()["metadata"] == {"kept": 2, "ended": "answered", "tool_errors": ["search: x"]}


async def test_bad_metadata_calls_are_refused_and_change_nothing(harness: Harness) -> None:
    s = await harness.session()
    by_path = f"/sessions/{s['session_id']}/metadata"
    key = {"Authorization": f"Bearer {s['api_key']}"}
    other = await harness.session()
    other_key = {"Authorization": f"Bearer {other['api_key']}"}
    meta = {"metadata": {"a": 1}}
    _assert_openai_error(await harness.client.post("/v1/metadata", json=meta), 401, "key")
    _assert_openai_error(
        await harness.client.post(by_path, json=meta, headers=other_key), 401, "different"
    )
    _assert_openai_error(
        await harness.client.post(by_path, json={"metadata": [1]}, headers=key), 400, "metadata"
    )
    big = {"metadata": {"x": "y" * 70_000}}
    _assert_openai_error(
        await harness.client.post(by_path, json=big, headers=key), 413, "65536 bytes"
    )
    info = await harness.client.get(f"/admin/sessions/{s['session_id']}", headers=_admin())
    assert info.json()["metadata"] == {}
