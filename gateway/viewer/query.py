"""Reading the trajectory store for the viewer: pure functions of an open SQLite connection.

- `list_sessions`: a filtered page of sessions, newest first, with keyset paging on the
  sessions table's rowid (insertion order): a page costs the same at row 10 and at row 100k.
- `session_detail`: one session as the model saw it, call by call: the prompt tokens each call
  added (the whole prompt where a re-render split began a new sample), the sampled tokens with
  their logprobs, versions and loss mask, where a weight sync cut them, the messages and tool
  results the agent sent, and the group's rewards and advantages.
- `changes_since`: what was added or finished since a cursor, for the live feed.

The viewer reads on its own read-only connection (routes.py); these functions never write.
What the run trains on comes from the store's pure parts (gateway/records), which the viewer
shares with the store and the coordinator rather than copying: the row layout, how calls merge
into samples, and the advantages under the run's `AdvantageSpec` over the rollouts the
coordinator counts. Rollouts the coordinator dropped afterwards as too stale are not in the
store, so they still count in a group's advantages here.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lockgate.gateway.records.advantages import AdvantageSpec, member_advantages
from lockgate.gateway.records.codecs import (
    CALL_COLUMNS,
    call_from_row,
    token_versions,
    unpack_spans,
    version_marker,
)
from lockgate.gateway.records.merge import Placement, SampleMerger
from lockgate.gateway.schema import CallRecord

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
# Rows the live feed returns at most per poll; past this the client reloads its page.
MAX_CHANGES = 500

TextsOf = Callable[[Iterable[int]], dict[int, str]]  # token id -> its text


class SessionFilter(BaseModel):
    """What the sessions list is narrowed to; every field left out matches everything."""

    model_config = ConfigDict(extra="forbid")
    task: str | None = None
    group: str | None = None
    status: Literal["open", "finished", "failed"] | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    version: int | None = Field(
        default=None, ge=0, description="Sessions with a token sampled under this version."
    )
    interrupted: bool | None = Field(
        default=None, description="Sessions with (True) or without (False) a call cut by a sync."
    )
    splits: bool | None = Field(
        default=None, description="Sessions with (True) or without (False) a re-render split."
    )


class SessionSummary(BaseModel):
    """A session as the list shows it: its row and what its calls add up to."""

    id: str
    task_id: str
    group_id: str | None
    status: str
    reward: float | None
    error: str | None
    created_at: float
    finished_at: float | None
    num_calls: int
    rerender_splits: int
    interruptions: int  # summed over the session's calls
    # The weight version of the session's first sampled token and of its last (versions only
    # grow during a session); None before its first call.
    first_version: int | None
    last_version: int | None


class SessionPage(BaseModel):
    sessions: list[SessionSummary]
    next_cursor: str | None  # pass as `cursor` for the next (older) page; None at the end


class Message(BaseModel):
    """A message the agent sent in a call that the previous call had not (a tool result, say)."""

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class CallView(BaseModel):
    index: int
    finish_reason: str
    replica: str
    started_at: float
    ended_at: float
    interruptions: int
    extends_previous: bool
    constrained: bool
    sampling: dict[str, Any]
    tools: list[str]  # names of the tools the call offered
    messages: list[Message]  # messages new in this call's request
    new_sample: bool  # this call began a training sample (the first, or after a split)
    split: bool  # it did not extend the previous sample's tokens: a re-render split
    trained: bool  # its sampled tokens are in a sample (an interrupted call's are not)
    prompt_total: int  # tokens in the call's whole prompt
    prompt_ids: list[int]  # the prompt tokens this call added (the whole prompt on a new sample)
    completion_ids: list[int]
    logprobs: list[float]  # one per completion token
    versions: list[int]  # weight version of each completion token (-1: unknown)
    loss_mask: list[int]  # one per completion token: 1 where it is trained on
    cuts: list[int]  # completion positions where the weight version changes (a sync cut)


class GroupMember(BaseModel):
    id: str
    status: str
    reward: float | None
    # Under the run's AdvantageSpec, over the members that finished with a reward (the
    # rollouts the coordinator counts); None for the others.
    advantage: float | None


class SessionDetail(BaseModel):
    session: SessionSummary
    metadata: dict[str, Any]
    group: list[GroupMember]
    advantages: AdvantageSpec  # how the group's advantages are computed: the run's own
    calls: list[CallView]
    samples: int
    tokens: dict[int, str]  # text of every token id shown (empty without a tokenizer)


class Cursor(BaseModel):
    """How far the live feed has read: the newest session and call rowids, the latest finish."""

    sessions: int = 0
    calls: int = 0
    finished_at: float = 0.0

    def encode(self) -> str:
        return f"{self.sessions}_{self.calls}_{self.finished_at!r}"

    @classmethod
    def decode(cls, text: str) -> Cursor:
        try:
            sessions, calls, finished = text.split("_")
            return cls(sessions=int(sessions), calls=int(calls), finished_at=float(finished))
        except ValueError as exc:
            raise ValueError(f"not a live-feed cursor: {text!r}") from exc


class Changes(BaseModel):
    cursor: str
    changed: list[str]  # ids of every session added, called or finished since the cursor
    sessions: list[SessionSummary]  # of those, the ones the filter matches, newest first
    truncated: bool  # more changed than MAX_CHANGES: reload the page instead


class Overview(BaseModel):
    sessions: int
    calls: int
    by_status: dict[str, int]
    tasks: list[str]  # up to 500, for the filter's suggestions
    cursor: str  # the live feed starts here


# ---------------------------------------------------------------------------------------------
# The sessions list

_ROW_COLUMNS = (
    "s.rowid, s.id, s.task_id, s.group_id, s.status, s.reward, s.error, s.created_at,"
    " s.finished_at, s.num_calls, s.rerender_splits"
)


def _where(f: SessionFilter) -> tuple[list[str], list[Any]]:
    conds: list[str] = []
    params: list[Any] = []
    for column, value in (("task_id", f.task), ("group_id", f.group), ("status", f.status)):
        if value is not None:
            conds.append(f"s.{column} = ?")
            params.append(value)
    if f.reward_min is not None:
        conds.append("s.reward >= ?")
        params.append(f.reward_min)
    if f.reward_max is not None:
        conds.append("s.reward <= ?")
        params.append(f.reward_max)
    if f.splits is not None:
        conds.append("s.rerender_splits > 0" if f.splits else "s.rerender_splits = 0")
    if f.interrupted is not None:
        # The store's partial index `calls_interrupted` answers this without reading calls.
        exists = "EXISTS (SELECT 1 FROM calls c WHERE c.session_id = s.id AND c.interruptions > 0)"
        conds.append(exists if f.interrupted else f"NOT {exists}")
    if f.version is not None:
        # A substring test on the packed spans skips parsing every call's JSON.
        conds.append(
            "EXISTS (SELECT 1 FROM calls c WHERE c.session_id = s.id AND instr(c.versions, ?) > 0)"
        )
        params.append(version_marker(f.version))
    return conds, params


def list_sessions(
    conn: sqlite3.Connection,
    filters: SessionFilter,
    cursor: str | None = None,
    limit: int = DEFAULT_LIMIT,
) -> SessionPage:
    """Sessions matching `filters`, newest first, `limit` at most, older than `cursor`."""
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
    conds, params = _where(filters)
    if cursor is not None:
        try:
            before = int(cursor)
        except ValueError as exc:
            raise ValueError(f"not a page cursor: {cursor!r}") from exc
        conds.append("s.rowid < ?")
        params.append(before)
    where = f"WHERE {' AND '.join(conds)}" if conds else ""
    rows = conn.execute(
        f"SELECT {_ROW_COLUMNS} FROM sessions s {where} ORDER BY s.rowid DESC LIMIT ?",
        [*params, limit + 1],
    ).fetchall()
    more = len(rows) > limit
    rows = rows[:limit]
    return SessionPage(
        sessions=_with_call_stats(conn, rows),
        next_cursor=str(rows[-1][0]) if more else None,
    )


def _rows_by_id(
    conn: sqlite3.Connection, ids: Sequence[str], filters: SessionFilter | None = None
) -> list[SessionSummary]:
    if not ids:
        return []
    conds, params = _where(filters or SessionFilter())
    conds.append(f"s.id IN ({','.join('?' * len(ids))})")
    rows = conn.execute(
        f"SELECT {_ROW_COLUMNS} FROM sessions s WHERE {' AND '.join(conds)} ORDER BY s.rowid DESC",
        [*params, *ids],
    ).fetchall()
    return _with_call_stats(conn, rows)


def _with_call_stats(
    conn: sqlite3.Connection, rows: Sequence[tuple[Any, ...]]
) -> list[SessionSummary]:
    """The list's rows with what only the calls hold, at a cost independent of how many calls
    a session has: its interruptions (from the partial index of interrupted calls) and the
    versions of its first and last call (two primary-key lookups)."""
    if not rows:
        return []
    ids = [row[1] for row in rows]
    interruptions = dict(
        conn.execute(
            "SELECT session_id, SUM(interruptions) FROM calls"
            f" WHERE session_id IN ({','.join('?' * len(ids))}) AND interruptions > 0"
            " GROUP BY session_id",
            ids,
        ).fetchall()
    )
    out = []
    for row in rows:
        first, last = conn.execute(
            "SELECT (SELECT versions FROM calls WHERE session_id = ?1 ORDER BY idx LIMIT 1),"
            " (SELECT versions FROM calls WHERE session_id = ?1 ORDER BY idx DESC LIMIT 1)",
            (row[1],),
        ).fetchone()
        first_spans = unpack_spans(first) if first else []
        last_spans = unpack_spans(last) if last else []
        out.append(
            SessionSummary(
                id=row[1],
                task_id=row[2],
                group_id=row[3],
                status=row[4],
                reward=row[5],
                error=row[6],
                created_at=row[7],
                finished_at=row[8],
                num_calls=row[9],
                rerender_splits=row[10],
                interruptions=interruptions.get(row[1], 0),
                first_version=first_spans[0].version if first_spans else None,
                last_version=last_spans[-1].version if last_spans else None,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# One session


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") if isinstance(part, dict) else str(part) for part in content
        )
    return json.dumps(content)


def _message(raw: Any) -> Message:
    if not isinstance(raw, dict):
        return Message(role="?", content=json.dumps(raw))
    return Message(
        role=str(raw.get("role", "?")),
        content=_text(raw.get("content")),
        name=raw.get("name"),
        tool_call_id=raw.get("tool_call_id"),
        tool_calls=[tc for tc in raw.get("tool_calls") or [] if isinstance(tc, dict)],
    )


def _new_messages(request: dict[str, Any], previous: dict[str, Any] | None) -> list[Message]:
    """The messages of `request` after those the previous call sent, its reply included when
    the agent sent it back (a continuation); all of them if the history was edited."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        prompt = request.get("prompt")  # /v1/completions
        return [Message(role="prompt", content=_text(prompt))] if prompt is not None else []
    before = previous.get("messages") if previous else None
    if isinstance(before, list) and messages[: len(before)] == before:
        messages = messages[len(before) :]
    return [_message(m) for m in messages]


