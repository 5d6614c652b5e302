"""A coordinator that restarts opens the enrolment again with the same key (`--resume` against
a gateway that outlived it): the groups it was handed before are forgotten (never collected
twice), the groups no coordinator was handed yet are kept, open or complete, with their slots.
The bookkeeping alone (enrolment.py); the route's choice between reopening and a fresh
enrolment through the app; tests/unit/coordinator/test_client_resume.py runs a resume."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from lockgate.gateway.api.enrolment import Enrolment
from lockgate.gateway.api.session_keys import new_enrolment_key
from lockgate.gateway.errors import GatewayError
from lockgate.gateway.schema import OpenEnrolment
from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica, serve_gateway

KEY = new_enrolment_key()


def _group(enrolment: Enrolment, task_id: str, sessions: list[str], ended: bool) -> None:
    """`sessions` enrolled in one group of `task_id` (named after it), ended or not."""
    for session_id in sessions:
        enrolment.created(enrolment.admit(task_id, f"g-{task_id}", version=0), session_id)
    for session_id in sessions if ended else []:
        enrolment.ended(session_id)


async def test_reopening_forgets_the_groups_handed_over_and_keeps_the_rest() -> None:
    enrolment = Enrolment(OpenEnrolment(key=KEY, group_size=2, groups_admitted=4))
    _group(enrolment, "a", ["a1", "a2"], ended=True)
    _group(enrolment, "b", ["b1", "b2"], ended=True)
    handed = await enrolment.wait_complete_after(0, timeout_s=0)  # the coordinator took both
    assert [g.group_id for g in handed] == ["g-a", "g-b"]
    _group(enrolment, "c", ["c1", "c2"], ended=True)  # completed after the last collection
    _group(enrolment, "d", ["d1"], ended=False)  # open: a client still runs it

    enrolment.reopen(OpenEnrolment(key=KEY, group_size=2, groups_admitted=3))

    (kept,) = enrolment.complete_after(0)
    assert (kept.seq, kept.group_id, kept.sessions) == (1, "g-c", ["c1", "c2"])
    assert [g.group_id for g in enrolment.open_groups()] == ["g-d"]
    # c and d hold their slots: one new group fits under the new bound of 3, not two.
    assert enrolment.groups_started == 2 and enrolment.groups_admitted == 3
    enrolment.created(enrolment.admit("e", None, version=1), "e1")
    with pytest.raises(GatewayError) as refused:
        enrolment.admit("f", None, version=1)
    assert refused.value.status_code == 429
    # The open group completes in the reopened enrolment, after the kept one.
    enrolment.created(enrolment.admit("d", "g-d", version=1), "d2")
    enrolment.ended("d1"), enrolment.ended("d2")
    assert [(g.seq, g.group_id) for g in enrolment.complete_after(1)] == [(2, "g-d")]
    # A group id handed over before stays closed.
    with pytest.raises(GatewayError) as closed:
        enrolment.admit("a", "g-a", version=1)
    assert closed.value.status_code == 409


@pytest.fixture
async def gateway(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    replica = FakeReplica(completion=[5, 6, 7])
    async with serve_gateway(tiny_model_dir, tmp_path, {REPLICA: replica}) as (client, _):
        yield client


async def test_the_same_key_and_group_size_reopen_anything_else_opens_afresh(
    gateway: httpx.AsyncClient,
) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}

    async def open_with(key: str, group_size: int) -> None:
        body = {"key": key, "group_size": group_size, "groups_admitted": 5}
        r = await gateway.put("/admin/enrolment", json=body, headers=admin)
        assert r.status_code == 200, r.text

    async def open_groups(key: str) -> list[str]:
        r = await gateway.get("/v1/enrolment", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return [g["group_id"] for g in r.json()["open_groups"]]

    await open_with(KEY, 2)
    r = await gateway.post(
        "/v1/sessions",
        json={"task_id": "t", "group_id": "g1"},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 201, r.text
    await open_with(KEY, 2)
    assert await open_groups(KEY) == ["g1"]  # reopened: the client's group is still there
    await open_with(KEY, 3)
    assert await open_groups(KEY) == []  # another group size: a fresh enrolment
    other = new_enrolment_key()
    await open_with(other, 3)
    assert await open_groups(other) == []
    r = await gateway.get("/v1/enrolment", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 401  # the old key is no longer the run's
