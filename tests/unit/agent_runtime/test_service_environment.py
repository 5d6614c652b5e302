"""Agents as HTTP services (`environment.url`): the coordinator POSTs each rollout to the service.

The gateway is the real app over a fake replica, in process (tests/support/fake_gateway.py);
the service is an httpx MockTransport handler that plays an agent: it calls the session's chat
route on that gateway, posts rewards, refuses connections, answers 5xx or garbage, or hangs.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.agent_runtime import (
    RolloutResult,
    ServiceAgent,
    ServiceEnvironment,
    ServiceOptions,
    ServiceRequest,
    Task,
    run_group,
    run_rollout,
)
from lockgate.agent_runtime.service import expand_headers, reward_of_answer
from lockgate.coordinator.config import EnvironmentSection, load_config
from lockgate.coordinator.launch.local import load_environment
from lockgate.gateway.client import GatewayClient
from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica, serve_gateway

SERVICE = "http://agent-service:8765/rollout"
TASK = Task(id="numbers-0", data={"prompt": "Answer with numbers only: apple", "max_tokens": 4})

Behaviour = Callable[[dict[str, Any], "Served"], Awaitable[httpx.Response]]


@dataclass
class Served:
    """The in-process gateway, an admin client for it, and the service's scripted answers."""

    app: Any
    gateway: GatewayClient
    behaviours: list[Behaviour] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[httpx.Headers] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0

    def agent_http(self) -> httpx.AsyncClient:
        """How the service reaches the gateway (its session URLs are http://gw/...)."""
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        self.headers.append(request.headers)
        behaviour = self.behaviours[min(len(self.bodies), len(self.behaviours)) - 1]
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await behaviour(body, self)
        finally:
            self.in_flight -= 1

    def environment(self, **options: Any) -> ServiceEnvironment:
        env = ServiceEnvironment(
            SERVICE,
            [TASK],
            ServiceOptions(**{"retry_backoff_s": 0.0, **options}),
            transport=httpx.MockTransport(self.handle),
            environ={"AGENT_TOKEN": "s3cret"},
        )
        env.attach_gateway(ADMIN, httpx.ASGITransport(app=self.app))
        return env

    async def rollout(self, env: ServiceEnvironment, **kwargs: Any) -> RolloutResult:
        return await run_rollout(self.gateway, env.agent, TASK, group_id="g", **kwargs)


@pytest.fixture
async def served(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Served]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    replica = FakeReplica(
        completion=tok.encode("42", add_special_tokens=False)
        + [tok.convert_tokens_to_ids("<|im_end|>")]
    )
    async with serve_gateway(tiny_model_dir, tmp_path, {REPLICA: replica}) as (_, app):
        transport = httpx.ASGITransport(app=app)
        async with GatewayClient("http://gw", ADMIN, transport=transport) as gateway:
            yield Served(app, gateway)


# -- what the service does, as behaviours --------------------------------------------------------


async def _chat(body: dict[str, Any], served: Served) -> None:
    async with served.agent_http() as http:
        resp = await http.post(
            body["base_url"] + "/chat/completions",
            headers={"Authorization": f"Bearer {body['api_key']}"},
            json={
                "model": body["model"],
                "messages": [{"role": "user", "content": body["task"]["data"]["prompt"]}],
                "max_tokens": body["task"]["data"]["max_tokens"],
            },
        )
    assert resp.status_code == 200, resp.text


def answers(status: int, content: bytes = b"", *, chat: bool = False) -> Behaviour:
    async def behaviour(body: dict[str, Any], served: Served) -> httpx.Response:
        if chat:
            await _chat(body, served)
        return httpx.Response(status, content=content)

    return behaviour


def rewards(reward: float) -> Behaviour:
    return answers(
        200, json.dumps({"reward": reward, "note": "extra keys are fine"}).encode(), chat=True
    )


