"""The viewer's HTTP routes, on a gateway over a fake replica and on `lockgate view`'s app:
admin-only (401 without the token, for the page and every data route), the token as a bearer
header or a cookie, filters, paging, a session's tokens, the live feed and the dashboard data."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.coordinator.cli.main import main as cli_main
from lockgate.coordinator.cli.view import find_run_files
from lockgate.gateway.records.advantages import AdvantageSpec, trained_advantages
from lockgate.gateway.viewer.routes import COOKIE
from lockgate.gateway.viewer.serve import create_view_app
from tests.support.fake_gateway import ADMIN, Harness, _admin, harness  # noqa: F401
from tests.support.viewer_fixtures import build_store

DATA_ROUTES = [
    "/ui/api/overview",
    "/ui/api/sessions",
    "/ui/api/sessions/abc",
    "/ui/api/changes?cursor=0_0_0.0",
    "/ui/api/metrics",
    "/ui/static/viewer.js",
]


async def _session(h: Harness, task: str, group: str | None = None) -> dict[str, Any]:
    r = await h.client.post(
        "/admin/sessions", json={"task_id": task, "group_id": group}, headers=_admin()
    )
    assert r.status_code == 201, r.text
    return r.json()


async def _chat(h: Harness, s: dict[str, Any]) -> None:
    r = await h.client.post(
        f"{s['base_url']}/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token-123"}])
async def test_without_the_admin_token_everything_is_401(
    harness: Harness,  # noqa: F811
    headers: dict[str, str],
) -> None:
    page = await harness.client.get("/ui/", headers=headers)
    assert page.status_code == 401
    assert "<form" in page.text and 'name="token"' in page.text
    assert (await harness.client.get("/ui", headers=headers)).status_code == 307
    for path in DATA_ROUTES:
        r = await harness.client.get(path, headers=headers)
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "auth"
    harness.client.cookies.set(COOKIE, ADMIN)
    forged = await harness.client.get("/ui/api/overview")
    assert forged.status_code == 401  # the cookie holds an HMAC of the token, not the token
    harness.client.cookies.clear()
    bad = await harness.client.get("/ui/", params={"token": "nope-nope-nope"})
    assert bad.status_code == 401


async def test_the_token_link_and_the_login_form_set_an_httponly_cookie(
    harness: Harness,  # noqa: F811
) -> None:
    c = harness.client
    r = await c.get("/ui/", params={"token": ADMIN})
    assert r.status_code == 303 and r.headers["location"] == "/ui/"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert ADMIN not in cookie
    page = await c.get("/ui/")  # the client kept the cookie
    assert page.status_code == 200 and "viewer.js" in page.text
    assert (
        (await c.get("/ui/static/viewer.js")).headers["content-type"].startswith("text/javascript")
    )
    assert (await c.get("/ui/static/../routes.py")).status_code == 404
    c.cookies.clear()
    assert (await c.get("/ui/api/overview")).status_code == 401
    bad = await c.post("/ui/login", content=b"token=wrong", headers=_form())
    assert bad.status_code == 401
    ok = await c.post("/ui/login", content=f"token={ADMIN}".encode(), headers=_form())
    assert ok.status_code == 303
    assert (await c.get("/ui/api/overview")).status_code == 200
    out = await c.get("/ui/logout")
    assert out.status_code == 303
    assert (await c.get("/ui/api/overview")).status_code == 401


def _form() -> dict[str, str]:
    return {"content-type": "application/x-www-form-urlencoded"}


async def test_filters_paging_detail_and_live_feed_on_a_live_gateway(
    harness: Harness,  # noqa: F811
) -> None:
    c, h = harness.client, _admin()
    overview = (await c.get("/ui/api/overview", headers=h)).json()
    assert overview["gateway"]["state"] == "serving" and overview["sessions"] == 0
    cursor = overview["cursor"]
    made = [await _session(harness, "math" if i % 2 else "code", f"g{i // 2}") for i in range(5)]
    for s in made[:3]:
        await _chat(harness, s)
    r = await c.post(
        f"/admin/sessions/{made[0]['session_id']}/finish",
        json={"status": "finished", "reward": 1.0},
        headers=h,
    )
    assert r.status_code == 200

    page = (await c.get("/ui/api/sessions", params={"limit": 2}, headers=h)).json()
    assert [s["id"] for s in page["sessions"]] == [m["session_id"] for m in made[::-1][:2]]
    rest = (
        await c.get(
            "/ui/api/sessions", params={"limit": 10, "cursor": page["next_cursor"]}, headers=h
        )
    ).json()
    assert rest["next_cursor"] is None
    assert [s["id"] for s in page["sessions"] + rest["sessions"]] == [
        m["session_id"] for m in made[::-1]
    ]
    math = (await c.get("/ui/api/sessions", params={"task": "math"}, headers=h)).json()
    assert {s["id"] for s in math["sessions"]} == {made[1]["session_id"], made[3]["session_id"]}
    done = (
        await c.get("/ui/api/sessions", params={"status": "finished", "reward_min": 1}, headers=h)
    ).json()
    assert [s["id"] for s in done["sessions"]] == [made[0]["session_id"]]
    grp = (await c.get("/ui/api/sessions", params={"group": "g1"}, headers=h)).json()
    assert len(grp["sessions"]) == 2
    none = (await c.get("/ui/api/sessions", params={"interrupted": "true"}, headers=h)).json()
    assert none["sessions"] == []
    for params in ({"interrupted": "maybe"}, {"version": "-1"}, {"limit": "0"}, {"x": "1"}):
        r = await c.get("/ui/api/sessions", params=params, headers=h)
        assert r.status_code == (400 if "x" not in params else 200), params

    detail = (await c.get(f"/ui/api/sessions/{made[0]['session_id']}", headers=h)).json()
    (call,) = detail["calls"]
    assert call["completion_ids"] == harness.replica.completion
    assert call["logprobs"] == [-0.25 * (i + 1) for i in range(len(call["completion_ids"]))]
    text = "".join(detail["tokens"][str(t)] for t in call["completion_ids"])
    assert text.startswith("hello there")
    assert detail["session"]["reward"] == 1.0 and detail["samples"] == 1
    assert (await c.get("/ui/api/sessions/nope", headers=h)).status_code == 404

    changes = (await c.get("/ui/api/changes", params={"cursor": cursor}, headers=h)).json()
    assert set(changes["changed"]) == {m["session_id"] for m in made}
    quiet = (await c.get("/ui/api/changes", params={"cursor": changes["cursor"]}, headers=h)).json()
    assert quiet["changed"] == []
    await _chat(harness, made[4])
    moved = (await c.get("/ui/api/changes", params={"cursor": changes["cursor"]}, headers=h)).json()
    assert moved["changed"] == [made[4]["session_id"]]
    assert moved["sessions"][0]["num_calls"] == 1
    bad = await c.get("/ui/api/changes", params={"cursor": "x"}, headers=h)
    assert bad.status_code == 400
    assert (await c.get("/ui/api/changes", headers=h)).status_code == 400
    metrics = (await c.get("/ui/api/metrics", headers=h)).json()
    assert metrics["available"] is False  # the test gateway is not in a run dir


def _run_dir(tmp_path: Path, model_dir: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    build_store(run / "trajectories.sqlite")
    (run / "gateway_config.json").write_text(json.dumps({"model_dir": str(model_dir)}))
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "reward/mean": 0.5, "time/step_s": 2.0, "time/train_s": 1.0}) + "\n"
    )
    return run


async def test_lockgate_view_serves_a_finished_run_read_only(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run = _run_dir(tmp_path, tiny_model_dir)
    files = find_run_files(run)
    assert files.model_dir == tiny_model_dir and files.metrics == run / "metrics.jsonl"
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in run.iterdir()}
    app = create_view_app(files, "view-token-123")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://view"
    ) as c:
        assert (await c.get("/ui/api/sessions")).status_code == 401
        h = {"Authorization": "Bearer view-token-123"}
        page = (await c.get("/ui/api/sessions", params={"splits": "true"}, headers=h)).json()
        (split,) = page["sessions"]
        detail = (await c.get(f"/ui/api/sessions/{split['id']}", headers=h)).json()
        assert detail["calls"][1]["split"] and detail["tokens"]
        metrics = (await c.get("/ui/api/metrics", headers=h)).json()
        assert metrics["steps"] == [1] and metrics["trainer_idle_frac"] == [0.5]
        overview = (await c.get("/ui/api/overview", headers=h)).json()
        assert overview["extra"]["read_only"] and overview["gateway"] is None
    after = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in run.iterdir()}
    assert after == before  # nothing written, not even a -wal or -shm file


async def test_lockgate_view_shows_the_advantages_the_run_trained_with(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run = _run_dir(tmp_path, tiny_model_dir)
    config = run / "gateway_config.json"
    spec = {"estimator": "rloo", "negative_advantage_weight": 0.3}
    config.write_text(json.dumps({"model_dir": str(tiny_model_dir), "advantages": spec}))
    files = find_run_files(run)
    assert files.advantages == AdvantageSpec(**spec)
    app = create_view_app(files, "view-token-123")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://view"
    ) as c:
        h = {"Authorization": "Bearer view-token-123"}
        page = (await c.get("/ui/api/sessions", params={"group": "g-arith-1-0"}, headers=h)).json()
        sid = page["sessions"][0]["id"]
        detail = (await c.get(f"/ui/api/sessions/{sid}", headers=h)).json()
    assert detail["advantages"] == spec
    rewards = [g["reward"] for g in detail["group"]]
    assert [g["advantage"] for g in detail["group"]] == pytest.approx(
        trained_advantages(rewards, AdvantageSpec(**spec))
    )
    # A spec that does not parse is a one-line error, never GRPO shown in its place.
    config.write_text(json.dumps({"advantages": {"estimator": "ppo"}}))
    with pytest.raises(ValueError, match=r"advantages\.estimator"):
        find_run_files(run)
    config.write_text(json.dumps({"model_dir": str(tiny_model_dir)}))  # a run from before
    assert find_run_files(run).advantages is None


def test_a_closed_store_leaves_no_files_and_a_writer_opening_it_later_is_seen(
    tmp_path: Path,
) -> None:
    from lockgate.gateway.store.trajectories import TrajectoryStore
    from lockgate.gateway.viewer import query
    from lockgate.gateway.viewer.routes import Viewer, ViewerSource

    path = tmp_path / "trajectories.sqlite"
    build_store(path)
    viewer = Viewer(ViewerSource(db_path=path, admin_token="t" * 8), threads=1)

    async def count() -> int:
        page = await viewer.read(lambda c: query.list_sessions(c, query.SessionFilter()))
        return len(page.sessions)

    async def scenario() -> None:
        assert await count() == 7  # immutable: the run dir is left as it was
        assert sorted(os.listdir(tmp_path)) == ["trajectories.sqlite"]
        writer = TrajectoryStore(path)  # a gateway resumes the run
        try:
            await writer.create_session("new" + "0" * 29, "k-new", "t", None, {})
            assert await count() == 8
        finally:
            writer.close()

    asyncio.run(scenario())
    viewer.close()


def test_the_view_command_is_registered_and_says_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["view", str(tmp_path / "nope")]) == 2
    assert "run dir not found" in capsys.readouterr().err
    assert cli_main(["view", str(tmp_path)]) == 2
    assert "no trajectory store" in capsys.readouterr().err
