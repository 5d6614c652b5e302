"""Scale simulation: the real gateway in front of many stand-in replicas and thousands of agents.

What runs (see benchmarks/README.md, "Scale simulation", for the figures):
- The gateway is the real one, as its own process (`python -m lockgate.gateway`, recording to
  SQLite), pinned to the first CPU of this process's affinity set: every call goes through its
  real rendering, routing (replicas/pool.py, routing.py), generation (generation.py) and store;
  every pause through its real sync controller, over HTTP.
- The replicas are stand-ins (`sim_replicas.py`): `--replicas` of them on one event loop in
  this process, each on its own port, each with a modelled engine (decode steps shared by the
  running sequences, prefill time for uncached prompt tokens, a prefix cache, a pause that
  waits for the running step to end).
- The agents: `--sessions` concurrent slots in this process, each running sessions one after
  another: create a session, `--turns` chat calls whose prompt is the whole history so far (the
  previous turns' answers plus a tool output of 50-400 tokens each), a think/tool pause between
  turns, finish the session. Completion lengths are drawn per call (16-96 tokens).
- Weight-sync pauses: `--pauses` times, evenly spread, `POST /admin/pause` (abort) sent from
  a lean process of its own (`pause_client.py`), held `--pause-hold` seconds (a weight load's
  stand-in), then `POST /admin/resume`.

Metrics (pure functions below, unit-tested in tests/unit/gateway/test_scale_simulation.py):
- routing imbalance: (max - mean) / mean over replicas of the tokens each generated;
- sticky rate: of the generate requests that are not a session's first, the share sent to the
  replica that served the session's previous request; prefix hit rate: the share that found
  the session's previous prompt in that replica's prefix cache;
- pause fan-out: the gateway's own timings (`replicas_paused_s`: pause request to every
  replica's pause answered; `latency_s`: to quiescent) and the stand-ins' (first pause request
  arriving at a replica to the last one answered), and the round trip seen by the client.

    PYTHONPATH=. .venv/bin/python -m benchmarks.scale_simulation --json benchmarks/results/scale_simulation.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import random
import re
import resource
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import httptools
import orjson
import uvloop
from pydantic import BaseModel

from benchmarks.gateway_overhead import _cpu_s, _pin, _wait_until_up
from benchmarks.loadgen import percentile
from benchmarks.sim_replicas import (
    BLOCK,
    Completion,
    EngineModel,
    PauseRecord,
    ReplicaLog,
    RequestRecord,
    SimReplica,
    start_replicas,
)
from lockgate.coordinator.launch.processes import free_port, spawn, terminate
from lockgate.gateway.calls.rendering import ChatRenderer
from lockgate.gateway.config import GatewayConfig, SamplingPolicy
from lockgate.trainer.tiny_models.builder import ensure_tiny_model

ADMIN = "sim-admin-token"
HOST = "127.0.0.1"
KEY_BLOCKS = 4  # the session id is inside the prompt's first 64 tokens
_WORDS = (
    "the agent reads file log line error test passes fails output value result check next "
    "step search query page found open close write patch diff build run module function "
    "class import return none true false path data table row column index cache server"
).split()
_FILLER = " The agent checks the next file and reads the log."
_TOOL_CALL = '\n<tool_call>\n{"name": "run", "arguments": {"cmd": "make test"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command in the task's sandbox.",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}},
                "required": ["cmd"],
            },
        },
    }
]


# -- pure metrics ---------------------------------------------------------------------------------


def imbalance(values: Sequence[float]) -> float:
    """(max - mean) / mean: how much more than its share the busiest one got (0: even)."""
    if not values:
        return float("nan")
    mean = sum(values) / len(values)
    return (max(values) - mean) / mean if mean > 0 else 0.0


def tokens_per_replica(records: Sequence[RequestRecord], replicas: int) -> list[int]:
    out = [0] * replicas
    for r in records:
        out[r.replica] += r.tokens
    return out


def calls_per_replica(records: Sequence[RequestRecord], replicas: int) -> list[int]:
    out = [0] * replicas
    for r in records:
        out[r.replica] += 1
    return out


class Stickiness(BaseModel):
    followups: int  # generate requests that are not their session's first
    sticky: int  # sent to the replica that served the session's previous request
    prefix_hits: int  # found the session's previous prompt (whole blocks) in its prefix cache

    @property
    def sticky_rate(self) -> float:
        return self.sticky / self.followups if self.followups else float("nan")

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.followups if self.followups else float("nan")


def stickiness(records: Sequence[RequestRecord]) -> Stickiness:
    """Per session (record key), in arrival order: did each request after the first go back to
    the previous request's replica, and find that request's prompt in its prefix cache?"""
    by_session: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_session[r.key].append(r)
    followups = sticky = hits = 0
    for reqs in by_session.values():
        reqs.sort(key=lambda r: r.started)
        for prev, cur in itertools.pairwise(reqs):
            followups += 1
            sticky += cur.replica == prev.replica
            hits += cur.cached >= prev.prompt_len // BLOCK * BLOCK
    return Stickiness(followups=followups, sticky=sticky, prefix_hits=hits)


def pause_spreads(pauses: Sequence[PauseRecord], replicas: int) -> list[float]:
    """Per gateway pause, first pause request arriving at a replica to the last one answered.

    Every replica sees every pause once, in order, so the k-th record of each is pause k."""
    per_replica: dict[int, list[PauseRecord]] = defaultdict(list)
    for p in sorted(pauses, key=lambda p: p.arrived):
        per_replica[p.replica].append(p)
    n = min((len(v) for v in per_replica.values()), default=0)
    if len(per_replica) < replicas:
        n = 0
    return [
        max(v[k].answered for v in per_replica.values())
        - min(v[k].arrived for v in per_replica.values())
        for k in range(n)
    ]


def quantiles(values: Sequence[float]) -> dict[str, float]:
    vals = list(values)
    return {
        "n": len(vals),
        "p50": percentile(vals, 0.5),
        "p99": percentile(vals, 0.99),
        "max": max(vals) if vals else float("nan"),
    }


# -- the agents' HTTP client ----------------------------------------------------------------------


class _Client(asyncio.Protocol):
    """One keep-alive connection to the gateway: a request, its whole answer, the next."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future[tuple[int, bytes]] | None = None
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError(f"connection lost: {exc}"))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result((self._parser.get_status_code(), b"".join(self._body)))

    async def request(
        self, method: str, path: str, body: bytes, admin: bool = False
    ) -> tuple[int, bytes]:
        assert self._transport is not None
        auth = f"authorization: Bearer {ADMIN}\r\n" if admin else ""
        head = (
            f"{method} {path} HTTP/1.1\r\nhost: gw\r\n{auth}"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        self._body = []
        self._done = asyncio.get_running_loop().create_future()
        self._transport.write(head.encode() + body)
        return await self._done

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def _connect(port: int) -> _Client:
    _, client = await asyncio.get_running_loop().create_connection(_Client, HOST, port)
    return client


# -- the run --------------------------------------------------------------------------------------


class SimConfig(BaseModel):
    replicas: int = 64
    sessions: int = 2000
    turns: int = 8
    duration_s: float = 90.0  # slots start no new session after this
    ramp_s: float = 10.0  # session slots start spread over this
    think_s: float = 3.0  # mean think/tool time between turns (uniform 0.2x-1.8x)
    min_tokens: int = 32  # a completion ends with a 25-token tool call
    max_tokens: int = 112
    pauses: int = 20
    pause_hold_s: float = 0.3
    status_every_s: float = 5.0
    seed: int = 0
    engine: EngineModel = EngineModel()
    pin: bool = True


class Counters(BaseModel):
    sessions_started: int = 0
    sessions_finished: int = 0
    turns: int = 0
    errors: int = 0
    turns_per_session_ok: bool = True  # every finished session had all its turns answered
    first_error: str | None = None


class SimResult(BaseModel):
    config: SimConfig
    wall_s: float
    counters: Counters
    generate_requests: int
    tokens_generated: int
    calls_per_s: float
    tokens_per_s: float
    routing_imbalance_tokens: float
    routing_imbalance_calls: float
    routing_imbalance_in_flight: float
    tokens_per_replica: list[int]
    sticky: Stickiness
    sticky_rate: float
    prefix_hit_rate: float
    pause_rtt_s: dict[str, float]
    pause_gateway_latency_s: dict[str, float]
    pause_replicas_paused_s: dict[str, float]
    pause_streams_closed_s: dict[str, float]
    pause_engines_s: dict[str, float]
    pause_fanout_at_replicas_s: dict[str, float]
    resume_rtt_s: dict[str, float]
    interrupted_per_pause: dict[str, float]
    gateway_cpu_s: float
    gateway_cpu_share: float  # of one core, over the run
    gateway_cpu_ms_per_call: float
    gateway_cpu_us_per_token: float
    sim_cpu_share: float  # this process: stand-ins + agents + driver, of one core
    # What else ran: the machine's 1-minute load average over the run (2 cores: above 2, the
    # gateway waited for a CPU), and the gateway's own event-loop stalls over 250 ms.
    load_avg_1m: dict[str, float]
    gateway_loop_stalls: int
    gateway_loop_stall_max_s: float
    sim_loop_lag_s: dict[str, float]  # this process's (stand-ins, agents) loop, sampled 20/s


class _Run:
    def __init__(self, cfg: SimConfig, port: int, renderer: ChatRenderer) -> None:
        self.cfg = cfg
        self.port = port
        self.counters = Counters()
        self.rng = random.Random(cfg.seed)
        self.stop_at = 0.0
        self.pause_reports: list[dict[str, float]] = []
        self.pause_rtts: list[float] = []
        self.resume_rtts: list[float] = []
        self.load_avg: list[float] = []  # the machine's 1-minute load average, per status line
        self._sys_pad = " ".join(self.rng.choice(_WORDS) for _ in range(120))
        self._tok = renderer.tokenizer

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(n))

    def _fail(self, what: str) -> None:
        self.counters.errors += 1
        if self.counters.first_error is None:
            self.counters.first_error = what[:500]

    async def slot(self, i: int) -> None:
        cfg = self.cfg
        await asyncio.sleep(cfg.ramp_s * i / cfg.sessions)
        client = await _connect(self.port)
        try:
            while time.perf_counter() < self.stop_at:
                await self.session(client)
        finally:
            client.close()

    async def session(self, client: _Client) -> None:
        cfg, c = self.cfg, self.counters
        status, body = await client.request(
            "POST", "/admin/sessions", orjson.dumps({"task_id": "sim"}), admin=True
        )
        if status not in (200, 201):
            self._fail(f"create session: {status} {body[:200]!r}")
            await asyncio.sleep(1.0)
            return
        sid = orjson.loads(body)["session_id"]
        c.sessions_started += 1
        messages = [
            {
                "role": "system",
                "content": f"session {sid}. You are a coding agent. {self._sys_pad}",
            },
            {"role": "user", "content": "Task: " + self._words(80)},
        ]
        answered = 0
        for turn in range(cfg.turns):
            max_tokens = self.rng.randint(cfg.min_tokens, cfg.max_tokens)
            req = orjson.dumps(
                {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": max_tokens}
            )
            status, body = await client.request("POST", f"/sessions/{sid}/v1/chat/completions", req)
            if status != 200:
                self._fail(f"turn {turn}: {status} {body[:300]!r}")
                break
            answer = orjson.loads(body)["choices"][0]["message"]
            calls = answer.get("tool_calls") or []
            if not calls:
                self._fail(f"turn {turn}: no tool call in {answer!r}")
                break
            # Echoed as received, and the tool's output as a tool message: as an agent does, so
            # the gateway extends the previous call's tokens (no re-render, a prefix-cache hit).
            messages.append(
                {"role": "assistant", "content": answer.get("content"), "tool_calls": calls}
            )
            answered += 1
            c.turns += 1
            if turn + 1 < cfg.turns:
                await asyncio.sleep(self.rng.uniform(0.2, 1.8) * cfg.think_s)
                output = self._words(self.rng.randint(50, 400))
                messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": output})
        status, body = await client.request(
            "POST",
            f"/admin/sessions/{sid}/finish",
            orjson.dumps(
                {"reward": 0.0, "status": "finished" if answered == cfg.turns else "failed"}
            ),
            admin=True,
        )
        if status not in (200, 204):
            self._fail(f"finish: {status} {body[:200]!r}")
        c.sessions_finished += 1
        if answered != cfg.turns:
            c.turns_per_session_ok = False

    async def pauser(self, start: float) -> None:
        cfg = self.cfg
        if cfg.pauses <= 0:
            return
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(__file__).with_name("pause_client.py")),
            f"http://{HOST}:{self.port}",
            ADMIN,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        admin = await _connect(self.port)
        # Pauses spread over the run after the ramp, when every slot is busy.
        first = start + cfg.ramp_s
        gap = (self.stop_at - first) / cfg.pauses
        try:
            for k in range(cfg.pauses):
                # On schedule, but never right after the previous resume: a late pause fired
                # at once would land on the resumed calls' burst and measure that instead.
                due = first + gap * (k + 0.5) - time.perf_counter()
                await asyncio.sleep(max(due, gap / 2 if k else 0.0))
                if time.perf_counter() >= self.stop_at:
                    break  # late (a starved machine): a pause after the load measures nothing
                proc.stdin.write(b"abort\n")
                await proc.stdin.drain()
                line = orjson.loads(await proc.stdout.readline())
                if line["status"] != 200:
                    self._fail(f"pause: {line}")
                    continue
                self.pause_rtts.append(line["rtt_s"])
                self.pause_reports.append(line["body"]["pause"])
                await asyncio.sleep(cfg.pause_hold_s)
                t0 = time.perf_counter()
                status, body = await admin.request(
                    "POST", "/admin/resume", orjson.dumps({"version": 0}), admin=True
                )
                self.resume_rtts.append(time.perf_counter() - t0)
                if status != 200:
                    self._fail(f"resume: {status} {body[:200]!r}")
        finally:
            admin.close()
            proc.stdin.close()
            await proc.wait()


