"""Many concurrent agent sessions against a gateway over real vLLM-CPU replicas, reconciled.

Each of `--sessions` sessions is a multi-turn agent: it sends a turn, appends the answer and a
new user message, and sends the next, until `--duration` seconds have passed. Then every
session's record is read back and checked against what its agent was told: one record per
answered turn, the answer's text exactly the parse of the recorded tokens, `usage` equal to
the recorded token count, a logprob per token. The gateway's RSS is sampled through the run.

    PYTHONPATH=. .venv/bin/python -m benchmarks.sessions_load --sessions 500 --duration 60 \
        --json benchmarks/results/sessions_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from lockgate.coordinator.launch.gateway import GatewayProcess
from lockgate.coordinator.launch.replicas import LocalReplicaSet, ReplicaLaunchConfig
from lockgate.gateway.calls.rendering import ChatRenderer
from lockgate.gateway.config import GatewayConfig, RequestLimits, SamplingPolicy
from lockgate.trainer.tiny_models.builder import ensure_tiny_model

ADMIN = "admin-token-for-the-sessions-load"


@dataclass
class Agent:
    session_id: str
    base_url: str
    answers: list[dict[str, Any]] = field(default_factory=list)  # per answered turn
    errors: list[str] = field(default_factory=list)


@dataclass
class Result:
    sessions: int
    duration_s: float
    calls: int
    calls_per_s: float
    tokens: int
    errors: int
    reconciled_calls: int
    mismatches: list[str]
    p50_ms: float
    p99_ms: float
    rss_mib: list[tuple[float, float]]  # (seconds since start, gateway RSS MiB)


async def _agent(
    http: httpx.AsyncClient, agent: Agent, until: float, max_tokens: int, latencies: list[float]
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me about the river."}]
    turn = 0
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            r = await http.post(
                f"{agent.base_url}/chat/completions",
                json={"messages": messages, "max_tokens": max_tokens},
            )
        except httpx.HTTPError as exc:
            agent.errors.append(f"{type(exc).__name__}: {exc}")
            return
        if r.status_code != 200:
            agent.errors.append(f"{r.status_code}: {r.text[:200]}")
            return
        latencies.append(time.monotonic() - started)
        body = r.json()
        message = body["choices"][0]["message"]
        agent.answers.append({"content": message["content"], "usage": body["usage"]})
        turn += 1
        # Keep the context bounded: a long run would otherwise outgrow the model's window.
        if turn % 6 == 0:
            messages = [{"role": "user", "content": f"Start over, part {turn}."}]
        else:
            messages += [
                {"role": "assistant", "content": message["content"]},
                {"role": "user", "content": "And then?"},
            ]


def _reconcile(renderer: ChatRenderer, agent: Agent, calls: list[dict[str, Any]]) -> list[str]:
    """What differs between what the agent was told and what was recorded (nothing, we hope)."""
    wrong: list[str] = []
    if len(calls) != len(agent.answers):
        wrong.append(f"{agent.session_id}: {len(agent.answers)} answers, {len(calls)} records")
    for i, (call, answer) in enumerate(zip(calls, agent.answers, strict=False)):
        ids = call["completion_ids"]
        parsed = renderer.parse_completion(ids, call["prompt_ids"], None).message
        if (parsed.content or "") != (answer["content"] or ""):
            wrong.append(f"{agent.session_id}[{i}]: text differs from the recorded tokens")
        if answer["usage"]["completion_tokens"] != len(ids) or len(call["logprobs"]) != len(ids):
            wrong.append(f"{agent.session_id}[{i}]: token counts differ")
    return wrong


async def _sample_rss(
    pid: int, start: float, out: list[tuple[float, float]], stop: asyncio.Event
) -> None:
    proc = psutil.Process(pid)
    while not stop.is_set():
        out.append((round(time.monotonic() - start, 1), proc.memory_info().rss / 2**20))
        try:
            await asyncio.wait_for(stop.wait(), 5.0)
        except TimeoutError:
            pass


async def run(url: str, gateway_pid: int, args: argparse.Namespace, model_dir: Path) -> Result:
    limits = httpx.Limits(
        max_connections=args.sessions + 16, max_keepalive_connections=args.sessions + 16
    )
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        agents = []
        for _ in range(args.sessions):
            r = await http.post("/admin/sessions", json={"task_id": "load"}, headers=headers)
            r.raise_for_status()
            created = r.json()
            agents.append(Agent(created["session_id"], created["base_url"]))
        rss: list[tuple[float, float]] = []
        stop = asyncio.Event()
        start = time.monotonic()
        sampler = asyncio.create_task(_sample_rss(gateway_pid, start, rss, stop))
        latencies: list[float] = []
        until = start + args.duration

        async def progress() -> None:
            while time.monotonic() < until:
                await asyncio.sleep(10)
                done = sum(len(a.answers) for a in agents)
                elapsed = time.monotonic() - start
                print(
                    f"[load] {elapsed:.0f}/{args.duration:.0f}s: {done} calls "
                    f"({done / elapsed:.0f}/s), errors {sum(len(a.errors) for a in agents)}",
                    flush=True,
                )

        reporter = asyncio.create_task(progress())
        await asyncio.gather(*(_agent(http, a, until, args.max_tokens, latencies) for a in agents))
        elapsed = time.monotonic() - start
        reporter.cancel()
        stop.set()
        await sampler
        rss.append((round(elapsed, 1), psutil.Process(gateway_pid).memory_info().rss / 2**20))

        renderer = ChatRenderer(model_dir)
        mismatches: list[str] = []
        reconciled = 0
        for agent in agents:
            r = await http.get(f"/admin/sessions/{agent.session_id}/calls", headers=headers)
            r.raise_for_status()
            calls = r.json()["calls"]
            mismatches += _reconcile(renderer, agent, calls)
            reconciled += len(calls)
    answers = [a for agent in agents for a in agent.answers]
    ordered = sorted(latencies)
    return Result(
        sessions=args.sessions,
        duration_s=round(elapsed, 1),
        calls=len(answers),
        calls_per_s=round(len(answers) / elapsed, 1),
        tokens=sum(a["usage"]["completion_tokens"] for a in answers),
        errors=sum(len(a.errors) for a in agents),
        reconciled_calls=reconciled,
        mismatches=mismatches[:20],
        p50_ms=round(1000 * ordered[len(ordered) // 2], 1) if ordered else 0.0,
        p99_ms=round(1000 * ordered[int(len(ordered) * 0.99)], 1) if ordered else 0.0,
        rss_mib=[(t, round(m, 1)) for t, m in rss],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model_dir = ensure_tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        replicas = LocalReplicaSet(
            ReplicaLaunchConfig(
                model_dir=model_dir, count=args.replicas, max_model_len=2048, log_dir=work
            )
        )
        with replicas:
            config = GatewayConfig(
                model_dir=model_dir,
                replicas=replicas.urls,
                db_path=work / "trajectories.sqlite",
                admin_token=ADMIN,
                max_model_len=2048,
                sampling=SamplingPolicy(temperature=1.0),
                # 500 sessions at once: the per-session bounds are not what is measured.
                limits=RequestLimits(),
            )
            gateway = GatewayProcess(config, work)
            gateway.start()
            try:
                assert gateway.process is not None
                result = asyncio.run(run(gateway.url, gateway.process.pid, args, model_dir))
            finally:
                gateway.stop()
    print(json.dumps(asdict(result), indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(result), indent=1) + "\n")


if __name__ == "__main__":
    main()
