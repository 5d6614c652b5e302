"""Ready-made environments: tasks from a JSONL file, solved by an agent that runs elsewhere
(an external command; an HTTP service is service.py's)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from lockgate.agent_runtime.command import CommandAgent
from lockgate.agent_runtime.types import Agent, RewardFn, Task


def load_tasks_jsonl(path: Path) -> list[Task]:
    """One task per non-empty line: `{"id": ..., ...data}`; every other key is the task's data.

    Bad lines, missing or duplicate ids are `ValueError`s naming the file and line.
    """
    if not path.is_file():
        raise FileNotFoundError(f"tasks file not found: {path}")
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not valid JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a task must be a JSON object, got {type(row).__name__}")
        task_id = row.pop("id", None)
        if isinstance(task_id, bool) or not isinstance(task_id, str | int) or task_id == "":
            raise ValueError(f'{where}: a task needs an "id" (a string or an integer)')
        task_id = str(task_id)
        if task_id in seen:
            raise ValueError(f"{where}: task id '{task_id}' repeats line {seen[task_id]}")
        seen[task_id] = number
        tasks.append(Task(id=task_id, data=row))
    if not tasks:
        raise ValueError(f"{path}: no tasks (expected one JSON object per line)")
    return tasks


class TasksEnvironment:
    """Tasks from a JSONL file (or given), each rollout run by `agent`.

    It has no reward function: an agent that runs elsewhere reports its reward itself.
    """

    def __init__(self, tasks: Path | Sequence[Task], agent: Agent) -> None:
        self._tasks = list(tasks) if not isinstance(tasks, Path) else load_tasks_jsonl(tasks)
        self._agent = agent

    def train_tasks(self) -> Sequence[Task]:
        return self._tasks

    @property
    def agent(self) -> Agent:
        return self._agent

    @property
    def reward(self) -> RewardFn | None:
        return None


class CommandEnvironment(TasksEnvironment):
    """Tasks from a JSONL file, each rollout solved by running `command` (see `CommandAgent`).

    It has no reward function: the command prints its reward or posts it to the gateway.
    """

    def __init__(
        self,
        command: Sequence[str],
        tasks: Path | Sequence[Task],
        *,
        timeout_s: float | None = None,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        output_limit_kib: int = 64,
        kill_grace_s: float = 2.0,
    ) -> None:
        agent = CommandAgent(
            command=list(command),
            timeout_s=timeout_s,
            cwd=cwd,
            env=dict(env or {}),
            log_dir=log_dir,
            output_limit_kib=output_limit_kib,
            kill_grace_s=kill_grace_s,
        )
        super().__init__(tasks, agent)
