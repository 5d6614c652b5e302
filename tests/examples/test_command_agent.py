"""Command agents: external programs run per rollout against a real gateway served over HTTP.

The gateway app runs under uvicorn on a loopback port in a background thread (the command is a
separate process, so it needs a real socket); the replica behind it is test_gateway_edges's
fake, which answers fixed tokens in the replica protocol the gateway speaks.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from lockgate.agent_runtime import (
    CommandAgent,
    CommandEnvironment,
    CommandOutputInvalid,
    RolloutContext,
    Task,
    load_tasks_jsonl,
    run_rollout,
)
from lockgate.agent_runtime.command import _own_process_group, parse_reward, reward_url
from lockgate.coordinator.config import load_config
from lockgate.coordinator.launch.local import load_environment
from lockgate.gateway.client import GatewayClient
from tests.support.marked_processes import processes_with_marker
from tests.support.socket_gateway import SocketGateway as Served
from tests.support.socket_gateway import socket_gateway

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "command_agent"
ADMIN = "admin-token-for-command-tests"
ANSWER = "42 apples"  # what the fake replica always says; 2 of its 8 characters are digits


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with socket_gateway(tiny_model_dir, tmp_path_factory.mktemp("gateway"), ADMIN, ANSWER) as up:
        yield up


@pytest.fixture
async def gateway(served: Served) -> AsyncIterator[GatewayClient]:
    async with GatewayClient(served.url, ADMIN) as client:
        yield client


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / f"agent_{uuid.uuid4().hex[:8]}.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


TASK = Task(id="t-1", data={"prompt": "Answer with numbers only: apple river", "max_tokens": 8})


# -- the shipped example ------------------------------------------------------------------------


async def test_the_example_agent_makes_a_real_chat_call_and_prints_its_reward(
    gateway: GatewayClient, served: Served, tmp_path: Path
) -> None:
    env = CommandEnvironment(
        [sys.executable, str(EXAMPLE / "agent.py")],
        EXAMPLE / "tasks.jsonl",
        timeout_s=30,
        log_dir=tmp_path / "logs",
    )
    task = env.train_tasks()[0]
    result = await run_rollout(gateway, env.agent, task, group_id="g", reward_fn=env.reward)
    assert result.status == "finished", result.error
    assert result.reward == pytest.approx(2 / 8)  # digits among the non-space chars of ANSWER
    (call,) = await gateway.calls(result.session_id)
    assert call.request["messages"] == [{"role": "user", "content": task.data["prompt"]}]
    assert call.completion_ids == served.replica.completion
    info = await gateway.session(result.session_id)
    assert info.status == "finished" and info.reward == pytest.approx(0.25)
    (log_file,) = (tmp_path / "logs").iterdir()
    assert result.session_id in log_file.name and ANSWER in log_file.read_text()


def test_the_example_config_describes_a_command_environment(tiny_model_dir: Path) -> None:
    config = load_config(EXAMPLE / "config.yaml")
    section = config.environment
    assert section.path is None
    assert section.command == ["python3", "agent.py"]
    assert section.tasks == EXAMPLE / "tasks.jsonl"
    assert section.workdir == EXAMPLE  # relative to the config file by default
    env = load_environment(section, tiny_model_dir)
    assert isinstance(env, CommandEnvironment) and env.reward is None
    assert len(env.train_tasks()) == len(load_tasks_jsonl(EXAMPLE / "tasks.jsonl")) == 32


# -- what the command gets and how its reward is read ---------------------------------------------


async def test_the_command_gets_the_session_endpoint_and_the_task_on_env_and_stdin(
    gateway: GatewayClient, tmp_path: Path
) -> None:
    command = _script(
        tmp_path,
        """
        import json, os, sys
        seen = {k: v for k, v in os.environ.items() if k.startswith(("OPENAI_", "LOCKGATE_"))}
        seen["stdin"] = sys.stdin.read()
        print(json.dumps(seen), file=sys.stderr)
        print("thinking...")
        print(json.dumps({"reward": 0.75, "note": "extra keys are fine"}))
        print("   ")
        """,
    )
    agent = CommandAgent(command, log_dir=tmp_path / "logs", env={"EXTRA": "1"})
    result = await run_rollout(gateway, agent, TASK, group_id="g")
    assert result.status == "finished" and result.reward == 0.75, result.error
    seen = json.loads(next((tmp_path / "logs").iterdir()).read_text())
    assert seen["OPENAI_BASE_URL"] == f"{gateway.base_url}/sessions/{result.session_id}/v1"
    assert seen["OPENAI_API_KEY"].startswith("lg-sk-")
    assert seen["OPENAI_MODEL"] == "lockgate"
    assert seen["LOCKGATE_SESSION_ID"] == result.session_id
    assert seen["LOCKGATE_REWARD_URL"] == f"{gateway.base_url}/sessions/{result.session_id}/reward"
    assert seen["LOCKGATE_TASK_ID"] == "t-1"
    assert json.loads(seen["LOCKGATE_TASK"]) == TASK.data == json.loads(seen["stdin"])


@pytest.mark.parametrize(
    ("stdout", "expected"),
    [
        ('{"reward": 1}\n', 1.0),
        ('log line\n{"reward": -0.5}\n\n', -0.5),
        ('{"reward": 0.5}\nlast words\n', None),  # only the last non-empty line counts
        ('{"score": 1}\n', None),
        ("[1, 2]\n", None),
        ("", None),
    ],
)
def test_parse_reward(stdout: str, expected: float | None) -> None:
    assert parse_reward(stdout) == expected


@pytest.mark.parametrize("line", ['{"reward": "high"}', '{"reward": true}', '{"reward": NaN}'])
def test_a_reward_that_is_not_a_finite_number_is_an_error(line: str) -> None:
    with pytest.raises(CommandOutputInvalid, match="not a finite number"):
        parse_reward(line)


def test_the_reward_url_sits_beside_the_session_v1_root() -> None:
    assert reward_url("http://gw:1/sessions/abc/v1") == "http://gw:1/sessions/abc/reward"
    assert reward_url("http://gw:1/sessions/abc/v1/") == "http://gw:1/sessions/abc/reward"


async def test_garbage_output_without_a_reward_function_fails_with_a_clear_reason(
    gateway: GatewayClient, tmp_path: Path
) -> None:
    command = _script(tmp_path, "print('all done, no idea what my reward is')")
    result = await run_rollout(gateway, CommandAgent(command), TASK, group_id="g")
    assert result.status == "failed" and result.reward is None
    assert result.error is not None and result.error.startswith("no reward:")
    assert "no reward function is configured" in result.error
    assert (await gateway.session(result.session_id)).status == "failed"


async def test_garbage_output_leaves_the_reward_to_the_reward_function(
    gateway: GatewayClient, tmp_path: Path
) -> None:
    command = _script(tmp_path, "print('garbage')")
    result = await run_rollout(
        gateway, CommandAgent(command), TASK, group_id="g", reward_fn=lambda task, calls: 0.125
    )
    assert result.status == "finished" and result.reward == 0.125


async def test_a_malformed_reward_fails_the_rollout(gateway: GatewayClient, tmp_path: Path) -> None:
    command = _script(tmp_path, """print('{"reward": "great"}')""")
    result = await run_rollout(gateway, CommandAgent(command), TASK, group_id="g")
    assert result.status == "failed"
    assert result.error is not None and result.error.startswith("CommandOutputInvalid:")


async def test_a_reward_recorded_on_the_session_is_used_when_the_agent_returns_none(
    gateway: GatewayClient,
) -> None:
    async def posts_its_reward(task: Task, ctx: RolloutContext) -> float | None:
        await gateway.set_reward(ctx.session_id, 0.625)
        return None

    result = await run_rollout(gateway, posts_its_reward, TASK, group_id="g")
    assert result.status == "finished" and result.reward == 0.625


async def test_a_command_can_post_its_reward_to_the_agent_facing_route(
    gateway: GatewayClient, tmp_path: Path
) -> None:
    command = _script(
        tmp_path,
        """
        import json, os, urllib.request
        request = urllib.request.Request(
            os.environ["LOCKGATE_REWARD_URL"],
            data=json.dumps({"reward": 0.875}).encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                     "Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=10).read()
        print("posted")
        """,
    )
    result = await run_rollout(gateway, CommandAgent(command), TASK, group_id="g")
    assert result.status == "finished" and result.reward == 0.875, result.error


async def test_output_is_kept_bounded_and_the_reward_still_read(
    gateway: GatewayClient, tmp_path: Path
) -> None:
    command = _script(
        tmp_path,
        """
        import sys
        for _ in range(2000):
            print("x" * 99, file=sys.stderr)
            print("y" * 99)
        print('{"reward": 0.5}')
        """,
    )
    agent = CommandAgent(command, log_dir=tmp_path / "logs", output_limit_kib=4)
    result = await run_rollout(gateway, agent, TASK, group_id="g")
    assert result.status == "finished" and result.reward == 0.5, result.error
    log_text = next((tmp_path / "logs").iterdir()).read_text()
    assert log_text.startswith("x" * 99) and log_text.endswith("truncated at 4096 bytes]\n")
    assert len(log_text) < 4096 + 100


# -- failures: exit status, timeouts, cancellation, leftovers --------------------------------------


async def test_a_non_zero_exit_fails_the_rollout_with_the_status_and_stderr_tail(
    gateway: GatewayClient, tmp_path: Path
) -> None:
    command = _script(
        tmp_path,
        """
        import sys
        print('{"reward": 1.0}')  # a reward from a failed run does not count
        print("Traceback: the tool broke", file=sys.stderr)
        sys.exit(3)
        """,
    )
    result = await run_rollout(gateway, CommandAgent(command), TASK, group_id="g")
    assert result.status == "failed" and result.reward is None
    assert result.error is not None
    assert result.error.startswith("CommandExited: command exited with status 3")
    assert "Traceback: the tool broke" in result.error
    assert (await gateway.session(result.session_id)).error == result.error


async def test_a_command_that_cannot_start_fails_the_rollout(
    gateway: GatewayClient, tmp_path: Path
) -> None:
    agent = CommandAgent([str(tmp_path / "no-such-agent")])
    result = await run_rollout(gateway, agent, TASK, group_id="g")
    assert result.status == "failed"
    assert result.error is not None and "could not start" in result.error


def _hanging_tree(tmp_path: Path, marker: str) -> tuple[CommandAgent, Path]:
    """A command whose child ignores SIGTERM (so only SIGKILL ends it), then both hang."""
    started = tmp_path / "started"
    command = _script(
        tmp_path,
        f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
        open({str(started)!r}, "w").write(str(child.pid))
        print("waiting forever", file=sys.stderr, flush=True)
        time.sleep(60)
        """,
    )
    key, value = marker.split("=")
    return CommandAgent(command, env={key: value}, kill_grace_s=0.3), started


