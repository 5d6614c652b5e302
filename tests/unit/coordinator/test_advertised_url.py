"""The gateway URL told to agents on other hosts (an agent service, a client fleet): with
`gateway.host: 0.0.0.0` the coordinator itself reaches the gateway at 127.0.0.1, which on the
service's host is the service itself. What is told instead is `gateway.advertise_url`, or this
machine's address in place of the wildcard."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import httpx
import pytest

from lockgate.agent_runtime import RolloutContext, ServiceAgent, Task
from lockgate.coordinator.config import RunConfig
from lockgate.coordinator.launch.advertise import advertised_url, this_host_address
from lockgate.coordinator.launch.gateway import GatewayProcess
from lockgate.coordinator.launch.local import _Parts
from lockgate.gateway.config import GatewayConfig


def test_a_wildcard_host_is_told_as_this_machines_address_with_the_port() -> None:
    def here() -> str:
        return "10.1.2.3"

    assert advertised_url("http://127.0.0.1:41234", "0.0.0.0", address=here) == (
        "http://10.1.2.3:41234"
    )
    assert advertised_url("http://[::1]:8000", "::", address=here) == "http://10.1.2.3:8000"
    assert advertised_url("http://127.0.0.1:8000", "", address=lambda: "fd00::7") == (
        "http://[fd00::7]:8000"
    )


def test_a_named_host_a_given_gateway_and_advertise_url_are_told_as_they_are() -> None:
    def never() -> str:
        raise AssertionError("no address lookup when the URL is already routable")

    assert advertised_url("http://10.0.0.5:8000", "10.0.0.5", address=never) == (
        "http://10.0.0.5:8000"
    )
    assert advertised_url("http://gw:8000", None, address=never) == "http://gw:8000"
    told = advertised_url(
        "http://127.0.0.1:8000", "0.0.0.0", "https://gw.example.com", address=never
    )
    assert told == "https://gw.example.com"


def test_this_host_address_is_not_a_loopback_address() -> None:
    address = this_host_address()
    assert address
    try:
        assert not ipaddress.ip_address(address).is_loopback
    except ValueError:
        pass  # no default route here: the host name, which is no address


def test_advertise_url_is_an_http_url() -> None:
    config = RunConfig.model_validate({"gateway": {"advertise_url": "http://gw.lan:8000/"}})
    assert config.gateway.advertise_url == "http://gw.lan:8000"
    with pytest.raises(ValueError, match="http"):
        RunConfig.model_validate({"gateway": {"advertise_url": "gw.lan:8000"}})


def _process(tmp_path: Path, host: str, port: int, name: str) -> GatewayProcess:
    config = GatewayConfig(
        model_dir=tmp_path, replicas=["http://127.0.0.1:1"], db_path=tmp_path, admin_token="t" * 8
    )
    return GatewayProcess(config, tmp_path, port=port, name=name, host=host)


def test_the_runs_gateways_are_told_by_their_routable_urls(tmp_path: Path) -> None:
    config = RunConfig.model_validate({"gateway": {"host": "0.0.0.0"}})
    main = _process(tmp_path, "0.0.0.0", 41234, "gateway")
    val = _process(tmp_path, "0.0.0.0", 41235, "val_gateway")
    parts = _Parts(main.url, "t", main, val, None)  # type: ignore[arg-type]
    here = this_host_address()
    host = f"[{here}]" if ":" in here else here
    assert parts.public_urls(config) == {
        "http://127.0.0.1:41234": f"http://{host}:41234",
        "http://127.0.0.1:41235": f"http://{host}:41235",
    }
    # advertise_url names the training gateway; validation's keeps the machine's address.
    config = RunConfig.model_validate(
        {"gateway": {"host": "0.0.0.0", "advertise_url": "https://gw.example.com"}}
    )
    public = parts.public_urls(config)
    assert public["http://127.0.0.1:41234"] == "https://gw.example.com"
    assert public["http://127.0.0.1:41235"] == f"http://{host}:41235"
    # A gateway the run was given by URL is told as given.
    given = _Parts("http://gw:8000", "t", None, None, None)  # type: ignore[arg-type]
    assert given.public_urls(config) == {"http://gw:8000": "https://gw.example.com"}
    assert given.public_urls(RunConfig()) == {"http://gw:8000": "http://gw:8000"}


async def test_a_service_is_sent_its_sessions_urls_as_it_reaches_the_gateway() -> None:
    bodies: list[dict[str, object]] = []

    def service(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"reward": 1.0})

    agent = ServiceAgent("http://svc:1/rollout", transport=httpx.MockTransport(service))
    agent.attach_gateway(
        "admin-token", public_roots={"http://127.0.0.1:41234": "http://10.1.2.3:41234"}
    )
    task = Task(id="t", data={})
    here = RolloutContext("s1", "http://127.0.0.1:41234/sessions/s1/v1", "k")
    other = RolloutContext("s2", "http://127.0.0.1:9/sessions/s2/v1", "k")
    assert await agent(task, here) == 1.0
    assert await agent(task, other) == 1.0
    assert bodies[0]["base_url"] == "http://10.1.2.3:41234/sessions/s1/v1"
    assert bodies[0]["reward_url"] == "http://10.1.2.3:41234/sessions/s1/reward"
    assert bodies[1]["base_url"] == "http://127.0.0.1:9/sessions/s2/v1"  # not mapped: as it is
