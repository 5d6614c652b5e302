"""No admin token or session key where people look or copy: the run dir's files (the gateway's
config, its log, the trajectory store), `/metrics` and `/admin/status`. Against a real gateway
process and a real SQLite file."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import httpx

from lockgate.coordinator.launch.gateway import GatewayProcess
from lockgate.gateway.api.session_keys import SESSION_KEY_PREFIX, key_digest
from lockgate.gateway.config import GatewayConfig
from lockgate.gateway.store.trajectories import TrajectoryStore

# Nothing listens on the discard port: calls fail (and are logged as failing) with no replica.
NO_REPLICA = "http://127.0.0.1:9"


def _files_holding(root: Path, secrets_: list[str]) -> list[str]:
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found += [f"{path.name}: {s[:12]}..." for s in secrets_ if s.encode() in data]
    return found


async def _old_store_with_a_plain_key(db: Path, session_id: str, key: str) -> None:
    """A store as gateways wrote it before keys were digested."""
    store = TrajectoryStore(db)
    try:
        await store.create_session(session_id, key, "t-old", None, {})
        await store.flush()
    finally:
        store.close()


def test_no_token_or_key_reaches_the_run_dir_logs_or_metrics(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    db = run_dir / "trajectories.sqlite"
    old_key = SESSION_KEY_PREFIX + secrets.token_urlsafe(24)
    asyncio.run(_old_store_with_a_plain_key(db, "0" * 32, old_key))
    token = "admin-" + secrets.token_urlsafe(24)
    wrong_token = "admin-" + secrets.token_urlsafe(24)
    config = GatewayConfig(
        model_dir=tiny_model_dir, replicas=[NO_REPLICA], db_path=db, admin_token=token
    )
    seen: list[str] = [token, wrong_token]

    def serve_once() -> None:
        gateway = GatewayProcess(config, run_dir)
        gateway.start(timeout_s=120)
        try:
            with httpx.Client(base_url=gateway.url, timeout=30) as http:
                admin = {"Authorization": f"Bearer {token}"}
                made = [
                    http.post("/admin/sessions", json={"task_id": f"t{i}"}, headers=admin).json()
                    for i in range(3)
                ]
                keys = [m["api_key"] for m in made]
                seen.extend(keys)
                # Unguessable: distinct, 192 random bits after the prefix.
                assert len(set(keys)) == 3
                assert all(len(k) == len(SESSION_KEY_PREFIX) + 32 for k in keys)

                def meta(key: str, path: str = "/v1/metadata") -> int:
                    return http.post(
                        path,
                        json={"metadata": {"x": 1}},
                        headers={"Authorization": f"Bearer {key}"},
                    ).status_code

                assert meta(keys[0]) == 200
                assert meta(old_key) == 200  # a plain key of an older store still works
                assert meta(keys[0] + "x") == 401
                assert meta(keys[1], f"/sessions/{made[0]['session_id']}/metadata") == 401
                chat = http.post(
                    f"{made[0]['base_url']}/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                    headers={"Authorization": f"Bearer {keys[0]}"},
                )
                assert chat.status_code >= 500  # no replica: a failure the gateway logs
                assert http.get("/admin/status", headers={"Authorization": f"Bearer {wrong_token}"}).status_code == 401  # fmt: skip
                shown = http.get("/metrics").text + http.get("/admin/status", headers=admin).text
                assert [s for s in seen if s in shown] == []
        finally:
            gateway.stop()

    serve_once()
    serve_once()  # the same store again: the keys' digests load, nothing plain is written back
    assert (run_dir / "logs" / "gateway.log").stat().st_size > 0
    assert _files_holding(run_dir, seen) == []
    # What the store keeps of a key is its digest.
    assert key_digest(seen[2]).encode() in db.read_bytes() + _wal(db)


def _wal(db: Path) -> bytes:
    wal = db.with_name(db.name + "-wal")
    return wal.read_bytes() if wal.exists() else b""
