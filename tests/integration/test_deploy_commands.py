"""The deploy commands' contract for bad input (`lockgate replicas | gateway | serve | session
new | train` with parts elsewhere), each command run as a process: one line naming the option
at fault, exit 2, before anything starts; and a gateway alone serving sessions. No vLLM here:
fake servers stand in."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support.threaded_server import serve_in_thread

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "examples/toy/config.yaml")
TOKEN = "admin-token-for-deploy-tests"


def _lockgate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lockgate.coordinator.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def _one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lockgate: ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def not_a_replica() -> Iterator[str]:
    """Answers /health but is no vLLM server lockgate can sync (no /weight_info)."""

    async def health(_: Request) -> Response:
        return JSONResponse({})

    with serve_in_thread(Starlette(routes=[Route("/health", health)])) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fake_gateway() -> Iterator[str]:
    """A gateway stand-in at weights version 3, with one healthy replica."""

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def status(request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return JSONResponse({"error": {"message": "no"}}, status_code=401)
        replica = {"url": "http://127.0.0.1:1", "healthy": True, "in_flight": 0, "failures": 0}
        return JSONResponse(
            {
                "state": "serving",
                "version": 3,
                "in_flight": 0,
                "waiting": 0,
                "interruptions": 0,
                "tokens_kept": 0,
                "replicas": [{**replica, "version": 3}],
            }
        )

    routes = [Route("/health", health), Route("/admin/status", status)]
    with serve_in_thread(Starlette(routes=routes)) as port:
        yield f"http://127.0.0.1:{port}"


# -- config shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--set", "gateway.url=ftp://x"), ("gateway.url", "http(s) URL")),
        (("--set", "replicas=[localhost:8000]"), ("replicas.urls", "http(s) URL")),
        (("--set", "gateway.port=70000"), ("gateway.port",)),
        (("--set", "replicas.base_port=65535", "--set", "replicas.count=2"), ("65535",)),
    ],
)
def test_bad_deploy_values_are_one_line_config_errors(
    args: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    for command in ("serve", "gateway", "replicas"):
        _one_line_error(_lockgate(command, *args), "config error", *needles)


def test_an_environment_variable_with_a_bad_value_is_named_like_a_flag() -> None:
    result = _lockgate("serve", env={"LOCKGATE_GATEWAY__PORT": "lots"})
    _one_line_error(result, "gateway.port")


# -- bad deploy input, before anything starts ------------------------------------------------------


def test_a_wrong_model_path_is_refused_by_every_command(tmp_path: Path) -> None:
    for command in ("replicas", "gateway", "serve", "train"):
        args = (TOY,) if command == "train" else ()
        result = _lockgate(command, *args, "--set", f"model.path={tmp_path / 'nope'}")
        _one_line_error(result, "model.path", "not a directory")
    result = _lockgate("serve", "--set", f"model.path={tmp_path}")
    _one_line_error(result, "model.path", "no config.json")
    assert not (tmp_path / "runs").exists()


def test_a_taken_port_is_refused_naming_the_option(taken_port: int, tmp_path: Path) -> None:
    for command in ("gateway", "serve"):
        result = _lockgate(command, "--set", f"gateway.port={taken_port}")
        _one_line_error(result, "gateway.port", f"127.0.0.1:{taken_port}", "already taken")
    for command in ("replicas", "serve"):
        result = _lockgate(command, "--set", f"replicas.base_port={taken_port}")
        _one_line_error(result, "replicas.base_port", "already taken")
    result = _lockgate(
        "train", TOY, "--run-dir", str(tmp_path / "run"), "--set", f"gateway.port={taken_port}"
    )
    _one_line_error(result, "gateway.port", "already taken")
    assert not (tmp_path / "run").exists()  # refused before the run dir was made


def test_a_replica_url_that_never_answers_is_refused_after_the_timeout(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    common = ("--set", f"replicas.urls=[{url}]", "--set", "replicas.startup_timeout_s=1.5")
    for command in ("gateway", "serve"):
        result = _lockgate(command, *common)
        _one_line_error(result, "replicas.urls", url, "did not answer within 1.5s")
    started = time.monotonic()
    result = _lockgate("train", TOY, "--run-dir", str(tmp_path / "run"), *common)
    _one_line_error(result, "replicas.urls", url, "did not answer within 1.5s")
    assert time.monotonic() - started < 30
    assert not (tmp_path / "run").exists()


def test_a_server_that_is_not_a_syncable_replica_is_refused(not_a_replica: str) -> None:
    result = _lockgate("gateway", "--set", f"replicas.urls=[{not_a_replica}]")
    _one_line_error(result, "replicas.urls", not_a_replica, "VLLM_SERVER_DEV_MODE")


def test_train_with_an_external_gateway_needs_its_token_and_a_fresh_version(
    fake_gateway: str, tmp_path: Path
) -> None:
    run = ("--run-dir", str(tmp_path / "run"), "--set", f"gateway.url={fake_gateway}")
    result = _lockgate("train", TOY, *run, env={"LOCKGATE_ADMIN_TOKEN": ""})
    _one_line_error(result, "gateway.url", "LOCKGATE_ADMIN_TOKEN", "not set")
    result = _lockgate("train", TOY, *run, env={"LOCKGATE_ADMIN_TOKEN": "wrong-token"})
    _one_line_error(result, "gateway.url", "refused the admin token")
    result = _lockgate("train", TOY, *run, env={"LOCKGATE_ADMIN_TOKEN": TOKEN})
    _one_line_error(result, "gateway.url", "version 3", "--resume")
    result = _lockgate(
        "train", TOY, *run, "--set", "replicas.urls=[http://127.0.0.1:2]",
        env={"LOCKGATE_ADMIN_TOKEN": TOKEN},
    )  # fmt: skip
    _one_line_error(result, "replicas.urls", "http://127.0.0.1:2", "not among")
    assert not (tmp_path / "run").exists()


def test_an_external_gateway_that_never_answers_is_refused(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    result = _lockgate(
        "train", TOY, "--run-dir", str(tmp_path / "run"),
        "--set", f"gateway.url={url}", "--set", "gateway.startup_timeout_s=1",
        env={"LOCKGATE_ADMIN_TOKEN": TOKEN},
    )  # fmt: skip
    _one_line_error(result, "gateway.url", url, "did not answer within 1s")


def test_session_new_needs_a_gateway_and_its_token() -> None:
    result = _lockgate("session", "new", env={"LOCKGATE_GATEWAY__URL": ""})
    _one_line_error(result, "--gateway URL")
    url = f"http://127.0.0.1:{_closed_port()}"
    result = _lockgate("session", "new", "--gateway", url, env={"LOCKGATE_ADMIN_TOKEN": ""})
    _one_line_error(result, "LOCKGATE_ADMIN_TOKEN")
    result = _lockgate("session", "new", "--gateway", url, "--metadata", "[1]",
                       env={"LOCKGATE_ADMIN_TOKEN": TOKEN})  # fmt: skip
    _one_line_error(result, "--metadata", "JSON object")
    result = _lockgate("session", "new", "--gateway", url, env={"LOCKGATE_ADMIN_TOKEN": TOKEN})
    assert result.returncode == 1 and "cannot reach the gateway" in result.stderr


def test_every_deploy_command_documents_its_options() -> None:
    for command in ("replicas", "gateway", "serve"):
        result = _lockgate(command, "--help")
        assert result.returncode == 0
        for option in ("model.path", "replicas.urls", "replicas.count", "gateway.port",
                       "gateway.url", "gateway.admin_token_env", "LOCKGATE_"):  # fmt: skip
            assert option in result.stdout, (command, option)
    result = _lockgate("session", "new", "--help")
    assert result.returncode == 0 and "OPENAI_BASE_URL" in result.stdout


def test_a_gateway_alone_serves_sessions_and_stops_cleanly_on_sigterm(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`lockgate gateway` with no replica yet (they may join later through the admin API)."""
    env = {
        **os.environ,
        "LOCKGATE_CACHE": str(tiny_model_dir.parent),
        "LOCKGATE_ADMIN_TOKEN": TOKEN,
    }
    log_path = tmp_path / "gateway.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lockgate.coordinator.cli", "gateway", "--run-dir", str(tmp_path)],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env,
        )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # printed once it serves
        assert line.startswith("gateway_url=http://127.0.0.1:"), log_path.read_text()
        url = line.split("=", 1)[1]
        result = _lockgate(
            "session", "new", "--task-id", "t1", env={**env, "LOCKGATE_GATEWAY__URL": url}
        )
        assert result.returncode == 0, result.stderr
        created = dict(line.split("=", 1) for line in result.stdout.splitlines())
        assert created["OPENAI_BASE_URL"] == f"{url}/sessions/{created['LOCKGATE_SESSION_ID']}/v1"
        assert created["OPENAI_API_KEY"]
        result = _lockgate(
            "session", "new", "--gateway", url, env={"LOCKGATE_ADMIN_TOKEN": "x" * 12}
        )
        _one_line_error(result, "refused the admin token")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert (tmp_path / "trajectories.sqlite").exists()