def _written(path: Path) -> bool:
    return path.exists() and bool(path.read_text())


async def _wait_for(path: Path) -> None:
    for _ in range(200):
        if _written(path):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{path} never appeared")


async def test_a_hanging_command_times_out_and_its_whole_tree_is_killed(
    gateway: GatewayClient, tmp_path: Path
) -> None:
    marker = f"LOCKGATE_COMMAND_TEST={uuid.uuid4().hex}"
    agent, started = _hanging_tree(tmp_path, marker)
    agent = CommandAgent(agent.command, timeout_s=1.0, env=agent.env, kill_grace_s=0.3)
    result = await run_rollout(gateway, agent, TASK, group_id="g")
    assert started.exists()  # the tree really ran before it was killed
    assert result.status == "failed"
    assert result.error is not None
    assert result.error.startswith("CommandTimedOut: command timed out after 1.0s")
    assert "waiting forever" in result.error
    assert processes_with_marker(marker) == []


async def test_the_rollout_timeout_and_cancellation_kill_the_tree_too(
    gateway: GatewayClient, tmp_path: Path
) -> None:
    marker = f"LOCKGATE_COMMAND_TEST={uuid.uuid4().hex}"
    agent, started = _hanging_tree(tmp_path, marker)
    result = await run_rollout(gateway, agent, TASK, group_id="g", timeout_s=1.0)
    assert started.exists()
    assert result.status == "failed" and result.error == "rollout timed out after 1.0s"
    assert processes_with_marker(marker) == []

    started.unlink()
    rollout = asyncio.create_task(run_rollout(gateway, agent, TASK, group_id="g"))
    await _wait_for(started)
    # On a loaded machine one scan of /proc has seen only one of the two (the child was still
    # starting), so give it a moment.
    for _ in range(200):
        if len(processes_with_marker(marker)) == 2:
            break
        await asyncio.sleep(0.025)
    assert len(processes_with_marker(marker)) == 2
    rollout.cancel()
    with pytest.raises(asyncio.CancelledError):
        await rollout
    assert processes_with_marker(marker) == []


