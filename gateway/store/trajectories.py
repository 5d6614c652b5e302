"""The trajectory store: sessions and calls in one SQLite file.

All access goes through one connection owned by one thread (`thread.py`), so SQLite never sees
concurrent writers and the event loop never blocks on disk. A call's record is committed before
the gateway answers the agent (WAL mode, `synchronous=NORMAL`: durable across a crash of the
gateway process; `synchronous=FULL` would also survive power loss at a latency cost).

Calls are group-committed: the records of calls that end while a commit is running are written
together in the next transaction, and each `add_call` returns only once the transaction holding
its record has committed. Nothing waits on purpose to fill a batch, so a lone call pays one
commit, and under load a call waits at most for the commit in progress plus its own (the
window is bounded by two commits; a batch holds at most `MAX_BATCH` records). Nothing of a call
stays in memory once it is written.

A call's row is laid out by `records/codecs.py` (token ids and logprobs as packed arrays, not
JSON), which the viewer reads the same file with.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lockgate.gateway.records.codecs import CALL_COLUMNS, call_from_row, call_to_row
from lockgate.gateway.schema import CallRecord, SessionInfo
from lockgate.gateway.store.thread import StoreThread

T = TypeVar("T")

# Records per transaction at most: bounds how long one commit holds the store's thread.
MAX_BATCH = 512

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    api_key TEXT NOT NULL UNIQUE,  -- the key's SHA-256 (session_keys.py); plain in old stores
    task_id TEXT NOT NULL,
    group_id TEXT,
    metadata TEXT NOT NULL,
    status TEXT NOT NULL,
    reward REAL,
    error TEXT,
    created_at REAL NOT NULL,
    finished_at REAL,
    num_calls INTEGER NOT NULL DEFAULT 0,
    rerender_splits INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS calls (
    session_id TEXT NOT NULL REFERENCES sessions(id),
    idx INTEGER NOT NULL,
    request TEXT NOT NULL,
    sampling TEXT NOT NULL,
    prompt_ids BLOB NOT NULL,
    completion_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    versions TEXT NOT NULL,
    finish_reason TEXT NOT NULL,
    replica TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL NOT NULL,
    interruptions INTEGER NOT NULL,
    extends_previous INTEGER NOT NULL,
    PRIMARY KEY (session_id, idx)
);
-- For the viewer (gateway/viewer/query.py): filters by task and group, the live feed's
-- finished sessions, "was any call of this session interrupted" (a partial index: interrupted
-- calls only), and "did this session sample under version v", answered from `calls_versions`
-- without reading the calls' token blobs (a full scan of 100k calls: ~20 ms, against 0.2 s
-- warm and seconds cold through the table). None is on a column the per-call session update
-- writes; `calls_versions` is the one entry a call's commit adds (~5 us of the store thread's
-- CPU per call, measured). IF NOT EXISTS: an older store gains them when the gateway opens it
-- (once; ~3-10 s for 100k calls, mostly `calls_versions`).
CREATE INDEX IF NOT EXISTS sessions_task ON sessions(task_id);
CREATE INDEX IF NOT EXISTS sessions_group ON sessions(group_id);
CREATE INDEX IF NOT EXISTS sessions_finished ON sessions(finished_at);
CREATE INDEX IF NOT EXISTS calls_interrupted ON calls(session_id) WHERE interruptions > 0;
CREATE INDEX IF NOT EXISTS calls_versions ON calls(session_id, versions);
"""
# A call's row in the order records/codecs.py lays it out (`CALL_COLUMNS`, the table's order).
_CALL_COLUMNS = ", ".join(CALL_COLUMNS)
_INSERT_CALL = f"INSERT INTO calls ({_CALL_COLUMNS}) VALUES ({', '.join('?' * len(CALL_COLUMNS))})"


class SessionRow:
    """The few session fields the request path needs, cached in memory by the app."""

    __slots__ = ("id", "key_digest", "status")

    def __init__(self, id: str, key_digest: str, status: str) -> None:
        self.id = id
        self.key_digest = key_digest
        self.status = status