def _cuts(versions: list[int]) -> list[int]:
    return [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]


def _call_view(call: CallRecord, placed: Placement, previous: dict[str, Any] | None) -> CallView:
    """One call as the model saw it, placed in its session's samples by the merging rule."""
    tools = call.request.get("tools") if isinstance(call.request.get("tools"), list) else []
    versions = token_versions(call.versions, len(call.completion_ids))
    return CallView(
        index=call.index,
        finish_reason=call.finish_reason,
        replica=call.replica,
        started_at=call.started_at,
        ended_at=call.ended_at,
        interruptions=call.interruptions,
        extends_previous=call.extends_previous,
        constrained=call.constrained,
        sampling=call.sampling,
        tools=[str((t.get("function") or {}).get("name", "?")) for t in tools],
        messages=_new_messages(call.request, previous),
        new_sample=placed.new_sample,
        split=placed.split,
        trained=placed.trained,
        prompt_total=len(call.prompt_ids),
        prompt_ids=call.prompt_ids[placed.new_from :],
        completion_ids=call.completion_ids,
        logprobs=call.logprobs,
        versions=versions,
        loss_mask=[1 if placed.trained else 0] * len(call.completion_ids),
        cuts=_cuts(versions),
    )


def _group(rows: Sequence[tuple[str, str, float | None]], spec: AdvantageSpec) -> list[GroupMember]:
    advantages = member_advantages([(status, reward) for _, status, reward in rows], spec)
    return [
        GroupMember(id=sid, status=status, reward=reward, advantage=advantage)
        for (sid, status, reward), advantage in zip(rows, advantages, strict=True)
    ]


