"""The viewer's query logic (gateway/viewer/query.py) on real SQLite files written by the
gateway's store: filters, keyset paging, a session's tokens and loss mask (checked against
the trainer's sample merging), the live feed's cursor, the indexes, the dashboard's shaping."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockgate.gateway.records.advantages import (
    AdvantageSpec,
    compute_advantages,
    member_advantages,
)
from lockgate.gateway.records.codecs import token_versions
from lockgate.gateway.records.merge import merge_calls
from lockgate.gateway.store.trajectories import TrajectoryStore
from lockgate.gateway.viewer import query
from lockgate.gateway.viewer.routes import open_read_only
from lockgate.gateway.viewer.run_metrics import MetricsFile, shape
from tests.support.viewer_fixtures import Built, build_store, call

VIEWER_INDEXES = (
    "sessions_task",
    "sessions_group",
    "sessions_finished",
    "calls_interrupted",
    "calls_versions",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_store(tmp_path_factory.mktemp("viewer-query") / "trajectories.sqlite", groups=3)


@pytest.fixture
def conn(built: Built) -> Iterator[sqlite3.Connection]:
    c = open_read_only(built.path)
    yield c
    c.close()


def _ids(conn: sqlite3.Connection, **filters: object) -> set[str]:
    page = query.list_sessions(conn, query.SessionFilter(**filters), limit=query.MAX_LIMIT)
    assert page.next_cursor is None
    return {s.id for s in page.sessions}


def test_every_filter_selects_exactly_the_matching_sessions(
    conn: sqlite3.Connection, built: Built
) -> None:
    everything = set(built.sessions)
    assert _ids(conn) == everything
    assert _ids(conn, task="arith-1") == built.ids(task="arith-1")
    assert _ids(conn, group="g-search-2-1") == built.ids(group="g-search-2-1")
    assert _ids(conn, status="open") == built.ids(status="open")
    assert _ids(conn, status="failed") == built.ids(status="failed")
    assert _ids(conn, reward_min=0.5) == {
        s for s, f in built.sessions.items() if f["reward"] is not None and f["reward"] >= 0.5
    }
    assert _ids(conn, reward_min=0.1, reward_max=0.6) == {
        s for s, f in built.sessions.items() if f["reward"] in (0.25, 0.5)
    }
    assert _ids(conn, interrupted=True) == built.ids(interrupted=True)
    assert _ids(conn, interrupted=False) == everything - built.ids(interrupted=True)
    assert _ids(conn, splits=True) == built.ids(split=True)
    assert _ids(conn, splits=False) == everything - built.ids(split=True)
    assert _ids(conn, version=1) == {s for s, f in built.sessions.items() if 1 in f["versions"]}
    assert _ids(conn, version=7) == set()
    assert _ids(conn, task="arith-1", interrupted=True, reward_min=1.0) == {
        s
        for s, f in built.sessions.items()
        if f["task"] == "arith-1" and f["interrupted"] and f["reward"] == 1.0
    }


def test_keyset_pages_cover_everything_once_newest_first(
    conn: sqlite3.Connection, built: Built
) -> None:
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        page = query.list_sessions(conn, query.SessionFilter(), cursor, limit=4)
        seen += [s.id for s in page.sessions]
        pages += 1
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert len(seen) == len(set(seen)) == len(built.sessions)
    assert pages == -(-len(built.sessions) // 4)
    order = {sid: n for n, sid in enumerate(built.sessions)}  # creation order
    assert seen == sorted(built.sessions, key=lambda s: -order[s])
    # A filtered walk pages over the matches only.
    first = query.list_sessions(conn, query.SessionFilter(task="arith-1"), limit=5)
    rest = query.list_sessions(conn, query.SessionFilter(task="arith-1"), first.next_cursor, 50)
    assert {s.id for s in first.sessions + rest.sessions} == built.ids(task="arith-1")


def test_bad_cursor_and_limit_are_refused(conn: sqlite3.Connection) -> None:
    with pytest.raises(ValueError, match="cursor"):
        query.list_sessions(conn, query.SessionFilter(), "abc")
    with pytest.raises(ValueError, match="limit"):
        query.list_sessions(conn, query.SessionFilter(), None, 0)
    with pytest.raises(ValueError, match="cursor"):
        query.Cursor.decode("1_2")


def test_list_rows_carry_call_stats(conn: sqlite3.Connection, built: Built) -> None:
    rows = {s.id: s for s in query.list_sessions(conn, query.SessionFilter(), limit=100).sessions}
    for sid, facts in built.sessions.items():
        row = rows[sid]
        assert row.num_calls == 2
        assert (row.interruptions > 0) == facts["interrupted"]
        assert (row.first_version, row.last_version) == (
            min(facts["versions"]),
            max(facts["versions"]),
        )
        assert row.rerender_splits == (1 if facts["split"] else 0)


def _loss_mask_by_sample(detail: query.SessionDetail) -> list[list[int]]:
    """The viewer's tokens, cut into samples where it says a sample starts."""
    samples: list[list[int]] = []
    for c in detail.calls:
        if not c.trained:
            continue
        if c.new_sample:
            samples.append([])
        samples[-1] += [0] * len(c.prompt_ids) + c.loss_mask
    return samples


