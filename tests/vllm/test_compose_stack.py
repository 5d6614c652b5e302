"""docker-compose.yml's default, the CPU stack, on a machine where no container can run: its
services run as local processes, each with the command and environment the file gives it after
substituting an .env that holds only the admin token (tests/support/compose_local.py:
dependency order, healthchecks awaited, volumes as tmp dirs), and train the toy example two
steps: what runs in the containers is what this test ran. One vLLM replica start in all."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import httpx
import pytest

from lockgate.coordinator.launch.processes import free_port
from tests.support.compose_local import (
    LocalStack,
    compose_variables,
    load_compose,
    local_mapping,
    services_of,
)
from tests.support.marked_processes import processes_with_marker
from tests.unit.project.test_compose_stack import (
    COMPOSE,
    ROOT,
    TOKEN,
    _env_file,
    _local_env,
)


@pytest.mark.vllm
def test_the_default_trains_the_toy_example_from_an_env_holding_only_the_token(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    gateway_port = free_port()
    replica_port = free_port()
    while replica_port == gateway_port:  # free_port can hand out the same port twice
        replica_port = free_port()
    env_file = _env_file(tmp_path, f"LOCKGATE_ADMIN_TOKEN={TOKEN}")
    # The rest comes from compose's own environment, which wins over the .env, as a user's
    # `TRAIN_STEPS=2 docker compose up` would: 2 steps (the default trains 30), and free ports
    # instead of 8000 and 8001, which other runs on this shared machine may hold.
    shell = {
        "TRAIN_STEPS": "2",
        "GATEWAY_PORT": str(gateway_port),
        "REPLICA_PORT": str(replica_port),
        "REPLICA_URLS": f"[http://replica:{replica_port}]",
    }
    compose = load_compose(COMPOSE, compose_variables(env_file, shell))
    services = services_of(compose, set())  # no profile: what a plain `up` starts
    mapping = local_mapping(services, tmp_path / "data")
    runs = mapping.paths["/data/runs"]
    # A previous run's config on the volume, which must not make this run's trainer healthy.
    stale = runs / "train" / "config.json"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("{}")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    marker = f"LOCKGATE_TEST_RUN={uuid.uuid4().hex}"
    (tmp_path / "logs").mkdir()
    started = time.monotonic()
    with LocalStack(
        services, mapping, _local_env(tmp_path, marker, tiny_model_dir), ROOT, tmp_path / "logs"
    ) as stack:
        assert stack.up() == ["replica", "gateway", "trainer"]
        trainer = stack.running["trainer"]
        assert not trainer.healthy()  # just started: the config.json is the previous run's
        print(f"replica + gateway healthy, trainer started in {time.monotonic() - started:.0f}s")
        trainer.wait_healthy(timeout_s=300)  # this run wrote its config
        assert trainer.proc.wait(timeout=1500) == 0, trainer.log_tail()
        print(f"trainer done after {time.monotonic() - started:.0f}s; {stack.timings}")
        for name in ("replica", "gateway"):  # they keep serving the trained weights
            stack.running[name].wait_healthy(timeout_s=30)
        log = trainer.log_path.read_text()
        assert f"using the gateway at http://127.0.0.1:{gateway_port}" in log
        assert "vLLM replica(s)" not in log  # external mode: it started none of its own

        records = [json.loads(line) for line in (runs / "train/metrics.jsonl").read_text().splitlines()]  # fmt: skip
        assert [r["step"] for r in records] == [1, 2]
        assert records[-1]["version"] == 2 and records[-1]["count/syncs"] == 2
        # The toy example's sizes, the defaults: 4 groups a step.
        assert all(r["batch/groups"] == 4 and r["batch/loss_tokens"] > 0 for r in records)
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