_CALLS_OF = f"SELECT {', '.join(CALL_COLUMNS)} FROM calls WHERE session_id = ? ORDER BY idx"


def _read_session(
    conn: sqlite3.Connection, session_id: str
) -> tuple[SessionSummary, str, list[CallRecord], list[tuple[str, str, float | None]]] | None:
    """A session's summary, metadata (JSON), calls and its group's (id, status, reward), read
    in one snapshot so that they agree; None for an unknown session."""
    conn.execute("BEGIN")
    try:
        row = conn.execute(
            f"SELECT {_ROW_COLUMNS}, s.metadata FROM sessions s WHERE s.id = ?", (session_id,)
        ).fetchone()
        if row is None:
            return None
        calls = [call_from_row(r) for r in conn.execute(_CALLS_OF, (session_id,))]
        group_rows = (
            conn.execute(
                "SELECT id, status, reward FROM sessions WHERE group_id = ? ORDER BY rowid",
                (row[3],),
            ).fetchall()
            if row[3] is not None
            else [(row[1], row[4], row[5])]
        )
        (session,) = _with_call_stats(conn, [row[:-1]])
        return session, row[-1], calls, group_rows
    finally:
        conn.execute("COMMIT")


def session_detail(
    conn: sqlite3.Connection,
    session_id: str,
    texts: TextsOf | None = None,
    advantages: AdvantageSpec | None = None,
) -> SessionDetail | None:
    """One session call by call, and its group's advantages under `advantages` (the run's;
    None: GRPO, what a gateway outside a training run shows)."""
    read = _read_session(conn, session_id)
    if read is None:
        return None
    session, metadata, records, group_rows = read
    merger = SampleMerger()  # the rule the coordinator's samples come from
    calls: list[CallView] = []
    previous: dict[str, Any] | None = None
    for call in records:
        calls.append(_call_view(call, merger.add(call), previous))
        previous = call.request
    spec = advantages or AdvantageSpec()
    shown_ids = {t for c in calls for ids in (c.prompt_ids, c.completion_ids) for t in ids}
    return SessionDetail(
        session=session,
        metadata=json.loads(metadata),
        group=_group(group_rows, spec),
        advantages=spec,
        calls=calls,
        samples=len(merger.samples),
        tokens=texts(shown_ids) if texts is not None else {},
    )