def posts_reward(posted: float, answer: bytes) -> Behaviour:
    async def behaviour(body: dict[str, Any], served: Served) -> httpx.Response:
        await _chat(body, served)
        async with served.agent_http() as http:
            resp = await http.post(
                body["reward_url"],
                headers={"Authorization": f"Bearer {body['api_key']}"},
                json={"reward": posted},
            )
        assert resp.status_code == 200, resp.text
        return httpx.Response(200 if answer else 204, content=answer)

    return behaviour


async def refuses(body: dict[str, Any], served: Served) -> httpx.Response:
    raise httpx.ConnectError("connection refused")


# -- the wire and the reward ---------------------------------------------------------------------


async def test_the_request_carries_task_session_model_reward_url_and_deadline(
    served: Served,
) -> None:
    served.behaviours = [rewards(0.75)]
    env = ServiceEnvironment(
        SERVICE,
        [TASK],
        ServiceOptions(timeout_s=60, headers={"Authorization": "Bearer ${AGENT_TOKEN}"}),
        transport=httpx.MockTransport(served.handle),
        environ={"AGENT_TOKEN": "s3cret"},
    )
    before = time.time()
    result = await served.rollout(env)
    assert result.status == "finished" and result.reward == 0.75, result.error
    (body,) = served.bodies
    assert ServiceRequest.model_validate(body).model_dump() == body
    assert body["task"] == {"id": TASK.id, "data": TASK.data}
    assert body["session_id"] == result.session_id
    assert body["base_url"] == f"http://gw/sessions/{result.session_id}/v1"
    assert body["reward_url"] == f"http://gw/sessions/{result.session_id}/reward"
    assert body["api_key"] and body["model"] == "lockgate" and body["attempt"] == 1
    assert before + 60 <= body["deadline_unix_s"] <= time.time() + 60
    assert 59 < body["seconds_left"] <= 60
    (headers,) = served.headers
    assert headers["authorization"] == "Bearer s3cret"
    assert headers["content-type"] == "application/json"
    # The service's model call is the session's record, and the answer's reward its reward.
    (call,) = await served.gateway.calls(result.session_id)
    assert call.request["messages"][0]["content"] == TASK.data["prompt"]
    assert (await served.gateway.session(result.session_id)).reward == 0.75


@pytest.mark.parametrize("answer", [b"{}", b'{"reward": null}', b""], ids=["{}", "null", "204"])
async def test_without_a_reward_in_the_answer_the_posted_one_counts(
    served: Served, answer: bytes
) -> None:
    served.behaviours = [posts_reward(0.4, answer)]
    result = await served.rollout(served.environment())
    assert result.status == "finished" and result.reward == 0.4, result.error


async def test_the_answers_reward_wins_over_a_posted_one(served: Served) -> None:
    served.behaviours = [posts_reward(0.4, b'{"reward": 0.9}')]
    result = await served.rollout(served.environment())
    assert result.status == "finished" and result.reward == 0.9


async def test_no_reward_anywhere_fails_the_rollout_rather_than_scoring_zero(
    served: Served,
) -> None:
    served.behaviours = [answers(200, b"{}", chat=True)]
    result = await served.rollout(served.environment())
    assert result.status == "failed" and result.reward is None
    assert result.error is not None and result.error.startswith("no reward")


# -- retries: only while nothing was recorded -----------------------------------------------------


async def test_a_refused_connection_or_a_5xx_is_retried_while_nothing_was_recorded(
    served: Served,
) -> None:
    served.behaviours = [refuses, answers(503, b"warming up"), rewards(0.5)]
    result = await served.rollout(served.environment(retries=2))
    assert result.status == "finished" and result.reward == 0.5, result.error
    assert [b["attempt"] for b in served.bodies] == [1, 2, 3]
    assert len({b["session_id"] for b in served.bodies}) == 1  # the same session each time
    assert result.num_calls == 1


async def test_a_session_with_a_recorded_call_is_not_retried(served: Served) -> None:
    served.behaviours = [answers(500, b"agent crashed after its first call", chat=True)]
    result = await served.rollout(served.environment(retries=3))
    assert result.status == "failed" and len(served.bodies) == 1
    assert result.error == (
        f"ServiceHttpError: {SERVICE} answered HTTP 500: agent crashed after its first call"
        " (1 attempt); not retried: the session already has 1 recorded call(s)"
    )


