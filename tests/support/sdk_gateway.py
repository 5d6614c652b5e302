"""A gateway process over the session's real replicas for tests that drive it through an SDK,
and the admin calls those tests make."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from lockgate.coordinator.launch.gateway import GatewayProcess
from lockgate.gateway.config import GatewayConfig


@contextlib.contextmanager
def sdk_gateway(
    model_dir: Path, replica_urls: list[str], run_dir: Path, admin_token: str, **config: Any
) -> Iterator[str]:
    """A started gateway (its URL) of the tiny model; `config`: GatewayConfig fields."""
    gateway = GatewayProcess(
        GatewayConfig(
            model_dir=model_dir,
            replicas=replica_urls,
            db_path=run_dir / "trajectories.sqlite",
            admin_token=admin_token,
            max_model_len=2048,
            **config,
        ),
        run_dir,
    )
    gateway.start()
    try:
        yield gateway.url
    finally:
        gateway.stop()


def admin_call(url: str, token: str, method: str, path: str, body: Any = None) -> Any:
    """An admin route's JSON answer; a failure status fails the test with the body."""
    resp = httpx.request(
        method, url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60
    )
    assert resp.status_code < 300, resp.text
    return resp.json()