async def test_a_command_leads_its_own_group_in_the_runtimes_session(
    gateway: GatewayClient, tmp_path: Path
) -> None:
    # Its own session would be a scheduling group of its own (autogroup): many busy agents
    # would then crowd out the gateway and replicas whatever their thread counts.
    ids = tmp_path / "ids"
    command = _script(
        tmp_path,
        f"""
        import os
        open({str(ids)!r}, "w").write(f"{{os.getpid()}} {{os.getpgid(0)}} {{os.getsid(0)}}")
        print('{{"reward": 1.0}}', flush=True)
        """,
    )
    result = await run_rollout(gateway, CommandAgent(command), TASK, group_id="g")
    assert result.status == "finished", result.error
    pid, pgid, sid = map(int, ids.read_text().split())
    assert pgid == pid
    assert sid == os.getsid(0)


def test_the_command_gets_its_own_group_under_uvloop_too(tmp_path: Path) -> None:
    # uvloop refuses Popen's process_group; the runtime must still get a group, not a session.
    import uvloop  # installed with vLLM and uvicorn's standard extras

    ids = tmp_path / "ids"

    class Exited(asyncio.SubprocessProtocol):
        def __init__(self) -> None:
            self.done = asyncio.get_running_loop().create_future()

        def process_exited(self) -> None:
            self.done.set_result(None)

    async def start() -> None:
        loop = asyncio.get_running_loop()
        assert not isinstance(loop, asyncio.BaseEventLoop)
        transport, exited = await loop.subprocess_exec(
            Exited,
            "sh",
            "-c",
            f"echo $$ $(ps -o pgid= -p $$) $(ps -o sid= -p $$) > {ids}",
            **_own_process_group(loop),
        )
        await asyncio.wait_for(exited.done, 30)
        transport.close()

    uvloop.run(start())
    pid, pgid, sid = map(int, ids.read_text().split())
    assert pgid == pid
    assert sid == os.getsid(0)


