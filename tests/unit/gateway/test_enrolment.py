"""Client-driven rollouts at the gateway: the enrolment key creates sessions in groups and can do
nothing else, a new group past the coordinator's bound gets a 429 with Retry-After, and a group
is complete once all its members ended. The gateway app runs in process over a fake replica;
tests/vllm/test_client_driven.py runs the same routes under a real training run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.gateway.api.enrolment import Enrolment
from lockgate.gateway.api.session_keys import new_enrolment_key
from lockgate.gateway.errors import GatewayError
from lockgate.gateway.schema import OpenEnrolment
from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica, serve_gateway

ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


class Enrolled:
    def __init__(self, client: httpx.AsyncClient, key: str) -> None:
        self.client = client
        self.key = key
        self.headers = {"Authorization": f"Bearer {key}"}

    async def open(self, group_size: int = 2, admitted: int = 1) -> None:
        body = {"key": self.key, "group_size": group_size, "groups_admitted": admitted}
        r = await self.client.put("/admin/enrolment", json=body, headers=ADMIN_HEADERS)
        assert r.status_code == 200, r.text

    async def new(self, task_id: str, group_id: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"task_id": task_id, "group_id": group_id}
        return await self.client.post("/v1/sessions", json=body, headers=self.headers)

    async def finish(self, created: dict[str, Any], reward: float) -> httpx.Response:
        headers = {"Authorization": f"Bearer {created['api_key']}"}
        return await self.client.post("/v1/finish", json={"reward": reward}, headers=headers)

    async def groups(self, after: int = 0) -> dict[str, Any]:
        r = await self.client.get(
            f"/admin/enrolment/groups?after={after}&wait_s=0", headers=ADMIN_HEADERS
        )
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture
async def enrolled(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Enrolled]:
    replica = FakeReplica(completion=[5, 6, 7])
    async with serve_gateway(tiny_model_dir, tmp_path, {REPLICA: replica}) as (client, _):
        yield Enrolled(client, new_enrolment_key())


async def test_sessions_join_a_group_that_completes_when_all_its_members_ended(
    enrolled: Enrolled,
) -> None:
    await enrolled.open(group_size=2, admitted=1)
    first = await enrolled.new("task-a")
    assert first.status_code == 201, first.text
    a = first.json()
    assert (a["task_id"], a["members"], a["needed"]) == ("task-a", 1, 1)
    # No group named: the open group of the same task takes it.
    b = (await enrolled.new("task-a")).json()
    assert (b["group_id"], b["members"], b["needed"]) == (a["group_id"], 2, 0)
    info = (await enrolled.client.get("/v1/enrolment", headers=enrolled.headers)).json()
    assert info["group_size"] == 2 and info["groups_started"] == 1
    assert info["open_groups"] == [
        {"task_id": "task-a", "group_id": a["group_id"], "members": 2, "needed": 0, "ended": 0}
    ]
    # The session's own key calls the model and ends it.
    chat = await enrolled.client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {a['api_key']}"},
    )
    assert chat.status_code == 200, chat.text
    assert (await enrolled.finish(a, 1.0)).status_code == 200
    assert (await enrolled.groups())["groups"] == []  # one member still running
    assert (await enrolled.finish(a, 1.0)).status_code == 409  # a session ends once
    assert (await enrolled.finish(b, 0.0)).status_code == 200
    (group,) = (await enrolled.groups())["groups"]
    assert group["seq"] == 1 and group["group_id"] == a["group_id"]
    assert sorted(group["sessions"]) == sorted([a["session_id"], b["session_id"]])
    assert (await enrolled.groups(after=1))["groups"] == []
    session = await enrolled.client.get(f"/admin/sessions/{a['session_id']}", headers=ADMIN_HEADERS)
    assert session.json()["reward"] == 1.0 and session.json()["num_calls"] == 1


async def test_a_new_group_past_the_bound_gets_a_429_with_retry_after_until_admitted(
    enrolled: Enrolled,
) -> None:
    await enrolled.open(group_size=2, admitted=1)
    assert (await enrolled.new("t", "g1")).status_code == 201
    refused = await enrolled.new("t", "g2")
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "groups_full"
    # Counted like any error answered.
    metrics = (await enrolled.client.get("/metrics")).text
    assert 'lockgate_gateway_errors_total{kind="groups_full"} 1.0' in metrics
    # Joining the group that holds its slot is still admitted; a third member is not.
    assert (await enrolled.new("t", "g1")).status_code == 201
    assert (await enrolled.new("t", "g1")).status_code == 409
    assert (await enrolled.new("other-task", "g1")).status_code in (409,)
    # The coordinator raises the bound after a sync; lowering it is ignored.
    r = await enrolled.client.post(
        "/admin/enrolment/admitted", json={"groups_admitted": 2}, headers=ADMIN_HEADERS
    )
    assert r.json() == {"groups_admitted": 2, "groups_started": 1}
    assert (await enrolled.new("t", "g2")).status_code == 201
    r = await enrolled.client.post(
        "/admin/enrolment/admitted", json={"groups_admitted": 0}, headers=ADMIN_HEADERS
    )
    assert r.json()["groups_admitted"] == 2
    assert (await enrolled.new("t", "g3")).status_code == 429


async def test_the_enrolment_key_cannot_do_admin_actions_or_act_as_a_session_key(
    enrolled: Enrolled,
) -> None:
    await enrolled.open(group_size=2, admitted=4)
    sid = (await enrolled.new("t")).json()["session_id"]
    key = enrolled.headers
    refused = [
        await enrolled.client.post("/admin/sessions", json={"task_id": "t"}, headers=key),
        await enrolled.client.get("/admin/status", headers=key),
        await enrolled.client.get(f"/admin/sessions/{sid}", headers=key),
        await enrolled.client.post(
            f"/admin/sessions/{sid}/finish", json={"reward": 1.0}, headers=key
        ),
        await enrolled.client.put(
            "/admin/enrolment",
            json={"key": enrolled.key, "group_size": 1, "groups_admitted": 99},
            headers=key,
        ),
        await enrolled.client.post(
            "/admin/enrolment/admitted", json={"groups_admitted": 99}, headers=key
        ),
        await enrolled.client.get("/admin/enrolment/groups", headers=key),
        await enrolled.client.post("/admin/pause", json={}, headers=key),
        # Not a session's key: the session-key routes refuse it.
        await enrolled.client.post("/v1/finish", json={"reward": 1.0}, headers=key),
        await enrolled.client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers=key,
        ),
    ]
    assert [r.status_code for r in refused] == [401] * len(refused), [r.text for r in refused]
    info = (await enrolled.client.get("/v1/enrolment", headers=ADMIN_HEADERS)).json()
    assert info["groups_admitted"] == 4 and info["group_size"] == 2  # nothing changed


async def test_without_an_open_enrolment_or_with_a_wrong_key_no_session_is_made(
    enrolled: Enrolled,
) -> None:
    closed = await enrolled.client.post(
        "/v1/sessions", json={"task_id": "t"}, headers=ADMIN_HEADERS
    )
    assert closed.status_code == 404 and "no enrolment" in closed.json()["error"]["message"]
    early = await enrolled.new("t")  # a key read before the run opened its enrolment
    assert early.status_code == 503 and int(early.headers["retry-after"]) >= 1
    r = await enrolled.client.post(
        "/v1/sessions", json={"task_id": "t"}, headers={"Authorization": "Bearer nonsense"}
    )
    assert r.status_code == 401
    await enrolled.open()
    wrong = {"Authorization": f"Bearer {new_enrolment_key()}"}
    r = await enrolled.client.post("/v1/sessions", json={"task_id": "t"}, headers=wrong)
    assert r.status_code == 401
    r = await enrolled.client.post("/v1/sessions", json={"group_id": "g"}, headers=enrolled.headers)
    assert r.status_code == 400  # task_id is required
    r = await enrolled.client.get("/admin/enrolment/groups?after=x&wait_s=1", headers=ADMIN_HEADERS)
    assert r.status_code == 400


def test_a_group_past_its_time_limit_closes_and_completes_with_the_members_it_has() -> None:
    now = [100.0]
    body = OpenEnrolment(key=new_enrolment_key(), group_size=3, groups_admitted=2, timeout_s=30.0)
    enrolment = Enrolment(body, clock=lambda: now[0])
    for sid in ("s1", "s2"):
        enrolment.created(enrolment.admit("t", "g", version=0), sid)
    enrolment.ended("s1")
    now[0] += 29.0
    assert enrolment.expired() == [] and enrolment.complete_after(0) == []
    now[0] += 1.0
    assert enrolment.expired() == ["s2"]  # for the caller to fail
    with pytest.raises(GatewayError) as closed:
        enrolment.admit("t", "g", version=0)
    assert closed.value.status_code == 409
    assert enrolment.admit("t", None, version=0).group_id != "g"  # not the closed group
    enrolment.ended("s2")
    (group,) = enrolment.complete_after(0)
    assert (group.group_id, group.sessions) == ("g", ["s1", "s2"])
    with pytest.raises(GatewayError):  # a completed id is never opened again
        enrolment.admit("t", "g", version=0)


async def test_collecting_fails_the_open_sessions_of_a_group_past_its_time_limit(
    enrolled: Enrolled,
) -> None:
    body = {"key": enrolled.key, "group_size": 2, "groups_admitted": 1, "timeout_s": 0.2}
    assert (
        await enrolled.client.put("/admin/enrolment", json=body, headers=ADMIN_HEADERS)
    ).is_success
    created = (await enrolled.new("t", "g")).json()
    assert (await enrolled.groups())["groups"] == []
    await asyncio.sleep(0.3)  # the client died: nobody finishes its session
    (group,) = (await enrolled.groups())["groups"]
    assert group["sessions"] == [created["session_id"]]
    info = await enrolled.client.get(
        f"/admin/sessions/{created['session_id']}", headers=ADMIN_HEADERS
    )
    assert info.json()["status"] == "failed" and info.json()["error"].startswith("timeout")
    assert (await enrolled.finish(created, 1.0)).status_code == 409  # too late