def _proc_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _status(
    run: _Run, replicas: list[SimReplica], gateway_pid: int, log: ReplicaLog, t0: float
) -> None:
    last_t, last_turns, last_g, last_s = t0, 0, _cpu_s(gateway_pid), _proc_cpu_s()
    while True:
        await asyncio.sleep(run.cfg.status_every_s)
        now, g, s = time.perf_counter(), _cpu_s(gateway_pid), _proc_cpu_s()
        run.load_avg.append(os.getloadavg()[0])
        dt = now - last_t
        c = run.counters
        running = sum(len(r.running) + len(r.prefilling) for r in replicas)
        print(
            f"[{now - t0:6.1f}s] sessions {c.sessions_started - c.sessions_finished} open, "
            f"{c.sessions_finished} done | turns {c.turns} ({(c.turns - last_turns) / dt:.0f}/s) | "
            f"generating {running} | pauses {len(run.pause_rtts)} | errors {c.errors} | "
            f"CPU gateway {(g - last_g) / dt:.0%} sim {(s - last_s) / dt:.0%} | "
            f"load {run.load_avg[-1]:.1f}",
            flush=True,
        )
        last_t, last_turns, last_g, last_s = now, c.turns, g, s


async def _watch_lag(lags: list[float], every_s: float = 0.05) -> None:
    """How late this process's loop wakes up: a stall here delays the stand-ins' answers, and
    would be counted against the gateway."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(every_s)
        lags.append(time.perf_counter() - t - every_s)


async def _sample_in_flight(
    replicas: list[SimReplica], sums: list[float], every_s: float = 0.25
) -> None:
    while True:
        await asyncio.sleep(every_s)
        for r in replicas:
            sums[r.index] += len(r.running) + len(r.prefilling)


async def simulate(cfg: SimConfig, workdir: Path) -> SimResult:
    model_dir = ensure_tiny_model()
    renderer = ChatRenderer(model_dir)
    tok = renderer.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    tail = [*tok.encode(_TOOL_CALL, add_special_tokens=False), end]
    if cfg.min_tokens <= len(tail):
        raise ValueError(f"min_tokens must exceed the tool call's {len(tail)} tokens")
    completion = Completion(tok.encode(_FILLER, add_special_tokens=False), tail)
    log = ReplicaLog(key_blocks=KEY_BLOCKS)
    replicas = await start_replicas(cfg.replicas, cfg.engine, completion, log)
    ports = [r.port for r in replicas]
    gw_port = free_port()
    config = GatewayConfig(
        model_dir=model_dir,
        replicas=[f"http://{HOST}:{p}" for p in ports],
        db_path=workdir / "trajectories.sqlite",
        admin_token=ADMIN,
        max_model_len=32768,
        sampling=SamplingPolicy(max_tokens=cfg.max_tokens),
    )
    config_path = workdir / "gateway.json"
    config_path.write_text(config.model_dump_json())
    gateway = spawn(
        [
            sys.executable,
            "-m",
            "lockgate.gateway",
            "--config",
            str(config_path),
            "--port",
            str(gw_port),
        ],
        workdir / "gateway.log",
    )
    run = _Run(cfg, gw_port, renderer)
    gc_threshold = gc.get_threshold()
    try:
        await asyncio.to_thread(_wait_until_up, gw_port)
        cores = sorted(os.sched_getaffinity(0))
        if cfg.pin and len(cores) >= 2:
            _pin(gateway.pid, {cores[0]})
            os.sched_setaffinity(0, set(cores[1:]))
            print(f"gateway on CPU {cores[0]}, stand-ins + agents on {cores[1:]}", flush=True)
        # The stand-ins' prefix caches and the agents' histories grow to millions of objects:
        # full collections over them would stall every replica at once, mid-measurement.
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 50, 1000)  # restored in the finally below
        t0 = time.perf_counter()
        run.stop_at = t0 + cfg.duration_s
        g0, s0 = _cpu_s(gateway.pid), _proc_cpu_s()
        in_flight = [0.0] * cfg.replicas
        sim_lags: list[float] = []
        helpers = [
            asyncio.create_task(_status(run, replicas, gateway.pid, log, t0)),
            asyncio.create_task(_sample_in_flight(replicas, in_flight)),
            asyncio.create_task(_watch_lag(sim_lags)),
        ]
        pauser = asyncio.create_task(run.pauser(t0))
        await asyncio.gather(*(run.slot(i) for i in range(cfg.sessions)), pauser)
        wall = time.perf_counter() - t0
        g_cpu, s_cpu = _cpu_s(gateway.pid) - g0, _proc_cpu_s() - s0
        for task in helpers:
            task.cancel()
    finally:
        gc.set_threshold(*gc_threshold)
        gc.unfreeze()
        terminate(gateway)
        for r in replicas:
            await r.stop()
        print(f"gateway log: {workdir / 'gateway.log'}", flush=True)

    stalls = [
        float(m.group(1)) / 1e3
        for m in re.finditer(r"event loop ran (\d+) ms late", (workdir / "gateway.log").read_text())
    ]
    records = log.requests
    tokens = tokens_per_replica(records, cfg.replicas)
    st = stickiness(records)
    reports = run.pause_reports
    engines = [r["engines_paused_s"] for r in reports if r.get("engines_paused_s") is not None]
    turns = run.counters.turns
    return SimResult(
        config=cfg,
        wall_s=wall,
        counters=run.counters,
        generate_requests=len(records),
        tokens_generated=sum(tokens),
        calls_per_s=turns / wall,
        tokens_per_s=sum(tokens) / wall,
        routing_imbalance_tokens=imbalance(tokens),
        routing_imbalance_calls=imbalance(calls_per_replica(records, cfg.replicas)),
        routing_imbalance_in_flight=imbalance(in_flight),
        tokens_per_replica=tokens,
        sticky=st,
        sticky_rate=st.sticky_rate,
        prefix_hit_rate=st.prefix_hit_rate,
        pause_rtt_s=quantiles(run.pause_rtts),
        pause_gateway_latency_s=quantiles([r["latency_s"] for r in reports]),
        pause_replicas_paused_s=quantiles([r["replicas_paused_s"] for r in reports]),
        pause_streams_closed_s=quantiles([r["streams_closed_s"] for r in reports]),
        pause_engines_s=quantiles(engines),
        pause_fanout_at_replicas_s=quantiles(pause_spreads(log.pauses, cfg.replicas)),
        resume_rtt_s=quantiles(run.resume_rtts),
        interrupted_per_pause=quantiles([float(r["interrupted"]) for r in reports]),
        gateway_cpu_s=g_cpu,
        gateway_cpu_share=g_cpu / wall,
        gateway_cpu_ms_per_call=g_cpu / max(turns, 1) * 1e3,
        gateway_cpu_us_per_token=g_cpu / max(sum(tokens), 1) * 1e6,
        sim_cpu_share=s_cpu / wall,
        load_avg_1m={
            "min": min(run.load_avg, default=float("nan")),
            "median": percentile(run.load_avg, 0.5),
            "max": max(run.load_avg, default=float("nan")),
        },
        gateway_loop_stalls=len(stalls),
        gateway_loop_stall_max_s=max(stalls, default=0.0),
        sim_loop_lag_s=quantiles(sim_lags),
    )


async def _cancellable(run: Coroutine[Any, Any, SimResult]) -> SimResult:
    """Run `run`, cancelled by SIGTERM or SIGINT: its cleanup stops the gateway it started.

    A signal handler that raises does not get through uvloop's loop; cancelling the task does."""
    task = asyncio.create_task(run)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    return await task