async def test_retries_end_and_the_failure_says_how_many_attempts(served: Served) -> None:
    served.behaviours = [refuses]
    result = await served.rollout(served.environment(retries=2))
    assert result.status == "failed" and len(served.bodies) == 3
    assert result.error is not None
    assert result.error.startswith(f"ServiceUnreachable: POST {SERVICE}: ConnectError")
    assert result.error.endswith("(3 attempts)") and "\n" not in result.error


async def test_a_4xx_is_not_retried(served: Served) -> None:
    served.behaviours = [answers(401, b'{"error": "bad token"}')]
    result = await served.rollout(served.environment(retries=2))
    assert result.status == "failed" and len(served.bodies) == 1
    assert (
        result.error == f'ServiceHttpError: {SERVICE} answered HTTP 401: {{"error": "bad token"}}'
    )


async def test_without_a_gateway_to_ask_nothing_is_retried(served: Served) -> None:
    served.behaviours = [refuses, rewards(1.0)]
    env = ServiceEnvironment(
        SERVICE, [TASK], ServiceOptions(retries=2), transport=httpx.MockTransport(served.handle)
    )
    result = await served.rollout(env)
    assert result.status == "failed" and len(served.bodies) == 1
    assert result.error is not None
    assert result.error.endswith("not retried: no gateway to check the session's records against")


async def test_a_real_refused_connection_fails_with_a_one_line_reason(served: Served) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = ServiceAgent(f"http://127.0.0.1:{port}/rollout", ServiceOptions(retries=0))
    result = await run_rollout(served.gateway, agent, TASK, group_id="g")
    assert result.status == "failed" and result.error is not None
    assert result.error.startswith(f"ServiceUnreachable: POST http://127.0.0.1:{port}/rollout:")
    assert "\n" not in result.error


# -- timeouts, malformed answers, the concurrency cap ---------------------------------------------


async def test_a_service_that_does_not_answer_by_the_deadline_fails_its_rollout(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    async def hangs(body: dict[str, Any], served: Served) -> httpx.Response:
        await asyncio.sleep(30)
        raise AssertionError("not cancelled")

    served.behaviours = [hangs]
    started = time.monotonic()
    result = await served.rollout(served.environment(timeout_s=0.3))
    assert time.monotonic() - started < 5
    assert result.status == "failed" and result.reward is None
    assert result.error == f"ServiceTimedOut: {SERVICE} gave no answer within timeout_s=0.3"
    # Shown in the run's log as well as counted.
    assert f"session {result.session_id}) failed: {result.error}" in caplog.text


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"<html>ok</html>", "Invalid JSON"),
        (b"[0.5]", "Input should be an object"),
        (b'{"reward": "0.5"}', "reward: Input should be a valid number"),
        (b'{"reward": true}', "reward: Input should be a valid number"),
        (b'{"reward": NaN}', "reward: Input should be a finite number"),
        (b'{"reward": 1e999}', "reward: Input should be a finite number"),
    ],
)
async def test_a_malformed_answer_fails_the_rollout_once_with_a_one_line_reason(
    served: Served, content: bytes, why: str
) -> None:
    served.behaviours = [answers(200, content)]
    result = await served.rollout(served.environment(retries=2))
    assert result.status == "failed" and len(served.bodies) == 1
    assert result.error is not None and "\n" not in result.error
    assert result.error.startswith("ServiceAnswerInvalid: ") and why in result.error


async def test_an_answer_over_the_limit_is_invalid(served: Served) -> None:
    served.behaviours = [answers(200, b'{"reward": 1, "pad": "' + b"x" * 4096 + b'"}')]
    result = await served.rollout(served.environment(answer_limit_kib=1))
    assert result.status == "failed"
    assert result.error == f"ServiceAnswerInvalid: {SERVICE} answered more than answer_limit_kib=1"


