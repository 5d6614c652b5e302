"""Client-driven rollouts: the run's enrolment, as bookkeeping (no HTTP).

Clients hold the run's enrolment key, which creates sessions and nothing else; each session
joins a GRPO group by (task id, group id). A group is complete once `group_size` sessions were
created in it and all of them ended (finished or failed); the coordinator collects complete
groups in the order they completed and trains on them.

The staleness bound holds for clients as for the coordinator's own dispatch: the coordinator
decides how many groups may have started (`groups_admitted`, raised after every weight sync and
whenever a group is dropped), and a session that would start a group past it is refused with
a 429 and `Retry-After`. Joining a group that already started is always admitted: its slot is
taken. The gateway only counts; the rule stays the coordinator's.

A client that dies must not hold its group, and with it a slot, forever: a group still
incomplete `timeout_s` after its first session is closed (no session joins it any more), its
sessions still open are failed by the caller of `expired` (the routes, each time the
coordinator collects), and it completes with the members it has; the loop's `min_group_size`
decides whether it is trained on. A group id that completed is never opened again.

A coordinator that restarts (`lockgate train --resume`) against a gateway that did not opens
the enrolment again with the same key (`reopen`): the groups it was handed before are
forgotten, so none is collected and trained twice, while the groups no coordinator was handed
yet stay, open or complete, so the clients' work since the kill is not lost.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from lockgate.gateway.api.session_keys import key_digest
from lockgate.gateway.errors import GatewayError, conflict
from lockgate.gateway.schema import CompleteGroup, EnrolmentGroup, OpenEnrolment


class RetryLater(GatewayError):
    """A refusal that passes: answered with `Retry-After: retry_after_s`."""

    def __init__(self, status_code: int, message: str, code: str, retry_after_s: float) -> None:
        super().__init__(status_code, message, type="requests", code=code)
        self.retry_after_s = retry_after_s


def groups_full(message: str, retry_after_s: float) -> RetryLater:
    """A new group past the coordinator's bound."""
    return RetryLater(429, message, "groups_full", retry_after_s)


@dataclass
class _Group:
    task_id: str
    version: int
    started_at: float
    sessions: list[str] = field(default_factory=list)
    ended: set[str] = field(default_factory=set)
    reserved: int = 0  # admitted, session not created yet
    expired: bool = False  # past its time limit: closed to new sessions

    def done(self, group_size: int) -> bool:
        """Every member ended: all `group_size` of them, or the ones it had when it expired."""
        full = len(self.sessions) == group_size or (self.expired and not self.reserved)
        return full and len(self.ended) == len(self.sessions)


@dataclass(frozen=True)
class Admission:
    """A place in a group, held from admission until its session exists (or is given back)."""

    group_id: str
    members: int
    needed: int