class TrajectoryStore:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = StoreThread("lockgate-store")
        self._conn: sqlite3.Connection | None = None
        self._thread.call(self._open)
        # Calls waiting for the next group commit; set while a commit is on the store's thread.
        self._pending: list[tuple[CallRecord, asyncio.Future[None]]] = []
        self._committing: asyncio.Future[None] | None = None

    def _open(self) -> None:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.executescript(_SCHEMA)
        self._conn = conn

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await self._thread.run(lambda: self._with_conn(fn))

    def _with_conn(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        assert self._conn is not None
        return fn(self._conn)

    async def flush(self) -> None:
        """Wait until every call handed to `add_call` so far is written."""
        while self._committing is not None:
            await asyncio.shield(self._committing)

    def close(self) -> None:
        def _close() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        self._thread.call(_close)
        self._thread.stop()

    # -- sessions -------------------------------------------------------------------------------

    async def create_session(
        self,
        session_id: str,
        key_digest: str,
        task_id: str,
        group_id: str | None,
        metadata: dict[str, Any],
    ) -> None:
        def _insert(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO sessions (id, api_key, task_id, group_id, metadata, status, created_at)"
                " VALUES (?, ?, ?, ?, ?, 'open', ?)",
                (session_id, key_digest, task_id, group_id, json.dumps(metadata), time.time()),
            )

        await self._run(_insert)

    async def load_session_rows(self) -> list[SessionRow]:
        def _select(conn: sqlite3.Connection) -> list[SessionRow]:
            rows = conn.execute("SELECT id, api_key, status FROM sessions").fetchall()
            return [SessionRow(*row) for row in rows]

        return await self._run(_select)

    async def get_session(self, session_id: str) -> SessionInfo | None:
        def _select(conn: sqlite3.Connection) -> SessionInfo | None:
            row = conn.execute(
                "SELECT id, task_id, group_id, metadata, status, reward, error, created_at,"
                " finished_at, num_calls, rerender_splits FROM sessions WHERE id = ?",
                (session_id,),
            ).fetchone()
            if row is None:
                return None
            return SessionInfo(
                session_id=row[0],
                task_id=row[1],
                group_id=row[2],
                metadata=json.loads(row[3]),
                status=row[4],
                reward=row[5],
                error=row[6],
                created_at=row[7],
                finished_at=row[8],
                num_calls=row[9],
                rerender_splits=row[10],
            )

        return await self._run(_select)

    async def finish_session(
        self, session_id: str, status: str, reward: float | None, error: str | None
    ) -> None:
        def _update(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE sessions SET status = ?, reward = COALESCE(?, reward), error = ?,"
                " finished_at = ? WHERE id = ?",
                (status, reward, error, time.time(), session_id),
            )

        await self._run(_update)

    async def set_reward(self, session_id: str, reward: float) -> None:
        await self._run(
            lambda conn: conn.execute(
                "UPDATE sessions SET reward = ? WHERE id = ?", (reward, session_id)
            )
        )

    async def merge_metadata(self, session_id: str, metadata: dict[str, Any]) -> None:
        """Add keys to a session's metadata (a key given again is replaced)."""

        def merge(conn: sqlite3.Connection) -> None:
            row = conn.execute(
                "SELECT metadata FROM sessions WHERE id = ?", (session_id,)
            ).fetchone()
            if row is not None:
                merged = {**json.loads(row[0]), **metadata}
                conn.execute(
                    "UPDATE sessions SET metadata = ? WHERE id = ?",
                    (json.dumps(merged), session_id),
                )

        await self._run(merge)

    # -- calls ----------------------------------------------------------------------------------

    async def add_call(self, call: CallRecord) -> None:
        """Record a call and bump its session's counters; returns once that is committed.

        The call is written even if its waiter is cancelled (an agent that hung up): it is in
        the batch already, and only the waiting stops.
        """
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((call, done))
        if self._committing is None:
            self._commit_next()
        await done

    def _commit_next(self) -> None:
        """Hand the next batch to the store's thread; its settling hands over the one after.

        No task runs the group commit: a lone call costs one job on the thread and one
        callback on the loop, which matters when every call commits alone (one connection).
        """
        batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
        if self._committing is None:
            self._committing = asyncio.get_running_loop().create_future()
        calls = [c for c, _ in batch]
        self._thread.submit(
            lambda: self._with_conn(lambda conn: _insert_calls(conn, calls)),
            lambda errors, exc: self._committed(batch, errors, exc),
        )

    def _committed(
        self,
        batch: list[tuple[CallRecord, asyncio.Future[None]]],
        errors: list[Exception | None] | None,
        exc: BaseException | None,
    ) -> None:
        # Never lose a failure: every waiter of the batch gets it; later batches still run.
        outcomes = errors if errors is not None else [exc] * len(batch)
        for (_, done), error in zip(batch, outcomes, strict=True):
            if done.done():  # its waiter was cancelled; the record was still written
                continue
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)
        if self._pending:
            self._commit_next()
        elif self._committing is not None:
            self._committing.set_result(None)
            self._committing = None

    async def get_calls(self, session_id: str) -> list[CallRecord]:
        def _select(conn: sqlite3.Connection) -> list[CallRecord]:
            rows = conn.execute(
                f"SELECT {_CALL_COLUMNS} FROM calls WHERE session_id = ? ORDER BY idx",
                (session_id,),
            ).fetchall()
            return [call_from_row(row) for row in rows]

        return await self._run(_select)

    async def last_call(self, session_id: str) -> CallRecord | None:
        def _select(conn: sqlite3.Connection) -> CallRecord | None:
            row = conn.execute(
                f"SELECT {_CALL_COLUMNS} FROM calls WHERE session_id = ? ORDER BY idx DESC LIMIT 1",
                (session_id,),
            ).fetchone()
            return None if row is None else call_from_row(row)

        return await self._run(_select)

    async def get_call(self, session_id: str, index: int) -> CallRecord | None:
        """One call of a session by its index (a Responses API continuation reads the call its
        `previous_response_id` names)."""

        def _select(conn: sqlite3.Connection) -> CallRecord | None:
            row = conn.execute(
                f"SELECT {_CALL_COLUMNS} FROM calls WHERE session_id = ? AND idx = ?",
                (session_id, index),
            ).fetchone()
            return None if row is None else call_from_row(row)

        return await self._run(_select)


def _write_calls(conn: sqlite3.Connection, calls: list[CallRecord]) -> None:
    """Insert calls and bump their sessions' counters in one transaction."""
    conn.execute("BEGIN")
    try:
        conn.executemany(
            _INSERT_CALL,
            [call_to_row(c) for c in calls],
        )
        conn.executemany(
            "UPDATE sessions SET num_calls = num_calls + 1,"
            " rerender_splits = rerender_splits + ? WHERE id = ?",
            [(0 if c.extends_previous or c.index == 0 else 1, c.session_id) for c in calls],
        )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _insert_calls(conn: sqlite3.Connection, calls: list[CallRecord]) -> list[Exception | None]:
    """One transaction for the batch; if it fails, each call alone, so that one bad record
    (a duplicate index, say) fails only its own call. Returns each call's error, if any."""
    try:
        _write_calls(conn, calls)
        return [None] * len(calls)
    except Exception:
        if len(calls) == 1:
            raise
    errors: list[Exception | None] = []
    for call in calls:
        try:
            _write_calls(conn, [call])
            errors.append(None)
        except Exception as exc:
            errors.append(exc)
    return errors
