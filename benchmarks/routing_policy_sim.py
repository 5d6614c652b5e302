"""The gateway's routing policy alone, at scale, in virtual time: stickiness against balance.

`scale_simulation.py` runs the whole gateway over HTTP, so what it measures depends on the CPU
it gets; on a shared 2-core machine a busy neighbour stalls its event loop for seconds, and a
stalled loop routes bursts of calls on stale load counts. This runs only the routing: the
gateway's own `ReplicaPool.pick` (sticky map, session counts, `routing.choose_replica`) over
`--replicas` replicas and `--sessions` agent slots in a discrete-event simulation, with the
same agents and engine model as the scale simulation (think/tool time between turns, 32-112
tokens a call, decode steps that slow with the batch, prefill for uncached prompt tokens, a
prefix hit only on the replica that served the session's previous call). A replica's load is
its calls in flight, as the pool counts them (set here directly: there is no event loop).

It compares the sticky bound as shipped (`--max-ratio 2`: a sticky replica keeps its session
unless busier than the least-loaded by more than 4 calls and than twice the others' mean)
with the bound before (`--max-ratio 0`: more than 4 calls over the least-loaded is enough).

    PYTHONPATH=. .venv/bin/python -m benchmarks.routing_policy_sim
"""

from __future__ import annotations

import argparse
import functools
import heapq
import random
from dataclasses import dataclass, field
from unittest import mock

import httpx

from benchmarks.scale_simulation import imbalance
from benchmarks.sim_replicas import EngineModel
from lockgate.gateway.replicas import pool as pool_module
from lockgate.gateway.replicas.pool import ReplicaPool
from lockgate.gateway.replicas.routing import choose_replica

_ENGINE = EngineModel()


@dataclass
class _Slot:
    session: str = ""
    turn: int = 0
    prompt: int = 0  # tokens of history so far
    replica: str | None = None  # that served the previous call


@dataclass
class PolicyResult:
    max_ratio: float
    calls: int = 0
    followups: int = 0
    sticky: int = 0
    tokens: dict[str, int] = field(default_factory=dict)

    @property
    def sticky_rate(self) -> float:
        return self.sticky / self.followups if self.followups else float("nan")

    @property
    def imbalance(self) -> float:
        return imbalance(list(self.tokens.values()))


def simulate_policy(
    *,
    replicas: int,
    sessions: int,
    turns: int,
    think_s: float,
    duration_s: float,
    max_ratio: float,
    seed: int = 0,
    engine: EngineModel = _ENGINE,
) -> PolicyResult:
    rng = random.Random(seed)
    urls = [f"http://replica-{i}" for i in range(replicas)]
    pool = ReplicaPool(urls, httpx.AsyncClient())
    state = pool._replicas  # the pool's own load records: in_flight set as a lease would
    result = PolicyResult(max_ratio, tokens=dict.fromkeys(urls, 0))
    slots = [_Slot() for _ in range(sessions)]
    events: list[tuple[float, int, str, int]] = []  # (time, tie-break, kind, slot)
    seq = 0

    def at(t: float, kind: str, i: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, i))

    for i in range(sessions):
        at(rng.uniform(0, min(10.0, duration_s)), "start", i)
    picker = functools.partial(choose_replica, max_ratio=max_ratio)
    n_sessions = 0
    with mock.patch.object(pool_module, "choose_replica", picker):
        while events:
            now, _, kind, i = heapq.heappop(events)
            slot = slots[i]
            if kind == "start":
                if now >= duration_s:
                    continue
                n_sessions += 1
                slot.session, slot.turn, slot.prompt, slot.replica = f"s{n_sessions}", 0, 300, None
                kind = "call"
            if kind == "call":
                client = pool.pick(slot.session, 0)
                assert client is not None
                url = client.url
                if slot.replica is not None:
                    result.followups += 1
                    result.sticky += url == slot.replica
                new = slot.prompt - (slot.prompt // 16 * 16 if url == slot.replica else 0)
                tokens = rng.randint(32, 112)
                running = state[url].in_flight
                step = engine.step_base_s + engine.step_per_seq_s * running
                gen_s = engine.prefill_s_per_token * new + tokens * step
                state[url].in_flight += 1
                result.calls += 1
                result.tokens[url] += tokens
                slot.replica = url
                slot.prompt += tokens + rng.randint(50, 400)  # the answer, the tool's output
                at(now + gen_s, "done", i)
            elif kind == "done":
                assert slot.replica is not None
                state[slot.replica].in_flight -= 1
                slot.turn += 1
                if slot.turn < turns:
                    at(now + rng.uniform(0.2, 1.8) * think_s, "call", i)
                else:
                    pool.forget_session(slot.session)  # the session is finished
                    at(now, "start", i)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--duration", type=float, default=600.0, help="virtual seconds")
    parser.add_argument("--think", type=lambda s: [float(x) for x in s.split(",")])
    parser.add_argument("--max-ratio", type=lambda s: [float(x) for x in s.split(",")])
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(think=[3.0, 12.0], max_ratio=[0.0, 2.0])
    args = parser.parse_args()
    print("| think s | max_ratio | calls | sticky | token imbalance |")
    print("|---:|---:|---:|---:|---:|")
    for think in args.think:
        for ratio in args.max_ratio:
            r = simulate_policy(
                replicas=args.replicas,
                sessions=args.sessions,
                turns=args.turns,
                think_s=think,
                duration_s=args.duration,
                max_ratio=ratio,
                seed=args.seed,
            )
            print(
                f"| {think:g} | {ratio:g} | {r.calls} | {r.sticky_rate:.2%} | {r.imbalance:.1%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
