"""docker-compose.yml's deepresearch profile as local processes (tests/support/compose_local.py):
the retrieval service, started alone, serves a corpus."""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import httpx

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


def test_the_deepresearch_retrieval_service_serves_a_corpus(tmp_path: Path) -> None:
    port = free_port()
    env_file = _env_file(tmp_path, f"LOCKGATE_ADMIN_TOKEN={TOKEN}")
    compose = load_compose(COMPOSE, compose_variables(env_file, {"RETRIEVAL_PORT": str(port)}))
    enabled = services_of(compose, {"deepresearch"})
    assert [name for name in enabled if compose["services"][name].get("profiles")] == ["retrieval"]
    # `docker compose --profile deepresearch up retrieval`: the service alone.
    services = {"retrieval": enabled["retrieval"]}
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
