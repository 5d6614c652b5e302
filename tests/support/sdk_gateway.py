"""A gateway process over the session's real replicas for tests that drive it through an SDK,
and the admin calls those tests make."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.coordinator.launch.gateway import GatewayProcess
from lockgate.gateway.config import GatewayConfig, SamplingPolicy


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


def greedy_gateway_url(admin_token: str, name: str) -> Any:
    """A module fixture: the URL of a gateway process over the session's replicas that honours
    the agent's sampling (a test that asks temperature 0 is greedy, so it can be exact) and has
    forced tool calls come first, without thinking. `name`: its run folder's."""

    @pytest.fixture(scope="module")
    def gateway_url(
        tiny_model_dir: Path, replicas: Any, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[str]:
        with sdk_gateway(
            tiny_model_dir,
            replicas.urls,
            tmp_path_factory.mktemp(name),
            admin_token,
            sampling=SamplingPolicy(mode="honor"),
            constrained_reasoning="disabled",
        ) as url:
            yield url

    return gateway_url


def admin_call(url: str, token: str, method: str, path: str, body: Any = None) -> Any:
    """An admin route's JSON answer; a failure status fails the test with the body."""
    resp = httpx.request(
        method, url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60
    )
    assert resp.status_code < 300, resp.text
    return resp.json()
