"""docker-compose.yml, on a machine where no container can run.

Docker's own parser (Debian's docker-compose, which scripts/test.sh installs) validates it;
then the cpu profile's services run as local processes, each with the command and environment
the file gives it after substituting a test .env (tests/compose_local.py: dependency order,
healthchecks awaited, volumes as tmp dirs), and train the toy example a few steps: what runs in
the containers is what this test ran. One vLLM replica start in all."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from lockgate.coordinator.launch.processes import free_port
from tests.support.compose_local import (
    ComposeError,
    LocalStack,
    interpolate,
    load_compose,
    local_mapping,
    read_env_file,
    services_of,
    start_order,
)
from tests.support.marked_processes import processes_with_marker

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


@pytest.mark.vllm
def test_the_cpu_profile_trains_the_toy_example_as_local_processes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    gateway_port = free_port()
    replica_port = free_port()
    while replica_port == gateway_port:  # free_port can hand out the same port twice
        replica_port = free_port()
    env_file = _env_file(
        tmp_path,
        LOCKGATE_ADMIN_TOKEN=TOKEN,
        GATEWAY_PORT=str(gateway_port),
        REPLICA_PORT=str(replica_port),
        REPLICA_URLS=f"[http://replica:{replica_port}]",
        TRAIN_STEPS="2",
        GROUPS_PER_STEP="2",
        GROUP_SIZE="4",
        VAL_EVERY="0",
    )
    compose = load_compose(COMPOSE, read_env_file(env_file))
    services = services_of(compose, {"cpu"})
    mapping = local_mapping(services, tmp_path / "data")
    marker = f"LOCKGATE_TEST_RUN={uuid.uuid4().hex}"
    (tmp_path / "logs").mkdir()
    started = time.monotonic()
    with LocalStack(
        services, mapping, _local_env(tmp_path, marker, tiny_model_dir), ROOT, tmp_path / "logs"
    ) as stack:
        assert stack.up() == ["replica", "gateway", "trainer"]
        print(f"replica + gateway healthy, trainer started in {time.monotonic() - started:.0f}s")
        trainer = stack.running["trainer"]
        assert trainer.proc.wait(timeout=900) == 0, trainer.log_tail()
        print(f"trainer done after {time.monotonic() - started:.0f}s; {stack.timings}")
        for service in stack.running.values():  # every healthcheck passes (the trainer's too)
            service.wait_healthy(timeout_s=30)
        log = trainer.log_path.read_text()
        assert f"using the gateway at http://127.0.0.1:{gateway_port}" in log
        assert "vLLM replica(s)" not in log  # external mode: it started none of its own

        runs = mapping.paths["/data/runs"]
        records = [json.loads(line) for line in (runs / "train/metrics.jsonl").read_text().splitlines()]  # fmt: skip
        assert [r["step"] for r in records] == [1, 2]
        assert records[-1]["version"] == 2 and records[-1]["count/syncs"] == 2
        assert all(r["batch/groups"] == 2 and r["batch/loss_tokens"] > 0 for r in records)
        # The replica holds the trained weights, loaded from the shared weights volume.
        info = httpx.get(f"http://127.0.0.1:{replica_port}/weight_info", timeout=30).json()
        assert info["weight_version"] == "2"
        snapshots = mapping.paths["/data/runs/train/trainer/weights"]
        assert any(p.name.startswith("step_") for p in snapshots.iterdir())
        assert (mapping.paths["/data/trajectories"] / "trajectories.sqlite").is_file()
        status = httpx.get(
            f"http://127.0.0.1:{gateway_port}/admin/status",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        ).json()
        assert status["version"] == 2
        assert stack.down() == {"gateway": 0, "replica": 0, "trainer": 0}
    assert processes_with_marker(marker) == []


def test_the_deepresearch_retrieval_service_serves_a_corpus(tmp_path: Path) -> None:
    port = free_port()
    env_file = _env_file(tmp_path, LOCKGATE_ADMIN_TOKEN=TOKEN, RETRIEVAL_PORT=str(port))
    compose = load_compose(COMPOSE, read_env_file(env_file))
    services = services_of(compose, {"deepresearch"})
    assert list(services) == ["retrieval"]
    mapping = local_mapping(services, tmp_path / "data")
    docs = [
        {"id": "1", "contents": '"Kaven Lomos"\nKaven Lomos was born in Tarsk.'},
        {"id": "2", "contents": '"Tarsk"\nTarsk is a city by the sea.'},
    ]
    corpus = mapping.paths["/data/deepresearch"] / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    marker = f"LOCKGATE_TEST_RUN={uuid.uuid4().hex}"
    (tmp_path / "logs").mkdir()
    env = _local_env(tmp_path, marker, Path("/nonexistent/tiny"))
    with LocalStack(services, mapping, env, ROOT, tmp_path / "logs") as stack:
        stack.up()
        stack.running["retrieval"].wait_healthy(timeout_s=120)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/retrieve",
            json={"queries": ["where was Kaven Lomos born"], "topk": 1, "return_scores": True},
            timeout=30,
        ).json()
        assert answer["result"][0][0]["document"]["id"] == "1"
        # uvicorn shuts down on SIGTERM, then dies of the signal it raises again: a clean stop
        # (exit 143 in a container), not a kill.
        assert stack.down()["retrieval"] in (0, -signal.SIGTERM)
    assert processes_with_marker(marker) == []