async def test_rollouts_beyond_max_concurrency_wait_for_a_slot(served: Served) -> None:
    async def slow(body: dict[str, Any], served: Served) -> httpx.Response:
        await asyncio.sleep(0.05)
        return httpx.Response(200, json={"reward": 1.0})

    served.behaviours = [slow]
    env = served.environment(max_concurrency=2)
    results = await run_group(served.gateway, env.agent, TASK, 6, group_id="g")
    assert [r.status for r in results] == ["finished"] * 6
    assert served.most_in_flight == 2


# -- the pure parts -------------------------------------------------------------------------------


def test_reward_of_answer() -> None:
    assert reward_of_answer(SERVICE, 200, b'{"reward": 1}') == 1.0
    assert reward_of_answer(SERVICE, 201, b'{"reward": 0.25, "x": [1]}') == 0.25
    assert reward_of_answer(SERVICE, 200, b"{}") is None
    assert reward_of_answer(SERVICE, 204, b"") is None


def test_headers_read_their_secrets_from_the_environment_and_never_print_them() -> None:
    environ = {"AGENT_TOKEN": "s3cret"}
    headers = {"Authorization": "Bearer ${AGENT_TOKEN}", "X-Price": "$$5", "X-Plain": "yes"}
    assert expand_headers(headers, environ) == {
        "Authorization": "Bearer s3cret",
        "X-Price": "$5",
        "X-Plain": "yes",
    }
    with pytest.raises(ValueError, match="'Authorization' needs the environment variable "
                       "AGENT_TOKEN, which is not set"):  # fmt: skip
        expand_headers(headers, {})
    with pytest.raises(ValueError, match="write \\$\\$ for a literal"):
        expand_headers({"X": "costs $5"}, environ)


# -- the config ----------------------------------------------------------------------------------


def test_the_environment_section_takes_exactly_one_source(tmp_path: Path) -> None:
    section = EnvironmentSection.model_validate({"url": SERVICE, "tasks": "t.jsonl"})
    assert section.path is None and str(section.url) == SERVICE
    cases = {
        "needs `tasks`": {"url": SERVICE},
        "set `command` (an agent program) or `url` (an agent service), not both": {
            "command": ["a"], "url": SERVICE, "tasks": "t.jsonl"
        },
        "not all": {"path": "env.py", "command": ["a"], "url": SERVICE, "tasks": "t.jsonl"},
        "`workdir` only applies with `command`": {"url": SERVICE, "tasks": "t", "workdir": "."},
        "URL scheme should be 'http' or 'https'": {"url": "ftp://x/", "tasks": "t.jsonl"},
    }  # fmt: skip
    for needle, raw in cases.items():
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            EnvironmentSection.model_validate(raw)


def test_a_url_config_loads_a_service_environment_with_its_options(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tasks.jsonl").write_text(
        '{"id": "a", "prompt": "p"}\n{"id": "b", "prompt": "q"}\n'
    )
    config = tmp_path / "config.yaml"
    config.write_text(
        "environment:\n"
        f"  url: {SERVICE}\n"
        "  tasks: tasks.jsonl\n"
        "  args: {max_concurrency: 3, timeout_s: 9, headers: {X-Key: '${SERVICE_KEY}'}}\n"
    )
    monkeypatch.setenv("SERVICE_KEY", "k")
    section = load_config(config).environment
    assert section.tasks == tmp_path / "tasks.jsonl"
    env = load_environment(section, tiny_model_dir)
    assert isinstance(env, ServiceEnvironment) and env.reward is None
    assert [t.id for t in env.train_tasks()] == ["a", "b"]
    agent = env.agent
    assert isinstance(agent, ServiceAgent) and agent.url == SERVICE
    assert agent.options.max_concurrency == 3 and agent.options.timeout_s == 9
    bad = section.model_copy(update={"args": {"retries": -1, "nope": 1}})
    with pytest.raises(ValueError, match="do not fit a service environment"):
        load_environment(bad, tiny_model_dir)
    monkeypatch.delenv("SERVICE_KEY")
    with pytest.raises(ValueError, match="SERVICE_KEY, which is not set"):
        load_environment(section, tiny_model_dir)
