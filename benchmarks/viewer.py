"""The viewer on a big store: a 100k-call trajectory store, and how long its routes take.

The store is written in the gateway's own format (the schema and indexes `TrajectoryStore`
creates, rows packed by its `_call_row`): 12,500 sessions of 8 calls (groups of 8, 500 tasks),
each call's prompt extending the previous call's tokens (so prompts grow to ~500 tokens),
3% of calls cut by a weight sync (two version spans, `interruptions` 1), 2% of later calls a
re-render split, 1% of sessions failed and the newest 64 still open. Weight versions advance
every 400 sessions, as a run's would.

The viewer runs as `lockgate view` does (`create_view_app`, uvicorn, in a thread of this
process) with the tiny model's tokenizer for token texts; requests go over real sockets
(httpx). Each route is timed `--repeats` times after one untimed warm-up request (the first
request's time is printed too: it opens the connection and loads the tokenizer).

    PYTHONPATH=. .venv/bin/python -m benchmarks.viewer [--store PATH] [--browser]

`--browser` also times the page in headless Debian chromium (Playwright): the page with its
first 50 sessions rendered, and a session's view rendered after selecting it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from lockgate.gateway.schema import CallRecord, VersionSpan
from lockgate.gateway.store.trajectories import TrajectoryStore, _call_row
from lockgate.gateway.viewer.serve import RunFiles, create_view_app
from lockgate.trainer.tiny_models.builder import ensure_tiny_model
from tests.support.threaded_server import serve_in_thread

TOKEN = "bench-viewer-token"
SESSIONS = 12_500
CALLS_PER_SESSION = 8
GROUP = 8
TASKS = 500


def build(path: Path, sessions: int = SESSIONS, seed: int = 0) -> None:
    """Write the store (see the module docstring); a few seconds per 10k calls."""
    TrajectoryStore(path).close()  # the schema and indexes, as the gateway makes them
    rng = random.Random(seed)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    t0 = 1_790_000_000.0
    request_base = [{"role": "system", "content": "You are a careful agent."}]
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    conn.execute("BEGIN")
    for n in range(sessions):
        sid = f"{n:08d}" + "b" * 24
        task = f"task-{(n // GROUP) % TASKS}"
        group = f"g-{n // GROUP}"
        version = n // 400
        status = "open" if n >= sessions - 64 else ("failed" if rng.random() < 0.01 else "finished")
        reward = None if status != "finished" else float(rng.random() < 0.4)
        created = t0 + n * 0.5
        prompt = [rng.randrange(100, 5000) for _ in range(120)]
        messages = [*request_base, {"role": "user", "content": f"question {n}"}]
        splits = 0
        for idx in range(CALLS_PER_SESSION):
            completion = [rng.randrange(100, 5000) for _ in range(40)]
            cut = rng.random() < 0.03
            split = idx > 0 and rng.random() < 0.02
            if split:
                prompt = prompt[:60] + [rng.randrange(100, 5000) for _ in range(20)]
                splits += 1
            spans = (
                [VersionSpan(version=version, start=0, end=17),
                 VersionSpan(version=version + 1, start=17, end=40)]
                if cut
                else [VersionSpan(version=version, start=0, end=40)]
            )  # fmt: skip
            record = CallRecord(
                session_id=sid,
                index=idx,
                request={"model": "m", "messages": messages, "tools": tools},
                sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 64},
                prompt_ids=prompt,
                completion_ids=completion,
                logprobs=[-rng.expovariate(2.0) for _ in completion],
                versions=spans,
                finish_reason="tool_calls" if idx < CALLS_PER_SESSION - 1 else "stop",
                replica="http://127.0.0.1:9000",
                started_at=created + idx,
                ended_at=created + idx + 0.4,
                interruptions=int(cut),
                extends_previous=idx > 0 and not split,
            )
            conn.execute("INSERT INTO calls VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         _call_row(record))  # fmt: skip
            prompt = prompt + completion + [rng.randrange(100, 5000) for _ in range(25)]
            messages = [
                *messages,
                {"role": "assistant", "content": f"step {idx}"},
                {"role": "tool", "tool_call_id": f"c{idx}", "content": f"result {idx} " * 8},
            ]
        conn.execute(
            "INSERT INTO sessions (id, api_key, task_id, group_id, metadata, status, reward,"
            " created_at, finished_at, num_calls, rerender_splits)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (sid, f"key-{sid}", task, group, json.dumps({"n": n}), status, reward, created,
             None if status == "open" else created + 9, CALLS_PER_SESSION, splits),
        )  # fmt: skip
        if n % 500 == 499:
            conn.execute("COMMIT")
            conn.execute("BEGIN")
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


HEAVY = "heavy" + "h" * 27


def add_heavy(path: Path, calls: int = 32, prompt_len: int = 2000) -> None:
    """One worst-case session: every call a re-render split, so the view shows each call's
    whole prompt (32 x 2,000 prompt tokens and 32 x 200 sampled)."""
    rng = random.Random(7)
    conn = sqlite3.connect(path, isolation_level=None)
    if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (HEAVY,)).fetchone():
        conn.close()
        return
    conn.execute("BEGIN")
    conn.execute(
        "INSERT INTO sessions (id, api_key, task_id, group_id, metadata, status, reward,"
        " created_at, finished_at, num_calls, rerender_splits)"
        " VALUES (?, 'k-heavy', 'heavy', 'g-heavy', '{}', 'finished', 1.0, 0, 1, ?, ?)",
        (HEAVY, calls, calls - 1),
    )
    for idx in range(calls):
        completion = [rng.randrange(100, 5000) for _ in range(200)]
        record = CallRecord(
            session_id=HEAVY,
            index=idx,
            request={"model": "m", "messages": [{"role": "user", "content": "x" * 4000}]},
            sampling={"temperature": 1.0},
            prompt_ids=[rng.randrange(100, 5000) for _ in range(prompt_len)],
            completion_ids=completion,
            logprobs=[-rng.expovariate(2.0) for _ in completion],
            versions=[VersionSpan(version=idx // 4, start=0, end=200)],
            finish_reason="stop",
            replica="r",
            started_at=0.0,
            ended_at=1.0,
            interruptions=0,
            extends_previous=False,
        )
        conn.execute("INSERT INTO calls VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     _call_row(record))  # fmt: skip
    conn.execute("COMMIT")
    conn.close()


def _time(fn: Callable[[], httpx.Response], repeats: int) -> tuple[float, list[float], int]:
    t = time.perf_counter()
    first = fn()
    first.raise_for_status()
    first_ms = (time.perf_counter() - t) * 1e3
    times = []
    size = len(first.content)
    for _ in range(repeats):
        t = time.perf_counter()
        r = fn()
        times.append((time.perf_counter() - t) * 1e3)
        r.raise_for_status()
    return first_ms, times, size


def _browser(port: int, ids: list[str], repeats: int) -> None:
    """Page-load times in headless Debian chromium: the page with its first 50 sessions
    rendered, and a session's view rendered after a click (fetch + tokens in the DOM)."""
    from playwright.sync_api import sync_playwright

    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=args)
        page = browser.new_page(viewport={"width": 1500, "height": 950})
        base = f"http://127.0.0.1:{port}/ui/"
        page.goto(f"{base}?token={TOKEN}")
        page.wait_for_selector("body[data-ready='1']")
        loads, views = [], []
        for _ in range(max(3, repeats // 4)):
            t = time.perf_counter()
            page.goto(base)
            page.wait_for_selector("body[data-ready='1']")
            loads.append((time.perf_counter() - t) * 1e3)
        heavy: list[float] = []
        for sid in [*ids, HEAVY, HEAVY]:
            page.evaluate("() => { document.getElementById('detail-pane').innerHTML = ''; }")
            t = time.perf_counter()
            page.evaluate(f"() => selectSession('{sid}')")
            page.wait_for_selector(".toks .t.s", state="attached")
            (heavy if sid == HEAVY else views).append((time.perf_counter() - t) * 1e3)
        browser.close()
    print("\nin chromium (median, max):")
    print(
        f"- page load, 50 sessions listed: {statistics.median(loads):.0f} ms, {max(loads):.0f} ms"
    )
    print(
        f"- session view rendered (8 calls): {statistics.median(views):.0f} ms, {max(views):.0f} ms"
    )
    print(f"- worst-case session rendered (32 calls x 2,000-token prompts, each shown as 400 until expanded): {statistics.median(heavy):.0f} ms, "
          f"{max(heavy):.0f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="the viewer's routes on a 100k-call store")
    parser.add_argument("--store", type=Path, default=Path("/tmp/lockgate-viewer-100k.sqlite"))
    parser.add_argument("--sessions", type=int, default=SESSIONS)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--browser", action="store_true", help="also time it in chromium")
    args = parser.parse_args()
    if args.rebuild or not args.store.exists():
        for suffix in ("", "-wal", "-shm"):
            Path(f"{args.store}{suffix}").unlink(missing_ok=True)
        t = time.perf_counter()
        build(args.store, args.sessions)
        print(f"built {args.store} in {time.perf_counter() - t:.0f}s", flush=True)
    add_heavy(args.store)
    conn = sqlite3.connect(args.store)
    n_calls = conn.execute("SELECT count(*) FROM calls").fetchone()[0]
    n_sessions = conn.execute("SELECT count(*) FROM sessions").fetchone()[0]
    conn.close()
    size = args.store.stat().st_size / 2**20
    print(f"store: {n_sessions} sessions, {n_calls} calls, {size:.0f} MiB")

    files = RunFiles(store=args.store, metrics=args.store.parent / "none.jsonl",
                     model_dir=ensure_tiny_model())  # fmt: skip
    rng = random.Random(1)
    with (
        serve_in_thread(create_view_app(files, TOKEN)) as port,
        httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as c,
    ):

        def get(path: str, **params: object) -> Callable[[], httpx.Response]:
            return lambda: c.get(path, params=params)

        deep = c.get("/ui/api/sessions", params={"limit": 500}).json()["next_cursor"]
        for _ in range(10):  # 5,000 rows further down
            deep = c.get("/ui/api/sessions", params={"limit": 500, "cursor": deep}).json()[
                "next_cursor"
            ]
        ids = [f"{rng.randrange(SESSIONS):08d}" + "b" * 24 for _ in range(args.repeats + 1)]
        pick = iter(ids * 2)
        head = c.get("/ui/api/overview").json()["cursor"]
        cases: list[tuple[str, Callable[[], httpx.Response]]] = [
            ("list: newest 50", get("/ui/api/sessions")),
            ("list: page 101 (cursor 5,000 rows down)", get("/ui/api/sessions", cursor=deep)),
            ("list: task = task-123", get("/ui/api/sessions", task="task-123")),
            ("list: group = g-777", get("/ui/api/sessions", group="g-777")),
            ("list: status failed", get("/ui/api/sessions", status="failed")),
            ("list: reward >= 1", get("/ui/api/sessions", reward_min=1)),
            ("list: interrupted", get("/ui/api/sessions", interrupted="true")),
            ("list: splits", get("/ui/api/sessions", splits="true")),
            ("list: version 3 (old: scans to it)", get("/ui/api/sessions", version=3)),
            ("list: version 31 (recent)", get("/ui/api/sessions", version=31)),
            ("list: task + interrupted + reward>=1",
             get("/ui/api/sessions", task="task-42", interrupted="true", reward_min=1)),
            ("list: no match (version 999, full scan)", get("/ui/api/sessions", version=999)),
            ("session view (8 calls, random session)",
             lambda: c.get(f"/ui/api/sessions/{next(pick)}")),
            ("session view (worst case: 32 splits x 2,000 prompt tokens)",
             get(f"/ui/api/sessions/{HEAVY}")),
            ("live poll (nothing new)", get("/ui/api/changes", cursor=head)),
            ("overview", get("/ui/api/overview")),
        ]  # fmt: skip
        if args.browser:
            _browser(port, ids[:5], args.repeats)
        print(f"\n{args.repeats} timed requests per route (after one warm-up):\n")
        print("| route | first ms | median ms | p95 ms | max ms | body KiB |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, fn in cases:
            first, times, nbytes = _time(fn, args.repeats)
            times.sort()
            p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
            print(
                f"| {name} | {first:.1f} | {statistics.median(times):.1f} | {p95:.1f} "
                f"| {times[-1]:.1f} | {nbytes / 1024:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
