"""Checks of where a run's parts are (model dir, ports, replica and gateway URLs), made before
anything starts: bad deploy input is a `DeployError` whose message names the config option at
fault (`replicas.urls: http://... did not answer ...`), never a hang or a traceback mid-run."""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from lockgate.coordinator.config import GatewaySection, ReplicasSection, RunConfig
from lockgate.coordinator.errors import LockgateError
from lockgate.coordinator.launch.parts import admin_token_of
from lockgate.gateway.schema import GatewayStatus
from lockgate.gateway.vllm_ext.probe import PROBE_METHOD, PROBE_PREFIX

log = logging.getLogger(__name__)

_POLL_S = 0.5


class DeployError(LockgateError):
    """Bad deploy input found before anything started; the message names the option."""


@dataclass(frozen=True)
class ExternalGateway:
    """A gateway running elsewhere that a run uses (`gateway.url`), and its replicas."""

    url: str
    admin_token: str
    replica_urls: list[str]


def check_model_dir(path: Path | None) -> None:
    """`model.path`, when set, must be an HF model dir (unset: the tiny model, built here)."""
    if path is None:
        return
    if not path.is_dir():
        raise DeployError(f"model.path: {path} is not a directory")
    if not (path / "config.json").is_file():
        raise DeployError(f"model.path: {path} holds no config.json (not an HF model directory)")


def check_port_free(host: str, port: int, option: str) -> None:
    """That a server could listen on `host:port` now (port 0: a free one is picked later)."""
    if port == 0:
        return
    bind_host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As the servers themselves bind (uvicorn, vLLM): a port in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            why = "already taken" if exc.errno == 98 else exc.strerror or str(exc)
            raise DeployError(
                f"{option}: cannot listen on {host}:{port}: {why} (choose another port, or 0 "
                "for a free one)"
            ) from None


def check_replica_ports(section: ReplicasSection) -> None:
    """The ports local replicas will take (`replicas.base_port` + i), when fixed."""
    if section.base_port is not None:
        for i in range(section.count):
            check_port_free(section.host, section.base_port + i, "replicas.base_port")


def _why(exc: httpx.HTTPError) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_replicas(urls: list[str], timeout_s: float, option: str = "replicas.urls") -> None:
    """Wait until every replica answers /health (up to `timeout_s`), then check that it is a
    vLLM server lockgate can sync (started with VLLM_SERVER_DEV_MODE=1, as `lockgate replicas`
    starts them)."""
    deadline = time.monotonic() + timeout_s
    pending = {url: "no answer yet" for url in urls}
    with httpx.Client(timeout=2.0) as client:
        while True:
            for url in list(pending):
                try:
                    code = client.get(f"{url}/health").status_code
                except httpx.HTTPError as exc:
                    pending[url] = _why(exc)
                    continue
                if code == 200:
                    del pending[url]
                else:
                    pending[url] = f"/health answered HTTP {code}"
            if not pending:
                break
            if time.monotonic() >= deadline:
                url, why = next(iter(pending.items()))
                raise DeployError(
                    f"{option}: the replica at {url} did not answer within {timeout_s:g}s ({why})"
                )
            time.sleep(_POLL_S)
        for url in urls:
            try:
                code = client.get(f"{url}/weight_info").status_code
            except httpx.HTTPError as exc:
                raise DeployError(f"{option}: the replica at {url} failed: {_why(exc)}") from None
            if code != 200:
                raise DeployError(
                    f"{option}: {url} answers /health but not /weight_info (HTTP {code}): not a "
                    "vLLM server started with VLLM_SERVER_DEV_MODE=1, so weights cannot be "
                    "synced to it (`lockgate replicas` starts suitable ones)"
                )


def check_replicas_read(directory: Path, urls: Sequence[str], option: str = "run_dir") -> None:
    """That every replica reads what this process writes in `directory`, where the trainer's
    weight snapshots will be (the disk transport: trainer and replicas share a volume at the
    same path). A replica without lockgate's worker extension cannot be asked, and is skipped
    with a warning."""
    directory.mkdir(parents=True, exist_ok=True)
    content = secrets.token_hex(16)
    probe = directory / f"{PROBE_PREFIX}{content}"
    probe.write_text(content)
    try:
        with httpx.Client(timeout=30.0) as client:
            for url in urls:
                _check_reads(client, url, probe, content, option)
    finally:
        probe.unlink(missing_ok=True)


