"""docker-compose.yml's cpu profile, on a machine where no container can run: its services run as
local processes, each with the command and environment the file gives it after substituting a
test .env (tests/support/compose_local.py: dependency order, healthchecks awaited, volumes as
tmp dirs), and train the toy example a few steps: what runs in the containers is what this
test ran. One vLLM replica start in all."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
import pytest

from lockgate.coordinator.launch.processes import free_port
from tests.support.compose_local import (
    LocalStack,
    load_compose,
    local_mapping,
    read_env_file,
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