async def test_children_left_behind_by_a_command_that_exits_are_killed(
    gateway: GatewayClient, tmp_path: Path
) -> None:
    marker = f"LOCKGATE_COMMAND_TEST={uuid.uuid4().hex}"
    key, value = marker.split("=")
    command = _script(
        tmp_path,
        """
        import subprocess, sys
        # The child inherits stdout and stderr, so the pipes stay open after this exits.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print('{"reward": 1.0}', flush=True)
        """,
    )
    agent = CommandAgent(command, env={key: value}, kill_grace_s=0.3)
    result = await run_rollout(gateway, agent, TASK, group_id="g")
    assert result.status == "finished" and result.reward == 1.0, result.error
    assert result.duration_s < 10  # the command's exit ends the rollout, not its child's
    assert processes_with_marker(marker) == []


# -- tasks files and config -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"id": "a"}\nnot json\n', ":2: not valid JSON"),
        ('{"prompt": "x"}\n', ':1: a task needs an "id"'),
        ('{"id": "a"}\n\n{"id": "a"}\n', ":3: task id 'a' repeats line 1"),
        ("[1]\n", "must be a JSON object"),
        ("\n\n", "no tasks"),
    ],
)
def test_bad_tasks_files_name_the_line(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"tasks\.jsonl") as info:
        load_tasks_jsonl(path)
    assert needle in str(info.value)


def test_task_ids_may_be_integers_and_the_rest_is_data(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": 7, "prompt": "p", "n": [1, 2]}\n')
    assert load_tasks_jsonl(path) == [Task(id="7", data={"prompt": "p", "n": [1, 2]})]


@pytest.mark.parametrize(
    ("environment", "needle"),
    [
        ("path: env.py\n  command: [a]\n  tasks: t.jsonl", "not both"),
        ("command: [a]", "needs `tasks`"),
        ("tasks: t.jsonl", "only apply with `command`"),
        ("path: null", "set `path`"),
    ],
)
def test_the_environment_section_takes_a_path_or_a_command(
    tmp_path: Path, environment: str, needle: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(f"environment:\n  {environment}\n")
    with pytest.raises(ValueError, match=needle):
        load_config(path)


def test_a_command_environment_with_unknown_args_is_a_clear_error(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    (tmp_path / "tasks.jsonl").write_text('{"id": "a"}\n')
    path = tmp_path / "config.yaml"
    path.write_text(
        "environment:\n  command: [x]\n  tasks: tasks.jsonl\n  workdir: sub\n  args: {timeout: 5}\n"
    )
    section = load_config(path).environment
    assert section.tasks == tmp_path / "tasks.jsonl" and section.workdir == tmp_path / "sub"
    with pytest.raises(ValueError, match=r"environment\.args do not fit"):
        load_environment(section, tiny_model_dir)