# ---------------------------------------------------------------------------------------------
# Live feed and overview


def head_cursor(conn: sqlite3.Connection) -> Cursor:
    """The cursor at the store's current end: a feed started here reports only what is new."""
    s, c, f = conn.execute(
        "SELECT (SELECT max(rowid) FROM sessions), (SELECT max(rowid) FROM calls),"
        " (SELECT max(finished_at) FROM sessions)"
    ).fetchone()
    return Cursor(sessions=s or 0, calls=c or 0, finished_at=f or 0.0)


def changes_since(
    conn: sqlite3.Connection, cursor: Cursor, filters: SessionFilter | None = None
) -> Changes:
    """Sessions created, called or finished after `cursor`, and the cursor to ask with next.

    Each part reads by rowid or by the `sessions_finished` index, so a poll costs what changed,
    not what the store holds.
    """
    conn.execute("BEGIN")  # one snapshot: the new cursor covers exactly what is reported
    try:
        head = head_cursor(conn)
        changed: dict[str, None] = {}
        for (sid,) in conn.execute(
            "SELECT id FROM sessions WHERE rowid > ? ORDER BY rowid LIMIT ?",
            (cursor.sessions, MAX_CHANGES + 1),
        ):
            changed[sid] = None
        for (sid,) in conn.execute(
            "SELECT DISTINCT session_id FROM calls WHERE rowid > ? AND rowid <= ? LIMIT ?",
            (cursor.calls, head.calls, MAX_CHANGES + 1),
        ):
            changed[sid] = None
        for (sid,) in conn.execute(
            "SELECT id FROM sessions WHERE finished_at > ? LIMIT ?",
            (cursor.finished_at, MAX_CHANGES + 1),
        ):
            changed[sid] = None
        truncated = len(changed) > MAX_CHANGES
        ids = list(changed)[:MAX_CHANGES]
        rows = _rows_by_id(conn, ids, filters)
    finally:
        conn.execute("COMMIT")
    return Changes(
        cursor=head.encode(),
        changed=ids,
        sessions=rows,
        truncated=truncated,
    )


def overview(conn: sqlite3.Connection) -> Overview:
    conn.execute("BEGIN")
    try:
        by_status = dict(
            conn.execute("SELECT status, COUNT(*) FROM sessions GROUP BY status").fetchall()
        )
        tasks = [
            r[0]
            for r in conn.execute(
                "SELECT DISTINCT task_id FROM sessions ORDER BY task_id LIMIT 500"
            )
        ]
        head = head_cursor(conn)
    finally:
        conn.execute("COMMIT")
    return Overview(
        sessions=sum(by_status.values()),
        calls=head.calls,  # rowids: calls are never deleted, so the newest rowid is the count
        by_status=by_status,
        tasks=tasks,
        cursor=head.encode(),
    )