def summary(r: SimResult) -> str:
    def ms(q: dict[str, float]) -> str:
        return (
            f"p50 {q['p50'] * 1e3:.1f} ms, p99 {q['p99'] * 1e3:.1f} ms, max {q['max'] * 1e3:.1f} ms"
        )

    c = r.counters
    return "\n".join(
        [
            f"{r.config.replicas} replicas, {r.config.sessions} concurrent sessions, {r.wall_s:.0f} s",
            f"sessions finished {c.sessions_finished}, turns {c.turns} ({r.calls_per_s:.0f} calls/s), "
            f"generate requests {r.generate_requests}, tokens {r.tokens_generated} "
            f"({r.tokens_per_s:.0f}/s), errors {c.errors}",
            f"routing imbalance (max-mean)/mean: tokens {r.routing_imbalance_tokens:.1%}, "
            f"calls {r.routing_imbalance_calls:.1%}, in flight {r.routing_imbalance_in_flight:.1%}",
            f"sticky {r.sticky_rate:.2%}, prefix hits {r.prefix_hit_rate:.2%} "
            f"(of {r.sticky.followups} follow-up requests)",
            f"pause, gateway replicas_paused_s: {ms(r.pause_replicas_paused_s)}",
            f"pause, gateway latency_s (quiescent): {ms(r.pause_gateway_latency_s)}",
            f"pause, at the stand-ins (first arrival to last answer): {ms(r.pause_fanout_at_replicas_s)}",
            f"pause, client round trip: {ms(r.pause_rtt_s)}; resume round trip: {ms(r.resume_rtt_s)}",
            f"interrupted per pause: p50 {r.interrupted_per_pause['p50']:.0f}",
            f"first error: {c.first_error}",
            f"gateway CPU {r.gateway_cpu_share:.0%} of a core ({r.gateway_cpu_ms_per_call:.2f} ms per call, "
            f"{r.gateway_cpu_us_per_token:.0f} us per token); "
            f"stand-ins + agents {r.sim_cpu_share:.0%}",
            f"machine load (1 min, 2 cores): median {r.load_avg_1m['median']:.1f}, max "
            f"{r.load_avg_1m['max']:.1f}; gateway loop stalls over 250 ms: "
            f"{r.gateway_loop_stalls} (longest {r.gateway_loop_stall_max_s * 1e3:.0f} ms); "
            f"stand-ins' loop lag {ms(r.sim_loop_lag_s)}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="the gateway at scale: many replicas, many agents")
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=2000, help="concurrent agent sessions")
    parser.add_argument("--turns", type=int, default=8, help="chat calls per session")
    parser.add_argument(
        "--duration", type=float, default=90.0, help="seconds during which sessions start"
    )
    parser.add_argument(
        "--ramp", type=float, default=10.0, help="seconds over which the slots start"
    )
    parser.add_argument(
        "--think", type=float, default=3.0, help="mean think/tool seconds between turns"
    )
    parser.add_argument("--pauses", type=int, default=20)
    parser.add_argument("--pause-hold", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-pin", action="store_true", help="leave CPU placement to the kernel")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    cfg = SimConfig(
        replicas=args.replicas,
        sessions=args.sessions,
        turns=args.turns,
        duration_s=args.duration,
        ramp_s=args.ramp,
        think_s=args.think,
        pauses=args.pauses,
        pause_hold_s=args.pause_hold,
        seed=args.seed,
        pin=not args.no_pin,
    )
    # Thousands of sockets each side: the agents' connections, the gateway's to the replicas.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory(prefix="lockgate-scale-") as tmp:
        result = uvloop.run(_cancellable(simulate(cfg, Path(tmp))))
    print(summary(result), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(
            orjson.dumps(result.model_dump(mode="json"), option=orjson.OPT_INDENT_2) + b"\n"
        )


if __name__ == "__main__":
    main()