def test_session_view_agrees_with_the_trainers_samples(
    conn: sqlite3.Connection, built: Built
) -> None:
    async def calls_of(sid: str) -> list:
        store = TrajectoryStore(built.path)
        try:
            return await store.get_calls(sid)
        finally:
            store.close()

    for sid, facts in built.sessions.items():
        detail = query.session_detail(conn, sid)
        assert detail is not None
        records = asyncio.run(calls_of(sid))
        samples, splits = merge_calls(records)
        assert detail.samples == len(samples)
        assert sum(c.split for c in detail.calls) == splits == (1 if facts["split"] else 0)
        assert _loss_mask_by_sample(detail) == [s.loss_mask for s in samples]
        # Tokens shown per sample are exactly the sample's input ids.
        shown: list[list[int]] = []
        for c in detail.calls:
            if c.trained:
                if c.new_sample:
                    shown.append([])
                shown[-1] += c.prompt_ids + c.completion_ids
        assert shown == [s.input_ids for s in samples]
        for c, rec in zip(detail.calls, records, strict=True):
            assert c.logprobs == rec.logprobs  # float64, bit-exact
            assert c.versions == token_versions(rec.versions, len(rec.completion_ids))
            assert c.prompt_total == len(rec.prompt_ids)
        cut_call = detail.calls[1]
        assert cut_call.cuts == ([4] if facts["kind"] == "cut" else [])
        assert [m.role for m in cut_call.messages] == ["assistant", "tool"]
        assert cut_call.messages[0].tool_calls[0]["function"]["name"] == "search"
        assert cut_call.messages[1].content == "51"
        assert cut_call.tools == ["search"]
        if facts["kind"] == "interrupted":
            assert cut_call.loss_mask == [0, 0, 0] and not cut_call.trained


def test_group_advantages_match_the_coordinators(conn: sqlite3.Connection, built: Built) -> None:
    sid = next(iter(built.ids(group="g-arith-1-0")))
    detail = query.session_detail(conn, sid)
    assert detail is not None
    rewards = [g.reward for g in detail.group]
    assert sorted(rewards) == [0.0, 0.5, 1.0, 1.0]
    # Outside a training run (no spec given): GRPO.
    assert detail.advantages == AdvantageSpec()
    assert [g.advantage for g in detail.group] == pytest.approx(compute_advantages(rewards, "grpo"))
    rloo = query.session_detail(conn, sid, advantages=AdvantageSpec(estimator="rloo"))
    assert rloo is not None and rloo.advantages.estimator == "rloo"
    assert [g.advantage for g in rloo.group] == pytest.approx(compute_advantages(rewards, "rloo"))
    # The run's spec whole: the estimator, then the weight on negative advantages.
    spec = AdvantageSpec(estimator="grpo_no_std", negative_advantage_weight=0.3)
    shaped = query.session_detail(conn, sid, advantages=spec)
    assert shaped is not None and shaped.advantages == spec
    centred = [r - 0.625 for r in rewards]
    assert [g.advantage for g in shaped.group] == pytest.approx(
        [a if a >= 0 else 0.3 * a for a in centred]
    )
    # Sessions the coordinator leaves out (failed, or open: no reward yet) get no advantage;
    # the others are computed among themselves.
    mixed = member_advantages(
        [("finished", 1.0), ("open", None), ("failed", 0.5), ("finished", 0.0)], AdvantageSpec()
    )
    assert mixed[1] is None and mixed[2] is None
    assert mixed[0] == pytest.approx(1.0, abs=1e-5) and mixed[3] == pytest.approx(-1.0, abs=1e-5)
    sid = next(iter(built.ids(group="g-search-2-0")))
    detail = query.session_detail(conn, sid)
    assert detail is not None
    assert {g.status: g.advantage for g in detail.group} == {
        "finished": 0.0,
        "failed": None,
        "open": None,
    }