def _check_reads(client: httpx.Client, url: str, probe: Path, content: str, option: str) -> None:
    try:
        resp = client.post(f"{url}/collective_rpc", json={"method": PROBE_METHOD, "args": [str(probe)]})  # fmt: skip
    except httpx.HTTPError as exc:
        raise DeployError(f"replicas.urls: the replica at {url} failed: {_why(exc)}") from None
    try:
        answer = resp.json() if resp.status_code == 200 else None
    except ValueError:  # not JSON: not an answer of vLLM's collective_rpc
        answer = None
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list) or not results:
        log.warning(
            "%s cannot say whether it reads %s (no lockgate worker extension: HTTP %d); its "
            "first weight load will tell",
            url, probe.parent, resp.status_code,
        )  # fmt: skip
        return
    for result in results:
        if isinstance(result, dict) and result.get("content") == content:
            continue
        why = result.get("reason", "another file") if isinstance(result, dict) else result
        raise DeployError(
            f"{option}: the replica at {url} cannot read the trainer's weight snapshots in "
            f"{probe.parent} ({why}): mount the weights volume at the same path in the trainer "
            "and in every replica"
        )


def connect_gateway(
    url: str, admin_token: str, timeout_s: float, option: str = "gateway.url"
) -> GatewayStatus:
    """Wait until the gateway at `url` serves (up to `timeout_s`) and takes the admin token;
    its status."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=5.0) as client:
        while True:
            try:
                code = client.get("/health").status_code
                if code == 200:
                    break
                why = f"/health answered HTTP {code}"
            except httpx.HTTPError as exc:
                why = _why(exc)
            if time.monotonic() >= deadline:
                raise DeployError(
                    f"{option}: the gateway at {url} did not answer within {timeout_s:g}s ({why})"
                )
            time.sleep(_POLL_S)
        try:
            resp = client.get("/admin/status", headers={"Authorization": f"Bearer {admin_token}"})
        except httpx.HTTPError as exc:
            raise DeployError(f"{option}: the gateway at {url} failed: {_why(exc)}") from None
    if resp.status_code == 401:
        raise DeployError(f"{option}: the gateway at {url} refused the admin token")
    if resp.status_code != 200:
        raise DeployError(f"{option}: {url}/admin/status answered HTTP {resp.status_code}")
    try:
        return GatewayStatus.model_validate_json(resp.content)
    except ValueError:
        raise DeployError(f"{option}: {url} does not answer as a lockgate gateway") from None


def require_admin_token(section: GatewaySection) -> str:
    token = admin_token_of(section)
    if token is None:
        raise DeployError(
            f"gateway.url: the gateway's admin token is read from ${section.admin_token_env}, "
            "which is not set"
        )
    return token


def check_run_parts(config: RunConfig, *, resume: bool) -> ExternalGateway | None:
    """What `lockgate train` can check before it starts anything: the model dir, the ports it
    will take, the replicas or the gateway it is given. The external gateway, when given."""
    check_model_dir(config.model.path)
    section = config.gateway
    if section.url is None:
        check_port_free(section.host, section.port, "gateway.port")
        if config.replicas.urls:
            check_replicas(config.replicas.urls, config.replicas.startup_timeout_s)
        else:
            check_replica_ports(config.replicas)
        return None
    token = require_admin_token(section)
    status = connect_gateway(section.url, token, section.startup_timeout_s)
    urls = [r.url for r in status.replicas]
    if not any(r.healthy for r in status.replicas):
        raise DeployError(
            f"gateway.url: the gateway at {section.url} has no healthy replica (give it "
            "replicas.urls, or add one with POST /admin/replicas)"
        )
    missing = [url for url in config.replicas.urls if url not in urls]
    if missing:
        raise DeployError(
            f"replicas.urls: {', '.join(missing)} not among the replicas of the gateway at "
            f"{section.url} ({', '.join(urls)}); with gateway.url the replicas are the gateway's"
        )
    if not resume and status.version != 0:
        raise DeployError(
            f"gateway.url: the gateway at {section.url} serves weights version {status.version}, "
            "but a new run starts from version 0: restart its replicas and the gateway, or "
            "--resume the run that trained them"
        )
    return ExternalGateway(section.url, token, urls)