class Enrolment:
    def __init__(self, body: OpenEnrolment, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.timeout_s = body.timeout_s
        self.key_digest = key_digest(body.key)
        self.group_size = body.group_size
        self.groups_admitted = body.groups_admitted
        self.retry_after_s = body.retry_after_s
        self.groups_started = 0
        self._groups: dict[str, _Group] = {}
        self._of_session: dict[str, str] = {}
        self._complete: list[CompleteGroup] = []
        self._closed: set[str] = set()  # completed group ids
        self._completed = asyncio.Event()
        self._handed = 0  # the last seq answered to a collecting coordinator

    def reopen(self, body: OpenEnrolment) -> None:
        """Open again for a coordinator that restarted with the same key and group size.

        Counts start over, as for a new enrolment, except for the groups no coordinator was
        handed: the open ones (clients are running them) and the ones completed since the last
        collection, numbered again from 1; each holds its slot. The groups handed over before
        are dropped: the coordinator's checkpoint holds those it trained, and the rest were
        abandoned with the steps after it.
        """
        assert self.is_key(body.key) and body.group_size == self.group_size
        self.timeout_s = body.timeout_s
        self.groups_admitted = body.groups_admitted
        self.retry_after_s = body.retry_after_s
        unhanded = [g for g in self._complete if g.seq > self._handed]
        self._complete = [g.model_copy(update={"seq": i}) for i, g in enumerate(unhanded, 1)]
        self._handed = 0
        self.groups_started = len(self._groups) + len(self._complete)

    def is_key(self, key: str | None) -> bool:
        return key is not None and hmac.compare_digest(key_digest(key), self.key_digest)

    def admit(self, task_id: str, group_id: str | None, version: int) -> Admission:
        """A place for one session of `task_id` in `group_id` (None: a group of that task with
        room, else a new one). A new group must fit under the bound (429 when not); a full
        group or one of another task is a 409."""
        if group_id is None:
            group_id = self._open_group_of(task_id) or f"{task_id}-{uuid.uuid4().hex[:12]}"
        group = self._groups.get(group_id)
        if group_id in self._closed or (group is not None and group.expired):
            raise conflict(f"group '{group_id}' is closed: it completed or timed out")
        if group is None:
            if self.groups_started >= self.groups_admitted:
                raise groups_full(
                    f"no new group now: {self.groups_started} of the {self.groups_admitted} "
                    "groups the staleness bound admits have started; join an open group or "
                    f"retry after {self.retry_after_s:g} s",
                    self.retry_after_s,
                )
            group = self._groups[group_id] = _Group(task_id, version, self.clock())
            self.groups_started += 1
        elif group.task_id != task_id:
            raise conflict(f"group '{group_id}' is of task '{group.task_id}', not '{task_id}'")
        members = len(group.sessions) + group.reserved
        if members >= self.group_size:
            raise conflict(f"group '{group_id}' is full ({self.group_size} sessions)")
        group.reserved += 1
        return Admission(group_id, members + 1, self.group_size - members - 1)

    def created(self, admission: Admission, session_id: str) -> None:
        group = self._groups[admission.group_id]
        group.reserved -= 1
        group.sessions.append(session_id)
        self._of_session[session_id] = admission.group_id

    def give_back(self, admission: Admission) -> None:
        """The session of `admission` could not be created: its place is free again."""
        self._groups[admission.group_id].reserved -= 1
        self._maybe_complete(admission.group_id)

    def ended(self, session_id: str) -> None:
        """A session finished or failed; its group completes with the last of its members."""
        group_id = self._of_session.get(session_id)
        if group_id is None:
            # Not an enrolled session (one the admin API or `session new` made), or one of a
            # group that completed: the admin API may finish a session again, and a group
            # completes once.
            return
        self._groups[group_id].ended.add(session_id)
        self._maybe_complete(group_id)

    def expired(self) -> list[str]:
        """Close the groups past their time limit; their sessions still open, for the caller to
        fail (each then ends here like any other)."""
        if self.timeout_s is None:
            return []
        now, open_sessions = self.clock(), []
        for group_id, group in list(self._groups.items()):
            if group.started_at + self.timeout_s <= now:
                group.expired = True
                open_sessions += [s for s in group.sessions if s not in group.ended]
                self._maybe_complete(group_id)
        return open_sessions

    def _maybe_complete(self, group_id: str) -> None:
        group = self._groups.get(group_id)
        if group is not None and group.done(self.group_size):
            self._complete.append(
                CompleteGroup(
                    seq=len(self._complete) + 1,
                    task_id=group.task_id,
                    group_id=group_id,
                    version=group.version,
                    sessions=list(group.sessions),
                )
            )
            del self._groups[group_id]
            for session_id in group.sessions:
                del self._of_session[session_id]
            self._closed.add(group_id)
            self._completed.set()

    def complete_after(self, seq: int) -> list[CompleteGroup]:
        return self._complete[max(seq, 0) :]

    async def wait_complete_after(self, seq: int, timeout_s: float) -> list[CompleteGroup]:
        """The groups completed after `seq`, waiting up to `timeout_s` for one when none has."""
        try:
            async with asyncio.timeout(timeout_s):
                while not self.complete_after(seq):
                    self._completed.clear()
                    await self._completed.wait()
        except TimeoutError:
            pass
        groups = self.complete_after(seq)
        if groups:
            self._handed = max(self._handed, groups[-1].seq)
        return groups

    def open_groups(self) -> list[EnrolmentGroup]:
        return [
            EnrolmentGroup(
                task_id=g.task_id,
                group_id=group_id,
                members=len(g.sessions) + g.reserved,
                needed=self.group_size - len(g.sessions) - g.reserved,
                ended=len(g.ended),
            )
            for group_id, g in self._groups.items()
        ]

    def _open_group_of(self, task_id: str) -> str | None:
        for group_id, group in self._groups.items():
            room = len(group.sessions) + group.reserved < self.group_size
            if group.task_id == task_id and room and not group.expired:
                return group_id
        return None