def test_token_texts_come_from_the_tokenizer(
    conn: sqlite3.Connection, built: Built, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    from lockgate.gateway.viewer.tokens import TokenTexts

    texts = TokenTexts(tiny_model_dir)
    sid = next(iter(built.sessions))
    detail = query.session_detail(conn, sid, texts)
    assert detail is not None
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for token_id, text in detail.tokens.items():
        assert text == tok.decode([token_id])
    assert set(detail.tokens) >= set(detail.calls[0].completion_ids)
    assert TokenTexts(None)([1, 2]) == {}


def test_live_feed_reports_new_sessions_calls_and_finishes(tmp_path: Path) -> None:
    path = tmp_path / "trajectories.sqlite"
    build_store(path)
    sid = "live" + "0" * 28
    loop = asyncio.new_event_loop()
    store = TrajectoryStore(path)  # a gateway with the store open
    try:
        conn = open_read_only(path)
        cursor = query.head_cursor(conn)
        assert query.changes_since(conn, cursor).changed == []
        msgs = [{"role": "user", "content": "hi"}]
        steps = {
            "create": lambda: store.create_session(sid, "k-live", "arith-1", "g-live", {}),
            "call": lambda: store.add_call(call(sid, 0, [1, 2], [3], [(4, 0, 1)], messages=msgs)),
            "finish": lambda: store.finish_session(sid, "finished", 1.0, None),
        }
        for step, write in steps.items():
            loop.run_until_complete(write())
            changes = query.changes_since(conn, cursor)
            assert changes.changed == [sid], step
            (row,) = changes.sessions
            cursor = query.Cursor.decode(changes.cursor)
            assert query.changes_since(conn, cursor).changed == []
        assert row.status == "finished" and row.reward == 1.0 and row.last_version == 4
        # The filter applies to the rows, not to which ids changed.
        loop.run_until_complete(store.finish_session(sid, "finished", 1.0, None))
        filtered = query.changes_since(conn, cursor, query.SessionFilter(task="search-2"))
        assert filtered.changed == [sid] and filtered.sessions == []
        conn.close()
    finally:
        store.close()
        loop.close()


def test_store_creates_the_viewer_indexes_and_the_planner_uses_them(
    tmp_path: Path, built: Built
) -> None:
    # An older store (no viewer indexes) gains them when the gateway opens it.
    old = tmp_path / "old.sqlite"
    src = sqlite3.connect(built.path)
    src.execute("VACUUM INTO ?", (str(old),))
    src.close()
    raw = sqlite3.connect(old)
    for name in VIEWER_INDEXES:
        raw.execute(f"DROP INDEX {name}")
    raw.commit()
    raw.close()
    TrajectoryStore(old).close()
    conn = sqlite3.connect(old)
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert set(VIEWER_INDEXES) <= names

    def plan(sql: str, *params: object) -> str:
        return " | ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params))

    assert "sessions_task" in plan(
        "SELECT rowid FROM sessions s WHERE s.task_id = ? AND s.rowid < ? ORDER BY s.rowid DESC",
        "a",
        10,
    )
    assert "calls_interrupted" in plan(
        "SELECT 1 FROM sessions s WHERE EXISTS (SELECT 1 FROM calls c WHERE c.session_id = s.id"
        " AND c.interruptions > 0)"
    )
    assert "sessions_finished" in plan("SELECT id FROM sessions WHERE finished_at > ?", 1.0)
    assert "COVERING INDEX calls_versions" in plan(
        "SELECT 1 FROM sessions s WHERE EXISTS (SELECT 1 FROM calls c WHERE c.session_id = s.id"
        " AND instr(c.versions, ?) > 0)",
        '"version": 1,',
    )
    conn.close()


def test_the_version_filter_matches_the_stores_span_format(built: Built) -> None:
    """The version filter searches the spans' JSON text as the store writes it."""
    conn = sqlite3.connect(built.path)
    (text,) = conn.execute("SELECT versions FROM calls LIMIT 1").fetchone()
    conn.close()
    span = json.loads(text)[0]
    assert f'"version": {span["version"]},' in text


def test_run_metrics_are_shaped_for_the_dashboard(tmp_path: Path) -> None:
    lines = [
        {
            "step": 1,
            "reward/mean": 0.2,
            "time/step_s": 10.0,
            "time/train_s": 6.0,
            "staleness/hist": {"0": 90, "1": 10},
            "count/groups_dropped/stale": 0,
        },
        {
            "step": 2,
            "reward/mean": 0.4,
            "time/wait_for_groups_s": 1.0,
            "time/train_s": 3.0,
            "time/sync_s": 0.0,
            "count/groups_dropped/stale": 2,
            "val/version": 1.0,
            "val/reward_mean": 0.5,
            "sync/load_s": 0.3,
        },
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "rew')
    m = MetricsFile(path).read()
    assert m.available and m.steps == [1, 2]
    assert m.columns["reward/mean"] == [0.2, 0.4]
    assert m.columns["val/reward_mean"] == [None, 0.5]
    assert m.trainer_idle_frac == pytest.approx([0.4, 0.25])
    assert m.stale_drops == [0.0, 2.0]
    assert m.staleness_hist == [{"0": 90, "1": 10}, {}]
    assert shape([]).steps == []
    assert not MetricsFile(tmp_path / "missing.jsonl").read().available
