"""The gateway's own overhead: the same load straight to a fast upstream, then through the gateway.

Method (see benchmarks/README.md for figures):
- The upstream is `benchmarks/fixture_upstream.py`, a stand-in for a vLLM 0.32 replica that
  answers every streamed `/inference/v1/generate` at once with a fixed completion, one SSE event
  per token. The gateway runs as its own process (`python -m lockgate.gateway`, uvicorn) with
  recording on: a real SQLite file in a temporary directory.
- Processes are pinned with `os.sched_setaffinity` (every thread): the gateway gets the first
  CPU of this process's affinity set to itself; the upstream and the load generator (this
  process) share the others.
- The load generator (`benchmarks/loadgen.py`) is closed-loop: `c` keep-alive connections each
  send their next request when the previous answer has fully arrived. "Direct" sends the
  generate request the gateway would send (same prompt ids, same sampling, streamed) to the
  upstream; "gateway" sends a one-message chat completion (`stream` false or true) on a session
  per connection. Latency is request sent -> last byte received; added latency is the
  gateway's p50 (p99) minus the direct p50 (p99). Each point is the median of `--repeats` runs.
- `--viewer-feed on` keeps the trajectory viewer's live feed open during the gateway runs: a
  thread of this process polls `/ui/api/changes` every second, and `/ui/api/overview` and the
  sessions list every fifth, as an open browser tab does (gateway/viewer/static/viewer.js);
  `both` runs each point with the feed off and on, alternating run by run, and prints both.
- `--soak N` instead drives N calls through the gateway in windows (fresh sessions per window,
  the previous ones finished) and prints each window's latency and the gateway's RSS and store
  size, to show both stay flat as the store grows.

    PYTHONPATH=. .venv/bin/python -m benchmarks.gateway_overhead
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import uvloop

from benchmarks.loadgen import LoadResult, http_request, percentile, run_load
from lockgate.coordinator.launch.processes import free_port, spawn, terminate
from lockgate.gateway.calls.rendering import ChatRenderer
from lockgate.gateway.config import GatewayConfig
from lockgate.gateway.schema import ChatMessage
from lockgate.trainer.tiny_models.builder import ensure_tiny_model

ADMIN = "bench-admin-token"
HOST = "127.0.0.1"
COMPLETION_TEXT = "Hello! I am a small model. How can I help you today?"


def _pin(pid: int, cores: set[int]) -> None:
    """Pin every thread of a process (threads started later inherit it from their creator)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cores)


@dataclass
class Rig:
    """A running upstream and gateway, and what the load generator sends them."""

    gateway_port: int
    upstream_port: int
    gateway_pid: int
    db_path: Path
    direct_body: bytes

    def chat_request(self, session_id: str, stream: bool) -> bytes:
        body = orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        )
        path = f"/sessions/{session_id}/v1/chat/completions"
        return http_request(HOST, self.gateway_port, "POST", path, body)

    def direct_request(self) -> bytes:
        path = "/inference/v1/generate"
        return http_request(HOST, self.upstream_port, "POST", path, self.direct_body)

    async def sessions(self, n: int) -> list[str]:
        async with httpx.AsyncClient(
            base_url=f"http://{HOST}:{self.gateway_port}",
            headers={"Authorization": f"Bearer {ADMIN}"},
        ) as client:
            out = []
            for _ in range(n):
                r = await client.post("/admin/sessions", json={"task_id": "bench"})
                r.raise_for_status()
                out.append(r.json()["session_id"])
            return out

    async def finish(self, session_ids: list[str]) -> None:
        async with httpx.AsyncClient(
            base_url=f"http://{HOST}:{self.gateway_port}",
            headers={"Authorization": f"Bearer {ADMIN}"},
        ) as client:
            for sid in session_ids:
                r = await client.post(f"/admin/sessions/{sid}/finish", json={"reward": 0.0})
                r.raise_for_status()


