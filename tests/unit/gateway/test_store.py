"""The trajectory store on a real SQLite file: lone and group commits, failures, checkpoints."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

from lockgate.gateway.schema import CallRecord, VersionSpan
from lockgate.gateway.store.thread import StoreThread
from lockgate.gateway.store.trajectories import TrajectoryStore


def _call(session: str, index: int, n: int = 64) -> CallRecord:
    return CallRecord(
        session_id=session,
        index=index,
        request={"messages": [{"role": "user", "content": "x" * 200}]},
        sampling={"temperature": 1.0},
        prompt_ids=list(range(300)),
        completion_ids=list(range(n)),
        logprobs=[-0.1 * i for i in range(n)],
        versions=[VersionSpan(version=0, start=0, end=n)],
        finish_reason="length",
        replica="r",
        started_at=0.0,
        ended_at=1.0,
        extends_previous=index > 0,
    )


def _committed_calls(path: Path) -> int:
    """Calls another connection sees: what is committed, whatever this process still holds."""
    with sqlite3.connect(path) as other:
        return int(other.execute("SELECT COUNT(*) FROM calls").fetchone()[0])


async def _sessions(store: TrajectoryStore, n: int) -> None:
    for i in range(n):
        await store.create_session(f"s{i}", f"k{i}", "t", None, {})


def test_a_lone_call_is_committed_when_add_call_returns(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite"

    async def run() -> None:
        store = TrajectoryStore(path)
        await _sessions(store, 1)
        for index in range(3):
            await store.add_call(_call("s0", index))
            assert _committed_calls(path) == index + 1
        info = await store.get_session("s0")
        assert info is not None and info.num_calls == 3
        assert [c.logprobs for c in await store.get_calls("s0")] == [_call("s0", 0).logprobs] * 3
        store.close()

    asyncio.run(run())


def test_concurrent_calls_group_commit_and_a_bad_record_fails_only_its_own_call(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.sqlite"

    async def run() -> None:
        store = TrajectoryStore(path)
        await _sessions(store, 40)
        await store.add_call(_call("s0", 0))
        calls = [_call(f"s{i}", 1 if i == 0 else 0) for i in range(40)]
        calls.append(_call("s0", 0))  # a duplicate index: a constraint violation
        results = await asyncio.gather(*(store.add_call(c) for c in calls), return_exceptions=True)
        assert all(r is None for r in results[:-1])
        assert isinstance(results[-1], sqlite3.IntegrityError)
        assert _committed_calls(path) == 41
        store.close()

    asyncio.run(run())


def test_the_store_thread_runs_jobs_in_order_and_hands_back_results_and_errors() -> None:
    thread = StoreThread("test-store")
    seen: list[int] = []

    def fail() -> None:
        raise KeyError("boom")

    async def run() -> None:
        results = await asyncio.gather(
            *(thread.run(lambda i=i: seen.append(i) or i * i) for i in range(50))
        )
        assert results == [i * i for i in range(50)] and seen == list(range(50))
        try:
            await thread.run(fail)
        except KeyError as exc:
            assert exc.args == ("boom",)
        else:
            raise AssertionError("expected the job's KeyError")
        # A waiter cancelled mid-job: the job still runs, nothing breaks after it.
        slow = asyncio.ensure_future(thread.run(lambda: time.sleep(0.05) or seen.append(-1)))
        await asyncio.sleep(0.01)
        slow.cancel()
        assert await thread.run(lambda: seen[-1]) == -1

    asyncio.run(run())
    assert thread.call(lambda: 7) == 7
    thread.stop()


def test_a_hung_up_waiter_still_gets_its_call_written_and_flush_waits_for_every_call(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.sqlite"

    async def run() -> None:
        store = TrajectoryStore(path)
        await _sessions(store, 10)
        # A slow job ahead on the store's thread: the first call's commit waits behind it and
        # the other nine queue up for the commit after.
        slow = asyncio.ensure_future(store._thread.run(lambda: time.sleep(0.2)))
        waiters = [asyncio.ensure_future(store.add_call(_call(f"s{i}", 0))) for i in range(10)]
        await asyncio.sleep(0.05)
        for waiter in waiters[:5]:  # the first in the commit under way, four still queued
            waiter.cancel()
        await store.flush()
        assert _committed_calls(path) == 10
        assert all(w.cancelled() for w in waiters[:5])
        assert await asyncio.gather(*waiters[5:]) == [None] * 5
        await slow
        await store.add_call(_call("s0", 1))  # the store goes on as before
        assert _committed_calls(path) == 11
        store.close()

    asyncio.run(run())
