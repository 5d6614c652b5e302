"""The config shapes the deploy commands take (URL shorthands, environment variables) and a resumed
run's check on a synced gateway (the commands as processes:
tests/integration/test_deploy_commands.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockgate.coordinator.config import env_overrides, load_config
from lockgate.coordinator.launch.deploy_checks import DeployError, check_run_parts
from tests.integration.test_deploy_commands import TOKEN, TOY, fake_gateway

__all__ = ["fake_gateway"]  # the fixtures, used by name


def test_replicas_and_gateway_take_a_url_shorthand_and_environment_variables() -> None:
    config = load_config(
        None, ["replicas=[http://a:8001/, http://b:8002]", "gateway=http://g:8000"]
    )
    assert config.replicas.urls == ["http://a:8001", "http://b:8002"]
    assert config.gateway.url == "http://g:8000"
    env = {
        "LOCKGATE_GATEWAY__PORT": "8123",
        "LOCKGATE_REPLICAS__URLS": "[http://r:1]",
        "LOCKGATE_CACHE": "/not/an/option",
    }
    overrides = env_overrides(env)
    assert overrides == ["gateway.port=8123", "replicas.urls=[http://r:1]"]
    # The file < the environment < --set.
    config = load_config(Path(TOY), [*overrides, "gateway.port=9000"])
    assert config.gateway.port == 9000 and config.replicas.urls == ["http://r:1"]
    assert config.replicas.count == 2  # from the file


def test_check_run_parts_accepts_a_resumed_run_on_a_synced_gateway(
    fake_gateway: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCKGATE_ADMIN_TOKEN", TOKEN)
    config = load_config(Path(TOY), [f"gateway.url={fake_gateway}"])
    with pytest.raises(DeployError, match="version 3"):
        check_run_parts(config, resume=False)
    external = check_run_parts(config, resume=True)
    assert external is not None
    assert external.url == fake_gateway and external.replica_urls == ["http://127.0.0.1:1"]
