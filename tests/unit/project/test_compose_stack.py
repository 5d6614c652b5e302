"""docker-compose.yml, checked without running anything: Docker's own parser (Debian's
docker-compose, which scripts/test.sh installs; skipped without it), the .env example, and
the substitution tests/support/compose_local.py does as compose does (its services run as
local processes: tests/vllm/ and tests/integration/test_compose_stack.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.compose_local import (
    ComposeError,
    interpolate,
    load_compose,
    read_env_file,
    services_of,
    start_order,
)

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
TOKEN = "admin-token-for-the-compose-test"


def _env_file(tmp_path: Path, **values: str) -> Path:
    """.env.example with `values` set, as a user's .env."""
    env = {**read_env_file(ENV_EXAMPLE), **values}
    path = tmp_path / ".env"
    path.write_text("".join(f"{key}={value}\n" for key, value in env.items()))
    return path


def _docker_compose(env_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("no docker-compose (scripts/test.sh installs Debian's package)")
    # The shell's variables win over the .env file in compose: none of ours may leak in.
    env = {k: v for k, v in os.environ.items() if k not in read_env_file(ENV_EXAMPLE)}
    return subprocess.run(
        [exe, "-f", str(COMPOSE), "--project-directory", str(ROOT), "--env-file", str(env_file),
         *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_docker_compose_parses_the_file_for_each_profile(tmp_path: Path) -> None:
    env_file = _env_file(tmp_path, LOCKGATE_ADMIN_TOKEN=TOKEN)
    for profile in ("cpu", "gpu", "deepresearch"):
        result = _docker_compose(env_file, "--profile", profile, "config", "-q")
        assert result.returncode == 0, result.stderr
    resolved = _docker_compose(env_file, "config").stdout
    assert "published: 8000" in resolved or "127.0.0.1:8000:8000" in resolved


def test_docker_compose_refuses_to_run_without_an_admin_token(tmp_path: Path) -> None:
    # .env.example as shipped: the token is empty, and no default is baked in.
    result = _docker_compose(ENV_EXAMPLE, "config", "-q")
    assert result.returncode != 0
    assert "set LOCKGATE_ADMIN_TOKEN in .env" in result.stderr


def test_the_env_example_names_every_variable_and_publishes_on_loopback() -> None:
    env = read_env_file(ENV_EXAMPLE)
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", COMPOSE.read_text()))
    assert used - set(env) == set()
    assert env["LOCKGATE_ADMIN_TOKEN"] == "" and env["GATEWAY_BIND"] == "127.0.0.1"
    with pytest.raises(ComposeError, match="set LOCKGATE_ADMIN_TOKEN"):
        load_compose(COMPOSE, env)
    compose = load_compose(COMPOSE, {**env, "LOCKGATE_ADMIN_TOKEN": TOKEN})
    published = {
        name: spec["ports"] for name, spec in compose["services"].items() if spec.get("ports")
    }
    assert published == {
        "gateway": ["127.0.0.1:8000:8000"],
        "gateway-gpu": ["127.0.0.1:8000:8000"],
    }
    assert start_order(services_of(compose, {"cpu"})) == ["replica", "gateway", "trainer"]
    assert start_order(services_of(compose, {"gpu"})) == [
        "replica-gpu",
        "gateway-gpu",
        "trainer-gpu",
    ]


def test_substitution_follows_compose() -> None:
    env = {"A": "a", "EMPTY": ""}
    assert interpolate("${A}-${A:-x}-${EMPTY:-d}-${EMPTY-d}-${NONE-n}-$A-$$A", env) == (
        "a-a-d--n-a-$A"
    )
    with pytest.raises(ComposeError, match="NONE: needed"):
        interpolate("${NONE:?needed}", env)
    with pytest.raises(ComposeError, match="EMPTY: needed"):
        interpolate("${EMPTY:?needed}", env)


def _local_env(tmp_path: Path, marker: str, tiny_model_dir: Path) -> dict[str, str]:
    """What the image sets around the services' own environment (Dockerfile's ENV)."""
    name, value = marker.split("=")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("LOCKGATE_")},
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "LOCKGATE_CACHE": str(tiny_model_dir.parent),  # the image's tiny model
        "HF_HUB_OFFLINE": "1",
        "HOME": str(tmp_path / "home"),
        name: value,
    }