def _wait_until_up(port: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://{HOST}:{port}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"nothing answered on port {port} within {timeout_s}s")


@contextmanager
def rig(workdir: Path, gateway_cores: set[int], other_cores: set[int]) -> Iterator[Rig]:
    model_dir = ensure_tiny_model()
    renderer = ChatRenderer(model_dir)
    tok = renderer.tokenizer
    completion = tok.encode(COMPLETION_TEXT, add_special_tokens=False)
    completion.append(tok.convert_tokens_to_ids("<|im_end|>"))
    upstream_port, gateway_port = free_port(), free_port()
    config = GatewayConfig(
        model_dir=model_dir,
        replicas=[f"http://{HOST}:{upstream_port}"],
        db_path=workdir / "trajectories.sqlite",
        admin_token=ADMIN,
    )
    config_path = workdir / "gateway.json"
    config_path.write_text(config.model_dump_json())
    prompt = renderer.render_prompt([ChatMessage(role="user", content="hi")], None, None)
    sampling = {
        "max_tokens": config.sampling.max_tokens,
        "temperature": config.sampling.temperature,
        "top_p": config.sampling.top_p,
        "stop_token_ids": renderer.stop_token_ids,
        "detokenize": False,
        "logprobs": 0,
    }
    direct_body = orjson.dumps(
        {
            "token_ids": prompt.prompt_ids.tolist(),
            "sampling_params": sampling,
            "request_id": "bench",
            "stream": True,
        }
    )
    # spawn() ties each child to this process (it dies with it) and logs to a file.
    upstream = spawn(
        [
            sys.executable,
            "-m",
            "benchmarks.fixture_upstream",
            "--port",
            str(upstream_port),
            "--completion",
            ",".join(map(str, completion)),
        ],
        workdir / "upstream.log",
    )
    gateway = spawn(
        [
            sys.executable,
            "-m",
            "lockgate.gateway",
            "--config",
            str(config_path),
            "--port",
            str(gateway_port),
        ],
        workdir / "gateway.log",
    )
    try:
        _wait_until_up(upstream_port)
        _wait_until_up(gateway_port)
        _pin(upstream.pid, other_cores)
        _pin(gateway.pid, gateway_cores)
        yield Rig(gateway_port, upstream_port, gateway.pid, config.db_path, direct_body)
    finally:
        for proc in (gateway, upstream):
            terminate(proc)


class ViewerFeed:
    """What an open viewer tab asks the gateway while it trains (viewer.js's poll loop)."""

    def __init__(self, port: int, poll_s: float = 1.0) -> None:
        self._client = httpx.Client(
            base_url=f"http://{HOST}:{port}",
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=30.0,
        )
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.latencies: list[float] = []
        self.errors = 0

    def _get(self, path: str, **params: object) -> httpx.Response | None:
        t = time.perf_counter()
        try:
            r = self._client.get(path, params=params)
            r.raise_for_status()
        except httpx.HTTPError:
            self.errors += 1
            return None
        self.latencies.append(time.perf_counter() - t)
        return r

    def _run(self) -> None:
        r = self._get("/ui/api/overview")
        cursor = r.json()["cursor"] if r is not None else "0_0_0.0"
        polls = 0
        while not self._stop.wait(self._poll_s):
            r = self._get("/ui/api/changes", cursor=cursor)
            if r is not None:
                cursor = r.json()["cursor"]
            polls += 1
            if polls % 5 == 0:  # the header's counts, and a look at the list
                self._get("/ui/api/overview")
                self._get("/ui/api/sessions")

    def __enter__(self) -> ViewerFeed:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._client.close()


@contextmanager
def _maybe_feed(on: bool, port: int) -> Iterator[ViewerFeed | None]:
    if not on:
        yield None
        return
    with ViewerFeed(port) as feed:
        yield feed


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Point:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_ms: float = float("nan")  # gateway CPU per request (gateway runs only)

    @classmethod
    def of(cls, r: LoadResult, cpu_s: float = float("nan")) -> Point:
        return cls(
            r.rps,
            percentile(r.latencies, 0.5) * 1e3,
            percentile(r.latencies, 0.99) * 1e3,
            r.errors,
            cpu_s / max(r.completed, 1) * 1e3,
        )

    @classmethod
    def median(cls, points: list[Point]) -> Point:
        return cls(
            statistics.median(p.rps for p in points),
            statistics.median(p.p50_ms for p in points),
            statistics.median(p.p99_ms for p in points),
            sum(p.errors for p in points),
            statistics.median(p.cpu_ms for p in points),
        )


async def overhead(args: argparse.Namespace, r: Rig) -> None:
    sessions = await r.sessions(max(args.concurrency))
    feeds = {"off": [False], "on": [True], "both": [False, True]}[args.viewer_feed]
    print(
        "| mode | c | viewer feed | direct req/s | gateway req/s | direct p50 ms | gateway p50 ms "
        "| added p50 ms | added p99 ms | gateway CPU ms/req | CPU-bound req/s | errors |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for stream in (mode == "stream" for mode in args.modes):
        for c in args.concurrency:
            direct: list[Point] = []
            through: dict[bool, list[Point]] = {f: [] for f in feeds}
            feed_ms: list[float] = []
            for _ in range(args.repeats):
                res = await run_load(
                    HOST,
                    r.upstream_port,
                    lambda _i: r.direct_request(),
                    concurrency=c,
                    duration_s=args.duration,
                    warmup_s=args.warmup,
                )
                direct.append(Point.of(res))
                for on in feeds:  # with both: off then on, run by run
                    with _maybe_feed(on, r.gateway_port) as feed:
                        cpu_before = _cpu_s(r.gateway_pid)
                        res = await run_load(
                            HOST,
                            r.gateway_port,
                            lambda i, s=stream: r.chat_request(sessions[i], s),
                            concurrency=c,
                            duration_s=args.duration,
                            warmup_s=args.warmup,
                        )
                        cpu = _cpu_s(r.gateway_pid) - cpu_before
                    if feed is not None:
                        feed_ms += [x * 1e3 for x in feed.latencies]
                        res.errors += feed.errors
                    through[on].append(Point.of(res, cpu))
            d = Point.median(direct)
            for on in feeds:
                g = Point.median(through[on])
                print(
                    f"| {'stream' if stream else 'json'} | {c} | {'on' if on else 'off'} "
                    f"| {d.rps:.0f} | {g.rps:.0f} "
                    f"| {d.p50_ms:.2f} | {g.p50_ms:.2f} | {g.p50_ms - d.p50_ms:+.2f} "
                    f"| {g.p99_ms - d.p99_ms:+.2f} | {g.cpu_ms:.2f} | {1e3 / g.cpu_ms:.0f} "
                    f"| {d.errors + g.errors} |",
                    flush=True,
                )
            if feed_ms:
                print(
                    f"|  |  | feed: {len(feed_ms)} viewer requests, p50 "
                    f"{percentile(feed_ms, 0.5):.1f} ms, max {max(feed_ms):.1f} ms |",
                    flush=True,
                )


async def soak(args: argparse.Namespace, r: Rig) -> None:
    c = args.soak_concurrency
    print(
        "| calls | window req/s | p50 ms | p99 ms | gateway CPU ms/call | gateway RSS MiB "
        "| store MiB | errors |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    done = 0
    previous: list[str] = []
    while done < args.soak:
        sessions = await r.sessions(c)
        if previous:
            await r.finish(previous)
        n = min(args.soak_window, args.soak - done)
        cpu_before = _cpu_s(r.gateway_pid)
        res = await run_load(
            HOST,
            r.gateway_port,
            lambda i, s=sessions: r.chat_request(s[i], False),
            concurrency=c,
            duration_s=float("inf"),
            warmup_s=0.0,
            max_requests=n,
        )
        done += n
        p = Point.of(res, _cpu_s(r.gateway_pid) - cpu_before)
        store = sum(f.stat().st_size for f in r.db_path.parent.glob(r.db_path.name + "*"))
        print(
            f"| {done} | {p.rps:.0f} | {p.p50_ms:.2f} | {p.p99_ms:.2f} | {p.cpu_ms:.2f} "
            f"| {_rss_mib(r.gateway_pid):.0f} | {store / 2**20:.0f} | {p.errors} |",
            flush=True,
        )
        previous = sessions


def main() -> None:
    parser = argparse.ArgumentParser(description="the gateway's own latency and throughput cost")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=["json", "stream"],
        help="json (non-streamed), stream (SSE), or both: json,stream",
    )
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per point (median taken)")
    parser.add_argument(
        "--viewer-feed",
        choices=["off", "on", "both"],
        default="off",
        help="keep the viewer's live feed polling the gateway during its runs (both: compare)",
    )
    parser.add_argument("--soak", type=int, default=0, help="instead: drive this many calls")
    parser.add_argument("--soak-window", type=int, default=5000)
    parser.add_argument("--soak-concurrency", type=int, default=16)
    parser.set_defaults(concurrency=[1, 16, 64])
    args = parser.parse_args()

    # A terminated benchmark still stops the gateway and upstream it started (rig's finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs at least 2 CPUs: one for the gateway, one for the rest")
    gateway_cores, other_cores = {cores[0]}, set(cores[1:])
    os.sched_setaffinity(0, other_cores)
    print(
        f"gateway on CPU {sorted(gateway_cores)}, upstream + load generator on "
        f"{sorted(other_cores)}",
        flush=True,
    )
    with (
        tempfile.TemporaryDirectory(prefix="lockgate-bench-") as tmp,
        rig(Path(tmp), gateway_cores, other_cores) as r,
    ):
        uvloop.run(soak(args, r) if args.soak else overhead(args, r))


if __name__ == "__main__":
    main()
