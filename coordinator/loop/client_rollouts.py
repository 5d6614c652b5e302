"""Client-driven rollouts (`loop.rollouts: client`): groups that clients start and finish.

The loop dispatches nothing. At the start it opens the gateway's enrolment with a fresh key
(the key creates sessions and nothing else; gateway/api/enrolment.py), and clients holding it
create sessions with a task id and a group, run any agent against each session's base URL and
key, and finish them with a reward. The gateway groups the sessions; this source collects each
group once all `group_size` of its sessions have ended (or, for a group still incomplete
`loop.rollout_timeout_s` after its first session, the members it has, its open sessions
failed) and hands it to the loop, which trains
on it exactly as on a group of its own dispatch: the same bound at consumption
(`rollouts_stale`), advantages, metrics, syncs and checkpoints.

The staleness gate holds for clients as for dispatch, and the coordinator stays the one that
applies it: it tells the gateway how many groups may have started (`groups_admitted`), raised
after every weight sync and whenever a group is dropped (its slot freed), and the gateway
refuses a session that would start a group past that with a 429 and `Retry-After`.

In the controller's terms: the gateway counts the groups started through this enrolment, and
`controller.groups_started` holds the rest of the slots (the groups trained before a resume,
less the groups dropped since), so the gateway may start a new group while
`its count < capacity(version) - controller.groups_started`.

On resume the enrolment opens again with the run's key (RUN_DIR/enrolment.json), so clients
holding it go on, and with its counts at zero; the coordinator collects from its first group.
No group is trained twice: the gateway drops every group it handed to a coordinator before,
so the groups pending at the checkpoint are abandoned (their sessions stay recorded, never
trained; steps that trained them after the checkpoint are undone with the trainer's
weights), as dispatch abandons the partial rollouts of the groups it starts again. A gateway
that outlived the coordinator keeps the groups it handed to none, open or complete, for the
resumed run (enrolment.py's `reopen`); a restarted one starts with none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from lockgate.agent_runtime import RolloutResult
from lockgate.coordinator.loop.sources import GroupSink
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.api.session_keys import new_enrolment_key
from lockgate.gateway.client import GatewayClient
from lockgate.gateway.schema import CompleteGroup, SessionInfo

log = logging.getLogger(__name__)

# How long one request for complete groups waits at the gateway before asking again.
COLLECT_WAIT_S = 10.0
# What a refused client is told to wait before asking again: the gate opens at a weight sync.
RETRY_AFTER_S = 2.0


class EnrolmentFile(BaseModel):
    """RUN_DIR/enrolment.json: what a client needs to enrol sessions in the run."""

    url: str = Field(description="The gateway's base URL: POST {url}/v1/sessions.")
    key: str = Field(description="The enrolment key, as `Authorization: Bearer <key>`.")
    group_size: int = Field(description="Sessions per group (the run's loop.group_size).")


def write_enrolment_file(path: Path, enrolment: EnrolmentFile) -> None:
    """Readable by its owner only: the key lets anyone who has it add sessions to the run."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(enrolment.model_dump(), indent=2) + "\n")


def _rollout(info: SessionInfo, group: CompleteGroup) -> RolloutResult:
    error = info.error
    if info.status == "finished" and info.reward is None:
        error = "no_reward: finished without a reward"
    return RolloutResult(
        session_id=info.session_id,
        task_id=group.task_id,
        group_id=group.group_id,
        status=info.status if info.status != "open" else "failed",
        reward=info.reward,
        error=error,
        duration_s=(info.finished_at or info.created_at) - info.created_at,
        num_calls=info.num_calls,
    )


class ClientSource:
    """Groups that clients start and finish, collected from the gateway's enrolment."""

    def __init__(
        self,
        gateway: GatewayClient,
        key: str,
        group_size: int,
        *,
        timeout_s: float | None = None,
        wait_s: float = COLLECT_WAIT_S,
        retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        self.gateway = gateway
        self.key = key
        self.group_size = group_size
        self.wait_s = wait_s
        self.retry_after_s = retry_after_s
        self.timeout_s = timeout_s
        self._admitted = 0

    @staticmethod
    def admitted(sink: GroupSink) -> int:
        """How many groups the gateway may have started through the enrolment now."""
        return max(0, sink.controller.capacity(sink.version) - sink.controller.groups_started)

    async def run(self, sink: GroupSink) -> None:
        self._admitted = self.admitted(sink)
        await self.gateway.open_enrolment(
            self.key, self.group_size, self._admitted, self.retry_after_s, self.timeout_s
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._admit(sink), name="enrolment-admit")
            tg.create_task(self._collect(sink), name="enrolment-collect")

    async def _admit(self, sink: GroupSink) -> None:
        """Raise the gateway's bound whenever the gate admits more (a sync, a freed slot)."""
        while True:
            async with sink.version_changed:
                await sink.version_changed.wait_for(lambda: self.admitted(sink) > self._admitted)
                target = self.admitted(sink)
            await self.gateway.admit_groups(target)
            self._admitted = target

    async def _collect(self, sink: GroupSink) -> None:
        seq = 0
        while True:
            answer = await self.gateway.complete_groups(seq, self.wait_s)
            for group in answer.groups:
                seq = group.seq
                await self._take(sink, group)

    async def _take(self, sink: GroupSink, complete: CompleteGroup) -> None:
        serial = sink.next_serial
        sink.started(serial)
        infos = await asyncio.gather(*(self.gateway.session(s) for s in complete.sessions))
        results = [_rollout(info, complete) for info in infos]
        group = await sink.collect(complete.task_id, complete.group_id, complete.version, results)
        group.serial = serial
        await sink.offer(group)


def _previous_key(path: Path) -> str | None:
    """The key of the run dir's enrolment file; None when there is no usable one."""
    try:
        return EnrolmentFile.model_validate_json(path.read_bytes()).key
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        log.warning("%s is unreadable (%s): the run gets a new enrolment key", path, exc)
        return None


def enrol_clients(
    gateway: GatewayClient,
    run_dir: Path,
    group_size: int,
    timeout_s: float | None = None,
    *,
    url: str | None = None,
    resume: bool = False,
) -> tuple[ClientSource, EnrolmentFile]:
    """The enrolment key (a fresh one; with `resume`, the run's own from its enrolment file,
    so that its clients go on), written to the run dir for clients with the gateway's `url` as
    they reach it (default: the coordinator's), and the source that opens the enrolment with it
    when the loop starts (groups incomplete after `timeout_s` closed)."""
    path = RunDir(run_dir).enrolment
    key = (_previous_key(path) if resume else None) or new_enrolment_key()
    enrolment = EnrolmentFile(url=url or gateway.base_url, key=key, group_size=group_size)
    write_enrolment_file(path, enrolment)
    source = ClientSource(gateway, enrolment.key, group_size, timeout_s=timeout_s)
    return source, enrolment
